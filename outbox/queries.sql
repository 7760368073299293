-- Every statement the library and the publisher send, by name.
-- outbox/queries.py loads this file once; placeholders are psycopg's.
-- A block starts with a line "-- name: <name>" and runs to the next one.

-- name: insert_messages
-- Insert intents; {rows} is one typed "(%s, ...)" group per intent. First,
-- take a transaction-scoped advisory lock per key (in a fixed order, so two
-- transactions never wait on each other in a cycle): enqueues of one key
-- serialise until commit, so one key's seq follow its commit order. The locks
-- are taken before any row (and its seq) is produced. A row whose idempotency
-- key is already taken is skipped, and its id is not returned.
WITH intent (id, topic, key, value, header_names, header_values, idempotency_key) AS (
    VALUES {rows}
), locked AS (
    SELECT count(pg_advisory_xact_lock(lock_key)) AS keys
    FROM (SELECT DISTINCT hashtextextended(topic || E'\n' || encode(key, 'hex'), 0) AS lock_key
          FROM intent
          WHERE key IS NOT NULL
          ORDER BY lock_key) AS keys
)
INSERT INTO outbox.messages
    (id, topic, key, value, header_names, header_values, idempotency_key)
SELECT id, topic, key, value, header_names, header_values, idempotency_key
FROM intent
WHERE (SELECT keys FROM locked) >= 0
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id

-- name: ids_by_idempotency_key
SELECT idempotency_key, id
FROM outbox.messages
WHERE idempotency_key = ANY(%(keys)s::text[])

-- name: claim_batch
-- Lease the next claimable messages of this publisher's lanes to it, oldest
-- first, and record the claim as a batch (only when something was claimed). A keyed
-- message is claimable only when every earlier open message of its key is
-- claimable too (pending and due): an earlier one in flight, uncertain,
-- quarantined or waiting out a retry holds its key back, and only its key.
-- SKIP LOCKED lets publishers claim side by side; every claim raises the fence.
-- A claim clears the partition and offset an earlier attempt stored: this
-- attempt's partition is chosen afresh (the topic may have grown since), and a
-- stale one would send the reconciler to look for its record in the wrong place.
-- {horizon} is empty, or (for a claim made ahead, while a batch is in flight)
-- a bound on the candidates: only the oldest few pending messages are looked
-- at, so a claim-ahead whose keys are all in flight gives up after a few
-- index probes instead of reading the whole backlog. An ordinary claim has
-- no bound, so a long queue behind one held key never hides other keys.
WITH mine AS (
    -- The lanes this publisher owns. FOR SHARE: a lane cannot change owner
    -- while one of its claims runs, so two publishers never claim in one lane.
    SELECT lane
    FROM outbox.lanes
    WHERE owner = %(owner)s AND lease_expires_at > now()
    FOR SHARE
), next AS (
    SELECT m.id
    FROM outbox.messages AS m
    WHERE m.state = 'pending' AND m.available_at <= now()
      AND m.lane IN (SELECT lane FROM mine)
      {horizon}
      AND (m.key IS NULL OR NOT EXISTS (
          SELECT 1
          FROM outbox.messages AS e
          WHERE e.key_hash = m.key_hash AND e.seq < m.seq
            AND e.key IS NOT NULL
            AND (e.state IN ('in_flight', 'uncertain', 'quarantined')
                 OR (e.state = 'pending' AND e.failures > 0))
            AND e.topic = m.topic AND e.key = m.key
            AND NOT (e.state = 'pending' AND e.available_at <= now())))
    ORDER BY m.seq
    LIMIT %(limit)s
    FOR UPDATE OF m SKIP LOCKED
), batch AS (
    INSERT INTO outbox.batches (publisher_id)
    SELECT %(owner)s WHERE EXISTS (SELECT 1 FROM next)
    RETURNING id, claimed_at
), claimed AS (
    UPDATE outbox.messages AS m
    SET state = 'in_flight',
        lease_owner = %(owner)s,
        lease_expires_at = now() + make_interval(secs => %(lease_seconds)s),
        fence = m.fence + 1,
        attempts = m.attempts + 1,
        batch_id = (SELECT id FROM batch),
        kafka_partition = NULL,
        kafka_offset = NULL,
        updated_at = now()
    -- An id list, not a join: the planner then looks each row up by its key
    -- instead of hashing the whole table.
    WHERE m.id = ANY (ARRAY(SELECT id FROM next))
    RETURNING m.id, m.seq, m.topic, m.key, m.value, m.header_names, m.header_values,
              m.fence, m.attempts, m.failures, m.send_alone, m.created_at
)
SELECT c.id, c.topic, c.key, c.value, c.header_names, c.header_values, c.fence, c.attempts,
       c.failures, c.send_alone, b.id, b.claimed_at, c.created_at
FROM claimed AS c CROSS JOIN batch AS b
ORDER BY c.seq

-- name: lock_batch
-- First half of marking a batch as sending: wait for anyone (recovery) that
-- holds the batch row, so that the next statement sees what they did.
SELECT id FROM outbox.batches WHERE id = %(batch_id)s FOR UPDATE

-- name: mark_sending
-- Second half, same transaction, fresh snapshot: record that sending begins
-- and return the messages of the batch this publisher still holds. Recovery
-- locks the batch row too, so it either ran before (and those messages are not
-- returned) or runs after and sees send_began_at. In transactional delivery
-- the batch records the transactional.id it is sent under (NULL otherwise),
-- and the publisher row the session in use.
WITH held AS (
    SELECT id
    FROM outbox.messages
    WHERE batch_id = %(batch_id)s AND state = 'in_flight' AND lease_owner = %(owner)s
      AND lease_expires_at > now()
), marked AS (
    UPDATE outbox.batches
    SET send_began_at = clock_timestamp(),
        write_deadline = clock_timestamp() + make_interval(secs => %(longest_send_seconds)s),
        transactional_id = %(transactional_id)s,
        partition_counts = %(partition_counts)s,
        confirmed_offsets = (
            SELECT coalesce(jsonb_object_agg(topic, offsets), '{}')
            FROM (SELECT topic, jsonb_object_agg(kafka_partition::text, confirmed_offset) AS offsets
                  FROM outbox.partition_offsets
                  WHERE topic = ANY(%(topics)s::text[])
                  GROUP BY topic) AS per_topic
        )
    WHERE id = %(batch_id)s AND EXISTS (SELECT 1 FROM held)
), session AS (
    UPDATE outbox.publishers SET transactional_id = %(transactional_id)s
    WHERE id = %(owner)s AND transactional_id IS DISTINCT FROM %(transactional_id)s
)
SELECT id FROM held

-- name: settle_batch
-- Record the outcome of every message of a batch in one statement, together
-- with its attempt record and the highest confirmed offset per partition.
-- Only rows still in flight under the same fence change: a publisher that
-- lost its lease changes nothing. An uncertain message waits until the
-- producer that sent it can no longer write before it is reconciled: its
-- write deadline; or, sent in a transaction, none (the reconciler fences the
-- transactional.id before it reads the log).
WITH outcome AS (
    SELECT *
    FROM unnest(%(ids)s::uuid[], %(fences)s::bigint[], %(states)s::text[],
                %(outcomes)s::text[], %(partitions)s::integer[], %(offsets)s::bigint[],
                %(retry_after)s::float8[], %(errors)s::text[], %(send_began)s::boolean[],
                %(failures)s::boolean[], %(send_alone)s::boolean[])
         AS o(id, fence, state, outcome, kafka_partition, kafka_offset,
              retry_after, error, send_began, counts_as_failure, send_alone)
), batch AS (
    SELECT claimed_at,
           CASE WHEN transactional_id IS NULL THEN write_deadline END AS write_deadline
    FROM outbox.batches WHERE id = %(batch_id)s
), settled AS (
    UPDATE outbox.messages AS m
    SET state = o.state,
        kafka_partition = o.kafka_partition,
        kafka_offset = o.kafka_offset,
        delivered_at = CASE WHEN o.state = 'delivered' THEN now() END,
        available_at = CASE o.state
                           WHEN 'pending' THEN now() + make_interval(secs => o.retry_after)
                           WHEN 'uncertain' THEN greatest(now(), (SELECT write_deadline FROM batch))
                           ELSE m.available_at END,
        last_error = o.error,
        failures = CASE WHEN o.counts_as_failure THEN m.failures + 1 ELSE m.failures END,
        send_alone = o.send_alone,
        lease_owner = NULL,
        lease_expires_at = NULL,
        updated_at = now()
    FROM outcome AS o
    WHERE m.id = o.id AND m.fence = o.fence AND m.state = 'in_flight'
    RETURNING m.id, m.topic, m.attempts, o.fence, o.outcome, o.error, o.send_began,
              o.kafka_partition, o.kafka_offset
), recorded AS (
    INSERT INTO outbox.attempts
        (message_id, attempt, publisher_id, fence, started_at, send_began, finished_at,
         outcome, error, kafka_partition, kafka_offset, batch_id)
    SELECT id, attempts, %(publisher)s, fence, (SELECT claimed_at FROM batch), send_began, now(),
           outcome, error, kafka_partition, kafka_offset, %(batch_id)s
    FROM settled
), confirmed AS (
    INSERT INTO outbox.partition_offsets AS po (topic, kafka_partition, confirmed_offset)
    SELECT topic, kafka_partition, max(kafka_offset)
    FROM settled
    WHERE outcome = 'delivered'
    GROUP BY topic, kafka_partition
    ON CONFLICT (topic, kafka_partition) DO UPDATE
    SET confirmed_offset = greatest(po.confirmed_offset, excluded.confirmed_offset),
        updated_at = now()
), closed AS (
    UPDATE outbox.batches SET settled_at = now()
    WHERE id = %(batch_id)s AND EXISTS (SELECT 1 FROM settled)
)
SELECT id FROM settled

-- name: recover_expired_leases
-- Move messages whose lease expired, by the evidence of their batch: nothing
-- was sent (send_began_at is NULL) -> pending; sending may have begun ->
-- uncertain. Each gets an 'abandoned' attempt saying why. The batch rows are
-- locked with the messages (see mark_sending); locked rows are left for the
-- next pass.
WITH expired AS (
    SELECT m.id, m.fence, m.attempts, m.lease_owner, m.lease_expires_at, m.batch_id,
           b.claimed_at, b.send_began_at, p.heartbeat_at,
           CASE WHEN b.transactional_id IS NULL THEN b.write_deadline END AS write_deadline
    FROM outbox.messages AS m
    JOIN outbox.batches AS b ON b.id = m.batch_id
    LEFT JOIN outbox.publishers AS p ON p.id = m.lease_owner
    WHERE m.state = 'in_flight' AND m.lease_expires_at < now()
    ORDER BY m.seq
    LIMIT %(limit)s
    FOR UPDATE OF m, b SKIP LOCKED
), decided AS (
    SELECT e.*,
           CASE WHEN e.send_began_at IS NULL THEN 'pending' ELSE 'uncertain' END AS next_state,
           format('lease of publisher %%s expired at %%s (last heartbeat %%s); %%s',
                  e.lease_owner, e.lease_expires_at, coalesce(e.heartbeat_at::text, 'never'),
                  CASE WHEN e.send_began_at IS NULL
                       THEN 'sending had not begun, so nothing was sent'
                       ELSE format('sending began at %%s, so the record may be in Kafka',
                                   e.send_began_at) END) AS reason
    FROM expired AS e
), moved AS (
    UPDATE outbox.messages AS m
    SET state = d.next_state,
        lease_owner = NULL,
        lease_expires_at = NULL,
        available_at = CASE WHEN d.next_state = 'pending' THEN now()
                            ELSE greatest(now(), d.write_deadline) END,
        last_error = d.reason,
        updated_at = now()
    FROM decided AS d
    WHERE m.id = d.id
    RETURNING m.id
), recorded AS (
    INSERT INTO outbox.attempts
        (message_id, attempt, publisher_id, fence, started_at, send_began, finished_at,
         outcome, error, batch_id)
    SELECT id, attempts, lease_owner, fence, claimed_at, send_began_at IS NOT NULL, now(),
           'abandoned', reason, batch_id
    FROM decided
    ON CONFLICT (message_id, attempt) DO NOTHING
)
SELECT d.id, d.next_state, d.attempts, d.fence, d.batch_id, d.lease_owner
FROM decided AS d JOIN moved USING (id)

-- name: recover_unrecorded_leases
-- Messages in flight with an expired lease and no batch (rows written by an
-- older version or edited by hand): whether sending began is unknown, so they
-- become uncertain, with a legacy attempt that records what is known.
WITH expired AS (
    SELECT m.id, m.fence, m.attempts, m.lease_owner, m.lease_expires_at, m.updated_at
    FROM outbox.messages AS m
    WHERE m.state = 'in_flight' AND m.lease_expires_at < now()
      AND (m.batch_id IS NULL
           OR NOT EXISTS (SELECT 1 FROM outbox.batches AS b WHERE b.id = m.batch_id))
    ORDER BY m.seq
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE outbox.messages AS m
    SET state = 'uncertain',
        lease_owner = NULL,
        lease_expires_at = NULL,
        available_at = now(),
        last_error = format('legacy: in flight under publisher %%s with no attempt record; '
                            'lease expired at %%s; whether sending began is unknown',
                            e.lease_owner, e.lease_expires_at),
        updated_at = now()
    FROM expired AS e
    WHERE m.id = e.id
    RETURNING m.id, m.last_error
), recorded AS (
    INSERT INTO outbox.attempts
        (message_id, attempt, publisher_id, fence, started_at, send_began, finished_at,
         outcome, error)
    SELECT e.id, e.attempts, e.lease_owner, e.fence, e.updated_at, true, now(),
           'abandoned', mv.last_error
    FROM expired AS e JOIN moved AS mv USING (id)
    ON CONFLICT (message_id, attempt) DO NOTHING
)
SELECT e.id, 'uncertain', e.attempts, e.fence, NULL::bigint, e.lease_owner
FROM expired AS e JOIN moved USING (id)

-- name: uncertain_due
-- Uncertain messages whose producer can no longer write, with the evidence
-- of their batch, for the reconciler; and whether the grace after that has
-- passed too, so that a record's absence proves it was never written. A
-- message sent in a transaction needs no grace: the reconciler fences its
-- transactional.id and reads only committed records.
SELECT m.id, m.topic, m.key, m.fence, m.kafka_partition, b.partition_counts,
       b.confirmed_offsets, m.seq,
       b.transactional_id IS NOT NULL
           OR m.available_at + make_interval(secs => %(grace)s::float8) <= now(),
       b.transactional_id
FROM outbox.messages AS m
LEFT JOIN outbox.batches AS b ON b.id = m.batch_id
WHERE m.state = 'uncertain' AND m.escalated_at IS NULL AND m.available_at <= now()
ORDER BY m.seq
LIMIT %(limit)s

-- name: later_of_key
-- Of the given message ids, those that come after message %(id)s in its
-- key's order (same topic and key, a higher seq): a record of one of them in
-- Kafka means the key has moved on past the uncertain message.
SELECT later.id
FROM outbox.messages AS later
JOIN outbox.messages AS m ON m.id = %(id)s
WHERE later.id = ANY(%(ids)s::uuid[])
  AND later.topic = m.topic AND later.key = m.key AND later.seq > m.seq

-- name: decide_uncertain
-- Apply the reconciler's decisions, each with its evidence, in one statement.
-- to_state 'uncertain' escalates: the evidence is gone and an operator decides.
WITH d AS (
    SELECT *
    FROM unnest(%(ids)s::uuid[], %(fences)s::bigint[], %(to_states)s::text[],
                %(partitions)s::integer[], %(offsets)s::bigint[], %(reasons)s::text[],
                %(evidence)s::jsonb[])
         AS d(id, fence, to_state, kafka_partition, kafka_offset, reason, evidence)
), decided AS (
    UPDATE outbox.messages AS m
    SET state = d.to_state,
        kafka_partition = coalesce(d.kafka_partition, m.kafka_partition),
        kafka_offset = d.kafka_offset,
        delivered_at = CASE WHEN d.to_state = 'delivered' THEN now() END,
        available_at = CASE WHEN d.to_state = 'pending' THEN now() ELSE m.available_at END,
        escalated_at = CASE WHEN d.to_state = 'uncertain' THEN now() END,
        last_error = CASE WHEN d.to_state = 'delivered' THEN NULL ELSE d.reason END,
        updated_at = now()
    FROM d
    WHERE m.id = d.id AND m.fence = d.fence AND m.state = 'uncertain'
      AND m.escalated_at IS NULL
    RETURNING m.id, m.topic, d.to_state, d.kafka_partition, d.kafka_offset, d.reason,
              d.evidence
), logged AS (
    INSERT INTO outbox.decisions (message_id, decided_by, from_state, to_state, reason, evidence)
    SELECT id, %(decided_by)s, 'uncertain', to_state, reason, evidence
    FROM decided
), confirmed AS (
    INSERT INTO outbox.partition_offsets AS po (topic, kafka_partition, confirmed_offset)
    SELECT topic, kafka_partition, max(kafka_offset)
    FROM decided
    WHERE to_state = 'delivered'
    GROUP BY topic, kafka_partition
    ON CONFLICT (topic, kafka_partition) DO UPDATE
    SET confirmed_offset = greatest(po.confirmed_offset, excluded.confirmed_offset),
        updated_at = now()
)
SELECT id FROM decided

-- name: resolve_message
-- An operator's decision on one message, recorded with its reason. Only
-- messages in one of from_states move; the result says which state it was in.
WITH target AS (
    SELECT id, state FROM outbox.messages WHERE id = %(id)s FOR UPDATE
), decision AS (
    SELECT %(to_state)s::text AS to_state, %(reason)s::text AS reason,
           %(partition)s::integer AS kafka_partition, %(offset)s::bigint AS kafka_offset
), moved AS (
    UPDATE outbox.messages AS m
    SET state = d.to_state,
        kafka_partition = CASE WHEN d.to_state = 'delivered'
                               THEN coalesce(d.kafka_partition, m.kafka_partition) END,
        kafka_offset = CASE WHEN d.to_state = 'delivered' THEN d.kafka_offset END,
        delivered_at = CASE WHEN d.to_state = 'delivered' THEN now() END,
        available_at = CASE WHEN d.to_state = 'pending' THEN now() ELSE m.available_at END,
        escalated_at = NULL,
        failures = 0,
        last_error = CASE WHEN d.to_state = 'delivered' THEN NULL
                          ELSE format('%%s by an operator: %%s', d.to_state, d.reason) END,
        updated_at = now()
    FROM target AS t, decision AS d
    WHERE m.id = t.id AND t.state = ANY(%(from_states)s::text[])
    RETURNING m.id, t.state AS from_state, d.to_state, d.reason
), logged AS (
    INSERT INTO outbox.decisions (message_id, decided_by, from_state, to_state, reason, evidence)
    SELECT id, %(decided_by)s, from_state, to_state, reason, %(evidence)s
    FROM moved
)
SELECT (SELECT state FROM target), EXISTS (SELECT 1 FROM moved)

-- name: retry_quarantined
-- An operator sends every quarantined message (of one topic, or all) again,
-- with a fresh retry budget; each decision is recorded with its reason.
WITH moved AS (
    UPDATE outbox.messages AS m
    SET state = 'pending',
        available_at = now(),
        failures = 0,
        last_error = format('pending by an operator: %%s', %(reason)s::text),
        updated_at = now()
    WHERE m.state = 'quarantined' AND (%(topic)s::text IS NULL OR m.topic = %(topic)s::text)
    RETURNING m.id
), logged AS (
    INSERT INTO outbox.decisions (message_id, decided_by, from_state, to_state, reason)
    SELECT id, %(decided_by)s, 'quarantined', 'pending', %(reason)s::text
    FROM moved
)
SELECT id FROM moved

-- name: held_keys
SELECT topic, key, held_by, state, waiting, reason, next_action
FROM outbox.held_keys
ORDER BY topic, key

-- name: work_left
-- Whether anything may still need a publisher: a message in flight, uncertain
-- and not yet escalated, or pending and not held back behind a message only
-- an operator can move (quarantined, or uncertain and escalated).
SELECT EXISTS (SELECT 1 FROM outbox.messages WHERE state = 'in_flight')
    OR EXISTS (SELECT 1 FROM outbox.messages WHERE state = 'uncertain' AND escalated_at IS NULL)
    OR EXISTS (
        SELECT 1
        FROM outbox.messages AS m
        WHERE m.state = 'pending'
          AND (m.key IS NULL OR NOT EXISTS (
              SELECT 1
              FROM outbox.messages AS e
              WHERE e.key_hash = m.key_hash AND e.seq < m.seq
                AND e.key IS NOT NULL
                AND (e.state IN ('in_flight', 'uncertain', 'quarantined')
                     OR (e.state = 'pending' AND e.failures > 0))
                AND e.topic = m.topic AND e.key = m.key
                AND (e.state = 'quarantined'
                     OR (e.state = 'uncertain' AND e.escalated_at IS NOT NULL)))))

-- name: seconds_until_due
-- Seconds until the next message needs this publisher: a pending message
-- becomes claimable, a lease expires, or an uncertain message can be
-- reconciled (zero or less: now). NULL when none will. Measured by the
-- database clock, the same clock that set those times.
SELECT extract(epoch FROM least(
           (SELECT min(available_at) FROM outbox.messages WHERE state = 'pending'),
           (SELECT min(lease_expires_at) FROM outbox.messages WHERE state = 'in_flight'),
           (SELECT min(available_at) FROM outbox.messages
            WHERE state = 'uncertain' AND escalated_at IS NULL)
       ) - clock_timestamp())::float8

-- name: pin_read_committed
-- Every transaction of the session, implicit (autocommit) or begun, runs at
-- READ COMMITTED whatever default_transaction_isolation the server, database
-- or role sets (see publisher/connector.py).
SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED

-- name: register_publisher
INSERT INTO outbox.publishers (id, host, pid, version)
VALUES (%(id)s, %(host)s, %(pid)s, %(version)s)

-- name: heartbeat
-- Say this publisher is alive and, when asked to, renew the leases it holds
-- that would expire soon, of the batches its loop still works on (all of
-- them when batches is NULL): a batch the loop gave up on, or never heard
-- of (its claim's answer was lost), is left to expire and to recovery. An
-- expired lease is never renewed: once expired, a message belongs to
-- recovery. Rows locked by a settle in progress are skipped (they are
-- leaving in_flight), so a heartbeat never waits on one.
WITH alive AS (
    UPDATE outbox.publishers SET heartbeat_at = now() WHERE id = %(id)s
), expiring AS (
    SELECT id
    FROM outbox.messages
    WHERE %(renew)s AND state = 'in_flight' AND lease_owner = %(id)s
      AND (%(batches)s::bigint[] IS NULL OR batch_id = ANY(%(batches)s::bigint[]))
      AND lease_expires_at > now()
      AND lease_expires_at < now() + make_interval(secs => %(lease_seconds)s::float8 / 2)
    FOR UPDATE SKIP LOCKED
), renewed AS (
    UPDATE outbox.messages AS m
    SET lease_expires_at = now() + make_interval(secs => %(lease_seconds)s::float8)
    FROM expiring AS e
    WHERE m.id = e.id
    RETURNING m.id
)
SELECT count(*) FROM renewed

-- name: renew_lanes
-- Renew the leases of the lanes this publisher owns; an expired one is lost
-- (another publisher may have taken it). Returns the lanes still owned.
UPDATE outbox.lanes
SET lease_expires_at = now() + make_interval(secs => %(lease_seconds)s::float8)
WHERE owner = %(owner)s AND lease_expires_at > now()
RETURNING lane

-- name: fair_share
-- How many lanes each live publisher should own (rounded up).
SELECT ceil((SELECT count(*) FROM outbox.lanes)::numeric
            / greatest(count(*), 1))::integer
FROM outbox.publishers
WHERE stopped_at IS NULL
  AND heartbeat_at > now() - make_interval(secs => %(lease_seconds)s::float8)

-- name: acquire_lanes
-- Take up to %(count)s lanes that nobody owns or whose owner's lease expired.
WITH free AS (
    SELECT lane
    FROM outbox.lanes
    WHERE owner IS NULL OR lease_expires_at < now()
    ORDER BY lane
    LIMIT %(count)s
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox.lanes AS l
SET owner = %(owner)s,
    lease_expires_at = now() + make_interval(secs => %(lease_seconds)s::float8),
    fence = l.fence + 1,
    acquired_at = now()
FROM free
WHERE l.lane = free.lane
RETURNING l.lane

-- name: release_lanes
-- Give lanes up (all of this publisher's when lanes is NULL), for others to take.
UPDATE outbox.lanes
SET owner = NULL, lease_expires_at = NULL, fence = fence + 1
WHERE owner = %(owner)s AND (%(lanes)s::smallint[] IS NULL OR lane = ANY(%(lanes)s::smallint[]))
RETURNING lane

-- name: stop_publisher
UPDATE outbox.publishers SET stopped_at = now(), heartbeat_at = now() WHERE id = %(id)s

-- name: status
SELECT topic, state, messages, oldest_created_at, oldest_age_seconds, waiting_retry, retrying,
       attempts, max_failures, lease_owners, next_lease_expiry, leases_expired, escalated,
       overdue, held_keys, live_publishers, healthy, next_action
FROM outbox.status

-- name: open_status
-- The open states per topic, for the metrics at every scrape: each is read
-- through its own partial index, so the cost follows the open messages, not
-- the delivered ones kept for retention (outbox.status counts those too).
SELECT topic, 'pending' AS state, count(*),
       extract(epoch FROM now() - min(created_at))::float8
FROM outbox.messages WHERE state = 'pending' GROUP BY topic
UNION ALL
SELECT topic, 'in_flight', count(*), extract(epoch FROM now() - min(created_at))::float8
FROM outbox.messages WHERE state = 'in_flight' GROUP BY topic
UNION ALL
SELECT topic, 'uncertain', count(*), extract(epoch FROM now() - min(created_at))::float8
FROM outbox.messages WHERE state = 'uncertain' GROUP BY topic
UNION ALL
SELECT topic, 'quarantined', count(*), extract(epoch FROM now() - min(created_at))::float8
FROM outbox.messages WHERE state = 'quarantined' GROUP BY topic

-- name: message
-- One message, for outbox inspect; value_bytes instead of the payload.
SELECT id, seq, topic, key, state, created_at, available_at, lease_owner, lease_expires_at,
       fence, attempts, failures, kafka_partition, kafka_offset, delivered_at, updated_at,
       last_error, idempotency_key, header_names, lane, batch_id, escalated_at, send_alone,
       octet_length(value) AS value_bytes
FROM outbox.messages
WHERE id = %(id)s

-- name: message_attempts
-- Every recorded attempt of a message, with the process that made it and
-- the evidence its batch recorded (kept while the batch is).
SELECT a.attempt, a.publisher_id, p.host, p.pid, a.fence, a.batch_id, a.started_at,
       a.send_began, b.send_began_at, b.write_deadline, a.finished_at, a.outcome, a.error,
       a.kafka_partition, a.kafka_offset
FROM outbox.attempts AS a
LEFT JOIN outbox.publishers AS p ON p.id = a.publisher_id
LEFT JOIN outbox.batches AS b ON b.id = a.batch_id
WHERE a.message_id = %(id)s
ORDER BY a.attempt

-- name: message_claim
-- The claim a message is in now (its attempt record is written when it settles).
SELECT b.id, b.publisher_id, p.host, p.pid, b.claimed_at, b.send_began_at, b.write_deadline
FROM outbox.messages AS m
JOIN outbox.batches AS b ON b.id = m.batch_id
LEFT JOIN outbox.publishers AS p ON p.id = b.publisher_id
WHERE m.id = %(id)s AND m.state IN ('in_flight', 'uncertain')

-- name: message_decisions
SELECT decided_at, decided_by, from_state, to_state, reason, evidence
FROM outbox.decisions
WHERE message_id = %(id)s
ORDER BY decided_at, id

-- name: message_holder
-- The message holding back this message's key, if the key is held.
SELECT h.held_by, h.state, h.reason
FROM outbox.messages AS m
JOIN outbox.held_keys AS h ON h.topic = m.topic AND h.key = m.key
WHERE m.id = %(id)s AND m.state = 'pending' AND h.held_by <> m.id

-- name: list_messages
-- Messages in one state, oldest first; one more than asked shows there are more.
SELECT id, topic, key, state, created_at, attempts, failures, available_at, lease_owner,
       lease_expires_at, kafka_partition, kafka_offset, delivered_at, escalated_at, last_error
FROM outbox.messages
WHERE state = %(state)s AND (%(topic)s::text IS NULL OR topic = %(topic)s::text)
ORDER BY seq
LIMIT %(limit)s

-- name: purge_delivered
-- One bounded step of retention. Looks at up to `limit` messages after
-- `after` in id order, enqueued before the cutoff (ids are UUIDv7: an id
-- range is an enqueue-time range, read from the primary key), and deletes
-- those delivered before the cutoff. Nothing else is ever deleted. Returns
-- the last id looked at (NULL when done) and how many were deleted.
WITH scanned AS (
    SELECT id FROM outbox.messages
    WHERE id > %(after)s AND id < outbox.uuid7_floor(now() - %(age)s::interval)
    ORDER BY id
    LIMIT %(limit)s
),
deleted AS (
    DELETE FROM outbox.messages AS m
    USING scanned AS s
    WHERE m.id = s.id AND m.state = 'delivered'
      AND m.delivered_at < now() - %(age)s::interval
    RETURNING 1
)
SELECT (SELECT id FROM scanned ORDER BY id DESC LIMIT 1), (SELECT count(*) FROM deleted)

-- name: count_delivered_to_purge
SELECT count(*) FROM outbox.messages
WHERE id < outbox.uuid7_floor(now() - %(age)s::interval)
  AND state = 'delivered' AND delivered_at < now() - %(age)s::interval

-- name: purge_attempts
-- One bounded step: attempts of messages enqueued before the cutoff whose
-- message row is gone. The evidence of a message that exists is kept.
WITH scanned AS (
    SELECT message_id, attempt FROM outbox.attempts
    WHERE (message_id, attempt) > (%(after)s, %(after_n)s)
      AND message_id < outbox.uuid7_floor(now() - %(age)s::interval)
    ORDER BY message_id, attempt
    LIMIT %(limit)s
),
deleted AS (
    DELETE FROM outbox.attempts AS a
    USING scanned AS s
    WHERE a.message_id = s.message_id AND a.attempt = s.attempt
      AND coalesce(a.finished_at, a.started_at) < now() - %(age)s::interval
      AND NOT EXISTS (SELECT 1 FROM outbox.messages AS m WHERE m.id = a.message_id)
    RETURNING 1
),
last AS (SELECT message_id, attempt FROM scanned ORDER BY message_id DESC, attempt DESC LIMIT 1)
SELECT (SELECT message_id FROM last), (SELECT attempt FROM last), (SELECT count(*) FROM deleted)

-- name: count_attempts_to_purge
SELECT count(*) FROM outbox.attempts AS a
WHERE a.message_id < outbox.uuid7_floor(now() - %(age)s::interval)
  AND coalesce(a.finished_at, a.started_at) < now() - %(age)s::interval
  AND NOT EXISTS (SELECT 1 FROM outbox.messages AS m WHERE m.id = a.message_id)

-- name: purge_decisions
-- As purge_attempts, for decisions.
WITH scanned AS (
    SELECT message_id, id FROM outbox.decisions
    WHERE (message_id, id) > (%(after)s, %(after_n)s)
      AND message_id < outbox.uuid7_floor(now() - %(age)s::interval)
    ORDER BY message_id, id
    LIMIT %(limit)s
),
deleted AS (
    DELETE FROM outbox.decisions AS d
    USING scanned AS s
    WHERE d.id = s.id
      AND d.decided_at < now() - %(age)s::interval
      AND NOT EXISTS (SELECT 1 FROM outbox.messages AS m WHERE m.id = d.message_id)
    RETURNING 1
),
last AS (SELECT message_id, id FROM scanned ORDER BY message_id DESC, id DESC LIMIT 1)
SELECT (SELECT message_id FROM last), (SELECT id FROM last), (SELECT count(*) FROM deleted)

-- name: count_decisions_to_purge
SELECT count(*) FROM outbox.decisions AS d
WHERE d.message_id < outbox.uuid7_floor(now() - %(age)s::interval)
  AND d.decided_at < now() - %(age)s::interval
  AND NOT EXISTS (SELECT 1 FROM outbox.messages AS m WHERE m.id = d.message_id)

-- name: purge_batches
-- One bounded step: batches claimed before the cutoff, except those an
-- in-flight or uncertain message still needs for recovery or reconciliation.
-- Batch ids grow with their claim time, so the walk ends (NULL) at the first
-- batch claimed after the cutoff.
WITH scanned AS (
    SELECT id, claimed_at < now() - %(age)s::interval AS old
    FROM outbox.batches
    WHERE id > %(after)s
    ORDER BY id
    LIMIT %(limit)s
),
deleted AS (
    DELETE FROM outbox.batches AS b
    USING scanned AS s
    WHERE b.id = s.id AND s.old
      AND NOT EXISTS (SELECT 1 FROM outbox.messages AS m
                      WHERE m.batch_id = b.id AND m.state IN ('in_flight', 'uncertain'))
    RETURNING 1
)
SELECT CASE WHEN bool_and(s.old) THEN max(s.id) END, 0, (SELECT count(*) FROM deleted)
FROM scanned AS s

-- name: count_batches_to_purge
SELECT count(*) FROM outbox.batches AS b
WHERE b.claimed_at < now() - %(age)s::interval
  AND NOT EXISTS (SELECT 1 FROM outbox.messages AS m
                  WHERE m.batch_id = b.id AND m.state IN ('in_flight', 'uncertain'))
