\set c random(1, 1000)
BEGIN;
INSERT INTO bench_orders (customer, total) VALUES (:c, 12.5) RETURNING id;
WITH intent (id, topic, key, value, header_names, header_values, idempotency_key) AS (
    VALUES (gen_random_uuid(), 'orders'::text, ('c-' || :c)::bytea, '{"order":1,"customer":17,"total":"12.50"}'::bytea, ARRAY['content-type']::text[], ARRAY['application/json'::bytea]::bytea[], NULL::text)
), lock_key AS MATERIALIZED (
    SELECT DISTINCT hashtextextended(topic || E'\n' || encode(key, 'hex'), 0) AS lock_key
    FROM intent
    WHERE key IS NOT NULL AND true
), all_keys_locked AS MATERIALIZED (
    SELECT after,
           CASE WHEN held >= 0 AND after < 0
                THEN pg_advisory_xact_lock('outbox.messages'::regclass::oid::integer, 0)
                WHEN held = 0 AND after > 0
                THEN pg_advisory_xact_lock_shared('outbox.messages'::regclass::oid::integer, 0)
           END AS locked
    FROM (SELECT held,
                 CASE WHEN held < 0 OR wanted = 0 THEN held
                      WHEN held + wanted > current_setting('max_locks_per_transaction')::integer
                      THEN -1
                      ELSE held + wanted END AS after
          FROM (SELECT coalesce(nullif(current_setting('outbox.enqueue_key_locks', true), ''),
                                '0')::integer AS held,
                       count(*)::integer AS wanted
                FROM lock_key) AS counted) AS budget
), key_locks_held AS MATERIALIZED (
    SELECT set_config('outbox.enqueue_key_locks', after::text, true)::integer AS held
    FROM all_keys_locked,
         (SELECT count(pg_advisory_xact_lock(k.lock_key)) AS locks
          FROM (SELECT lock_key FROM lock_key ORDER BY lock_key) AS k
          WHERE (SELECT after FROM all_keys_locked) >= 0) AS keys_locked
)
INSERT INTO outbox.messages
    (id, topic, key, value, header_names, header_values, idempotency_key)
SELECT id, topic, key, value, header_names, header_values, idempotency_key
FROM intent
WHERE (SELECT held FROM key_locks_held) IS NOT NULL
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id;
COMMIT;
