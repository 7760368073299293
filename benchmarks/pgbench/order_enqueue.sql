\set c random(1, 1000)
BEGIN;
INSERT INTO bench_orders (customer, total) VALUES (:c, 12.5) RETURNING id;
WITH intent (id, topic, key, value, header_names, header_values, idempotency_key) AS (
    VALUES (gen_random_uuid(), 'orders'::text, ('c-' || :c)::bytea, '{"order":1,"customer":17,"total":"12.50"}'::bytea, ARRAY['content-type']::text[], ARRAY['application/json'::bytea]::bytea[], NULL::text)
), locked AS (
    SELECT count(pg_advisory_xact_lock(lock_key)) AS keys
    FROM (SELECT DISTINCT hashtextextended(topic || E'\n' || encode(key, 'hex'), 0) AS lock_key
          FROM intent WHERE key IS NOT NULL ORDER BY lock_key) AS keys
)
INSERT INTO outbox.messages (id, topic, key, value, header_names, header_values, idempotency_key)
SELECT id, topic, key, value, header_names, header_values, idempotency_key FROM intent
WHERE (SELECT keys FROM locked) >= 0
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id;
COMMIT;
