-- Every statement the library and the publisher send, by name.
-- outbox/queries.py loads this file once; placeholders are psycopg's.
-- A block starts with a line "-- name: <name>" and runs to the next one.

-- name: insert_messages
-- Insert intents; {rows} is one "(%s, ...)" group per intent. A row whose
-- idempotency key is already taken is skipped, and its id is not returned.
INSERT INTO outbox.messages
    (id, topic, key, value, header_names, header_values, idempotency_key)
VALUES {rows}
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id

-- name: ids_by_idempotency_key
SELECT idempotency_key, id
FROM outbox.messages
WHERE idempotency_key = ANY(%(keys)s::text[])

-- name: claim_batch
-- Lease the next pending messages to one publisher, oldest first. SKIP LOCKED
-- lets publishers claim side by side; every claim raises the row's fence.
WITH next AS (
    SELECT id
    FROM outbox.messages
    WHERE state = 'pending' AND available_at <= now()
    ORDER BY seq
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE outbox.messages AS m
    SET state = 'in_flight',
        lease_owner = %(owner)s,
        lease_expires_at = now() + make_interval(secs => %(lease_seconds)s),
        fence = m.fence + 1,
        attempts = m.attempts + 1,
        updated_at = now()
    FROM next
    WHERE m.id = next.id
    RETURNING m.id, m.seq, m.topic, m.key, m.value, m.header_names, m.header_values,
              m.fence, m.attempts
)
SELECT id, topic, key, value, header_names, header_values, fence, attempts, now()
FROM claimed
ORDER BY seq

-- name: settle_batch
-- Record the outcome of every message of a batch in one statement, together
-- with its attempt record. Only rows still in flight under the same fence
-- change: a publisher that lost its lease changes nothing.
WITH outcome AS (
    SELECT *
    FROM unnest(%(ids)s::uuid[], %(fences)s::bigint[], %(states)s::text[],
                %(outcomes)s::text[], %(partitions)s::integer[], %(offsets)s::bigint[],
                %(retry_after)s::float8[], %(errors)s::text[], %(send_began)s::boolean[])
         AS o(id, fence, state, outcome, kafka_partition, kafka_offset,
              retry_after, error, send_began)
), settled AS (
    UPDATE outbox.messages AS m
    SET state = o.state,
        kafka_partition = o.kafka_partition,
        kafka_offset = o.kafka_offset,
        delivered_at = CASE WHEN o.state = 'delivered' THEN now() END,
        available_at = CASE WHEN o.state = 'pending'
                            THEN now() + make_interval(secs => o.retry_after)
                            ELSE m.available_at END,
        last_error = o.error,
        lease_owner = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    FROM outcome AS o
    WHERE m.id = o.id AND m.fence = o.fence AND m.state = 'in_flight'
    RETURNING m.id, m.attempts, o.fence, o.outcome, o.error, o.send_began,
              o.kafka_partition, o.kafka_offset
), recorded AS (
    INSERT INTO outbox.attempts
        (message_id, attempt, publisher_id, fence, started_at, send_began, finished_at,
         outcome, error, kafka_partition, kafka_offset)
    SELECT id, attempts, %(publisher)s, fence, %(started_at)s, send_began, now(),
           outcome, error, kafka_partition, kafka_offset
    FROM settled
)
SELECT id FROM settled

-- name: seconds_until_available
-- Seconds until the earliest pending message becomes claimable (zero or less:
-- claimable now); NULL when no message is pending. Measured by the database
-- clock, the same clock that set available_at.
SELECT extract(epoch FROM min(available_at) - clock_timestamp())::float8
FROM outbox.messages
WHERE state = 'pending'

-- name: register_publisher
INSERT INTO outbox.publishers (id, host, pid, version)
VALUES (%(id)s, %(host)s, %(pid)s, %(version)s)

-- name: heartbeat_publisher
UPDATE outbox.publishers SET heartbeat_at = now() WHERE id = %(id)s

-- name: stop_publisher
UPDATE outbox.publishers SET stopped_at = now(), heartbeat_at = now() WHERE id = %(id)s

-- name: status
SELECT state, messages, oldest_created_at, healthy, next_action
FROM outbox.status
