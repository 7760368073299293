\set c random(1, 1000)
BEGIN;
INSERT INTO bench_orders (customer, total) VALUES (:c, 12.5) RETURNING id;
INSERT INTO bench_messages_pk_only (id, topic, key, value, header_names, header_values, idempotency_key)
VALUES (gen_random_uuid(), 'orders'::text, ('c-' || :c)::bytea, '{"order":1,"customer":17,"total":"12.50"}'::bytea, ARRAY['content-type']::text[], ARRAY['application/json'::bytea]::bytea[], NULL::text)
RETURNING id;
COMMIT;
