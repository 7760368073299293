\set c random(1, 1000)
BEGIN;
INSERT INTO bench_orders (customer, total) VALUES (:c, 12.5) RETURNING id;
INSERT INTO bench_events (topic, key, value)
VALUES ('orders', ('c-' || :c)::bytea, '{"order":1,"customer":17,"total":"12.50"}'::bytea);
COMMIT;
