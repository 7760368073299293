-- The publisher's cycle as it was before 0007 (schema version 6), kept only
-- as the baseline benchmarks/throughput.py measures the current cycle
-- against, side by side in one run: a claim that wrote every message row
-- (state, lease, fence, attempts), and a settle that wrote every row again
-- plus an attempt row per message. It runs on a database migrated to
-- version 6 only. Same format as outbox/queries.sql.

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
        write_deadline = clock_timestamp() + make_interval(secs => %(write_deadline_seconds)s),
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
