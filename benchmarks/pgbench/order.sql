\set c random(1, 1000)
BEGIN;
INSERT INTO bench_orders (customer, total) VALUES (:c, 12.5) RETURNING id;
COMMIT;
