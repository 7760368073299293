\set c random(1, 1000)
BEGIN;
INSERT INTO bench_orders (customer, total) VALUES (:c, 12.5) RETURNING id;
SELECT pg_advisory_xact_lock(hashtextextended('orders' || E'\n' || encode(('c-' || :c)::bytea, 'hex'), 0));
COMMIT;
