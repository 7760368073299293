\set c random(1, 1000)
BEGIN;
INSERT INTO bench_orders (customer, total) VALUES (:c, 12.5) RETURNING id;
INSERT INTO bench_orders (customer, total) VALUES (:c, 13.5) RETURNING id;
COMMIT;
