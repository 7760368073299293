-- Every statement the library and the publisher send, by name.
-- outbox/queries.py loads this file once; placeholders are psycopg's.
-- A block starts with a line "-- name: <name>" and runs to the next one.

-- name: insert_messages
-- Insert intents; {rows} is one typed "(%s, ...)" group per intent. First,
-- lock the keys ({take_key_locks}): enqueues of one key serialise until
-- commit, so one key's seq follow its commit order. The locks are taken
-- before any row (and its seq) is produced. {lock} is false in the
-- statements of a call whose keys lock_keys locked first (there is nothing
-- left to lock), true otherwise. A row whose idempotency key is already
-- taken is skipped, and its id is not returned.
WITH intent (id, topic, key, value, header_names, header_values, idempotency_key) AS (
    VALUES {rows}
), key_to_lock AS (
    SELECT topic, key FROM intent WHERE {lock}
){take_key_locks}
INSERT INTO outbox.messages
    (id, topic, key, value, header_names, header_values, idempotency_key)
SELECT id, topic, key, value, header_names, header_values, idempotency_key
FROM intent
WHERE (SELECT setting FROM key_locks_held) IS NOT NULL
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id

-- name: lock_keys
-- The key locks of an enqueue_many of several insert_messages statements, all
-- taken before the first row is written, in one statement ({take_key_locks}),
-- so that two such calls never wait on each other in a cycle; its
-- insert_messages statements then lock nothing more.
WITH key_to_lock AS (
    SELECT topic, key
    FROM ROWS FROM (pg_catalog.unnest(%(topics)s::text[]), pg_catalog.unnest(%(keys)s::bytea[]))
        AS k(topic, key)
){take_key_locks}
SELECT setting FROM key_locks_held

-- name: take_key_locks
-- The key locks of an enqueue, as common table expressions that follow
-- key_to_lock (the topic and key of each message to lock for; unkeyed ones
-- and repeats are left out here); key_locks_held is read last, once every
-- lock is taken. A key's lock is a transaction-scoped advisory lock on its
-- hash (the hash outbox.messages stores as key_hash), exclusive, taken in
-- the order of the hashes, so that two statements never wait on each other
-- in a cycle.
-- Every lock lives in PostgreSQL's shared lock table until the transaction
-- ends, a table sized for about max_locks_per_transaction locks a connection
-- (64 by default): a transaction that locked tens of thousands of keys would
-- fill it and fail ("out of shared memory"), and, while it held thousands,
-- so could any other transaction that needed a lock. So a transaction
-- remembers the keys it has locked (their hashes, in the setting
-- outbox.enqueue_key_locks, local to the transaction), locks only those it
-- has not, and locks keys one by one only up to max_locks_per_transaction of
-- them (at most 1,024: every enqueue reads the setting). The statement that
-- would pass that takes the lock on all keys instead, exclusive ('*' in the
-- setting), and the transaction locks no more keys: no other transaction
-- enqueues a keyed message until it ends. A transaction that locks keys one
-- by one holds the lock on all keys shared, so the two exclude each other.
-- It takes the shared lock (once) after its statement's key locks: a
-- transaction holding the shared lock has taken every key lock of its
-- statement. A transaction that takes the exclusive lock after it locked
-- keys one by one waits for every transaction holding the shared lock, and
-- none of those that enqueue in one statement waits for one of its keys; one
-- that enqueues again, in a later statement, may, and then the two deadlock
-- and PostgreSQL aborts one.
-- A transaction whose first keys pass the number holds no key lock while it
-- waits for the exclusive lock.
-- The lock on all keys is advisory, keyed by outbox.messages' oid and 0,
-- apart from the keys' (keyed by one bigint) and the lanes' (keyed by
-- outbox.lanes' oid). Each step runs before the next because the next reads
-- its result.
-- lock_key: the hashes of this statement's keys, each once; taken: the
-- hashes of the keys this transaction locked one by one before
-- this statement (NULL once it holds the lock on all keys); new: this
-- statement's keys not among them, in order; after: the setting once this
-- statement's locks are taken ('*': the lock on all keys).
-- Every function is named in pg_catalog: these statements run on the
-- service's connection, on its search_path, where a function another service
-- created in public with a closer match (a hashtextextended(text, integer),
-- an unnest(bigint[]) beside the polymorphic one) would run as this service,
-- and could break its keys' order.
, lock_key AS MATERIALIZED (
    SELECT DISTINCT pg_catalog.hashtextextended(topic || E'\n' || pg_catalog.encode(key, 'hex'),
                                                0) AS lock_key
    FROM key_to_lock
    WHERE key IS NOT NULL
), key_lock_budget AS MATERIALIZED (
    SELECT taken,
           ARRAY(SELECT lock_key FROM lock_key
                 WHERE lock_key <> ALL (taken)
                 ORDER BY lock_key) AS new
    FROM (SELECT CASE setting WHEN '*' THEN NULL
                              WHEN '' THEN ARRAY[]::bigint[]
                              ELSE pg_catalog.string_to_array(setting, ',')::bigint[] END AS taken
          FROM (SELECT coalesce(pg_catalog.current_setting('outbox.enqueue_key_locks', true),
                                '') AS setting) AS s) AS h
), all_keys_locked AS MATERIALIZED (
    SELECT taken, new, after,
           CASE WHEN taken IS NOT NULL AND after = '*'
                THEN pg_catalog.pg_advisory_xact_lock('outbox.messages'::regclass::oid::integer, 0)
           END AS locked
    FROM (SELECT taken, new,
                 CASE WHEN taken IS NULL THEN '*'
                      WHEN pg_catalog.cardinality(taken) + pg_catalog.cardinality(new)
                           > least(pg_catalog.current_setting('max_locks_per_transaction')
                                       ::integer, 1024)
                      THEN '*'
                      ELSE pg_catalog.array_to_string(pg_catalog.array_cat(taken, new), ',')
                 END AS after
          FROM key_lock_budget) AS budget
), key_locks_held AS MATERIALIZED (
    SELECT pg_catalog.set_config('outbox.enqueue_key_locks', a.after, true) AS setting,
           CASE WHEN pg_catalog.cardinality(a.taken) = 0 AND pg_catalog.cardinality(a.new) > 0
                     AND a.after <> '*'
                     AND keys_locked.locks >= 0
                THEN pg_catalog.pg_advisory_xact_lock_shared(
                         'outbox.messages'::regclass::oid::integer, 0)
           END AS shared_locked
    FROM all_keys_locked AS a,
         (SELECT pg_catalog.count(pg_catalog.pg_advisory_xact_lock(k.lock_key)) AS locks
          FROM (SELECT pg_catalog.unnest(new) AS lock_key
                FROM all_keys_locked WHERE after <> '*') AS k)
         AS keys_locked
)

-- name: ids_by_idempotency_key
SELECT idempotency_key, id
FROM outbox.messages
WHERE idempotency_key = ANY(%(keys)s::text[])

-- name: claim_batch
-- Claim the next claimable messages of this publisher's lanes, oldest first,
-- by writing one batch row that names them (only when something was
-- claimed); no message row is written. A message named by an open batch (of
-- any publisher) is in flight and is not claimed again. A keyed message is
-- claimable only when no message of its key is in an open batch and every
-- earlier open message of its key is claimable too (pending and due): an
-- earlier one in flight, uncertain, quarantined or waiting out a retry holds
-- its key back, and only its key. Lanes make one publisher at a time claim a
-- message: the lanes are read FOR SHARE, so none changes owner while the
-- claim runs. Each lane read also takes its advisory lock, shared, until the
-- claim commits: an operator's decision on a pending message takes it
-- exclusively (resolve_lock), so the decision waits for a claim in progress,
-- and a claim skips a lane whose decision is not committed yet (its other
-- lanes go on). The lease is the batch's, renewed by the
-- heartbeat. The fence and attempt returned are those of this attempt: the
-- settle writes them.
-- The statement takes no parameters: {owner} (the publisher's id), {limit}
-- (the most messages claimed) and {lease_seconds} are written into its text
-- (claim_statement). The publisher prepares the claim, and PostgreSQL plans
-- a statement without parameters once, at its first run, then reuses that
-- plan; with parameters it would plan the first five runs anew, 10 to 25 ms
-- each for the branches of the lanes (see PublisherStore.conn).
-- {claimable} is this publisher's claimable messages, oldest first: one
-- branch per lane (claimable_in_lane), each read in seq order through
-- messages_pending_by_lane (its messages not held), merged (a Merge
-- Append). A branch of a lane not in mine reads nothing, so a claim reads
-- about as many entries as it takes (plus one per lane), whatever waits in
-- other publishers' lanes or behind a stuck message of a key.
-- {horizon} is empty, or (for a claim made ahead, while a batch is in flight)
-- a bound on the candidates (claim_horizon): only the oldest few pending
-- messages are looked at, so a claim-ahead whose keys are all in flight gives
-- up after a few index probes instead of reading the whole backlog. An
-- ordinary claim has no bound, so a long queue behind one held key never
-- hides other keys.
-- A suspect message (send_alone: its last batch was recovered, or refused
-- together with other records) is claimed only alone: when it is the oldest
-- candidate the batch is just it; otherwise the batch ends before it. So a
-- message that kills its publisher takes no neighbours with it once
-- suspected, its recovery is its own (recover_expired_leases counts it), and
-- nothing later, of its key or not, is claimed past it: its key stays in order.
WITH mine AS MATERIALIZED (
    SELECT lane
    -- Locked in lane order, as renew_lanes and release_lanes lock them: a claim
    -- and the heartbeat never wait on each other in a cycle.
    FROM (SELECT lane
          FROM outbox.lanes
          WHERE owner = {owner} AND lease_expires_at > now()
          ORDER BY lane
          FOR SHARE) AS owned
    WHERE pg_try_advisory_xact_lock_shared('outbox.lanes'::regclass::oid::integer, lane)
), open AS MATERIALIZED (
    SELECT message_ids, key_hashes FROM outbox.batches WHERE settled_at IS NULL
), in_open_batches AS MATERIALIZED (
    SELECT coalesce((SELECT array_agg(i.id) FROM open, unnest(open.message_ids) AS i(id)),
                    '{{}}') AS ids,
           coalesce((SELECT array_agg(k.key_hash)
                     FROM open, unnest(open.key_hashes) AS k(key_hash)), '{{}}') AS key_hashes
){horizon}, candidates AS (
    SELECT m.*
    FROM ({claimable}) AS m
    ORDER BY m.seq
    LIMIT {limit}
), cut AS (
    SELECT min(seq) AS first_seq, min(seq) FILTER (WHERE send_alone) AS suspect_seq
    FROM candidates
), next AS (
    SELECT c.*
    FROM candidates AS c, cut
    WHERE cut.suspect_seq IS NULL OR c.seq < cut.suspect_seq
       OR (c.seq = cut.suspect_seq AND cut.suspect_seq = cut.first_seq)
), batch AS (
    INSERT INTO outbox.batches (publisher_id, lease_expires_at, message_ids, key_hashes)
    SELECT {owner},
           now() + make_interval(secs => {lease_seconds}),
           ARRAY(SELECT id FROM next ORDER BY seq),
           ARRAY(SELECT DISTINCT key_hash FROM next WHERE key_hash IS NOT NULL)
    WHERE EXISTS (SELECT 1 FROM next)
    RETURNING id, claimed_at
)
SELECT n.id, n.topic, n.key, n.value, n.header_names, n.header_values, n.fence + 1,
       n.attempts + 1, n.failures, n.send_alone, b.id, b.claimed_at, n.created_at
FROM next AS n CROSS JOIN batch AS b
ORDER BY n.seq

-- name: claimable_in_lane
-- One branch of claim_batch's {claimable}: the messages of lane {lane} that
-- nothing but an open batch may hold back, oldest first, if this publisher
-- holds that lane (mine); otherwise nothing is read (a one-time filter). A
-- held message (behind an uncertain or quarantined one of its key: see
-- hold_behind_stuck) is not read at all: the lane's messages that are not
-- held are read through messages_pending_by_lane in seq order and tested in
-- the branch,
-- the branch limited to what the claim takes: each branch is planned on its
-- own, and without a limit of its own it would be planned to read its whole
-- lane (a bitmap scan and a sort, ten times slower than the walk a claim
-- needs). What the open batches hold is tested against two arrays read once
-- (in_open_batches): an unkeyed message by its id, a keyed one by its key
-- (a keyed message in flight has its key in flight), before the probe for
-- blockers. A NOT IN in each branch would hash the open batches once per
-- lane, 32 times per claim (55 against 9 ms for a claim made ahead while
-- 1,000 messages were in flight). The probe for blockers reads
-- messages_holding_keys (its condition is that index's); it counts an earlier
-- held message as a blocker, so a message marked held, or released, late is
-- never claimed before an earlier one of its key. {bound} is claim_horizon's
-- bound (a claim made ahead) or empty.
(SELECT m.id, m.seq, m.topic, m.key, m.value, m.header_names, m.header_values, m.fence,
        m.attempts, m.failures, m.send_alone, m.created_at, m.key_hash
 FROM outbox.messages AS m
 WHERE m.state = 'pending' AND m.lane = {lane} AND NOT m.held
   AND {lane} IN (SELECT lane FROM mine)
   AND m.available_at <= now()
   {bound}
   AND (m.key IS NOT NULL OR m.id <> ALL ((SELECT ids FROM in_open_batches)::uuid[]))
   AND (m.key IS NULL OR (
       m.key_hash <> ALL ((SELECT key_hashes FROM in_open_batches)::bigint[])
       AND NOT EXISTS (
           SELECT 1
           FROM outbox.messages AS e
           WHERE e.key_hash = m.key_hash AND e.seq < m.seq
             AND e.key IS NOT NULL
             AND (e.state IN ('in_flight', 'uncertain', 'quarantined')
                  OR (e.state = 'pending' AND (e.failures > 0 OR e.held)))
             AND e.topic = m.topic AND e.key = m.key
             AND NOT (e.state = 'pending' AND NOT e.held AND e.available_at <= now()))))
 ORDER BY m.seq
 LIMIT {limit})

-- name: claim_horizon
-- claim_batch's {horizon} for a claim made ahead: the seq of the last of the
-- oldest {size} messages of this publisher's lanes that are pending, due
-- and not in flight ({due}: one due_in_lane branch per lane, merged). Each
-- claimable_in_lane branch is then bounded by it ({bound}).
, horizon AS MATERIALIZED (
    SELECT max(w.seq) AS seq
    FROM (SELECT d.seq FROM ({due}) AS d
          WHERE d.id NOT IN (SELECT unnest(message_ids) FROM open)
          ORDER BY d.seq LIMIT {size}) AS w
)

-- name: horizon_bound
-- claimable_in_lane's {bound} in a claim made ahead.
AND m.seq <= (SELECT seq FROM horizon)

-- name: due_in_lane
-- One branch of claim_horizon's {due}: as claimable_in_lane (held messages
-- are not read), without the test of the key. What is in flight is tested
-- after the merge, so each branch reads {reach} messages: the horizon's size
-- and one batch (the one a claim ahead is made ahead of). Should a lane hold
-- more in flight than that at its head, the horizon comes out later than it
-- would: a looser bound, never a message claimed out of turn.
(SELECT m.seq, m.id
 FROM outbox.messages AS m
 WHERE m.state = 'pending' AND m.lane = {lane} AND NOT m.held
   AND {lane} IN (SELECT lane FROM mine)
   AND m.available_at <= now()
 ORDER BY m.seq
 LIMIT {reach})

-- name: lock_batch
-- First half of marking a batch as sending: wait for anyone (recovery) that
-- holds the batch row, so that the next statement sees what they did.
SELECT id FROM outbox.batches WHERE id = %(batch_id)s FOR UPDATE

-- name: mark_sending
-- Second half, same transaction, fresh snapshot: record that sending begins
-- and return the messages of the batch, if this publisher still holds it
-- (open, its own, lease live); none otherwise. Recovery locks the batch row
-- too, so it either ran before (and closed the batch) or runs after and sees
-- send_began_at. In transactional delivery the batch records the
-- transactional.id it is sent under (NULL otherwise), and the publisher row
-- the session in use.
-- Only messages still as the claim read them are returned: pending, at the
-- fence the claim saw, and named by no other open batch. A claim reads the
-- messages with the snapshot its statement began with, which can predate
-- what committed while it ran: an operator's decision (the message is
-- discarded), or, should its lane have left this publisher and come back
-- within that one statement, another publisher's claim of the message (an
-- open batch of its own names it) and even that claim's settle back to
-- pending (the fence moved on). This statement's snapshot sees all of that,
-- so such a message is not sent twice.
-- The batch then names only what it returns (message_ids is rewritten when
-- something was left out): a batch that began sending names exactly the
-- messages it may have sent, which is the evidence recovery goes by, and one
-- message is named by at most one batch that began sending. What was left
-- out is no longer in flight under this batch.
WITH held AS (
    SELECT id, message_ids
    FROM outbox.batches
    WHERE id = %(batch_id)s AND settled_at IS NULL AND publisher_id = %(owner)s
      AND lease_expires_at > now()
), claimed AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(fences)s::bigint[]) AS c(id, fence)
), other_open AS MATERIALIZED (
    SELECT unnest(message_ids) AS id
    FROM outbox.batches
    WHERE settled_at IS NULL AND id <> %(batch_id)s
), candidate AS MATERIALIZED (
    -- Each message of the batch, and whether it is still as the claim read it.
    SELECT m.id, m.key_hash, m.seq,
           m.state = 'pending' AND m.fence = c.fence
               AND m.id NOT IN (SELECT id FROM other_open) AS as_claimed
    FROM outbox.messages AS m
    JOIN claimed AS c ON c.id = m.id
    -- Looked up by key, whatever the statistics say (see settle_batch).
    WHERE m.id = ANY((SELECT message_ids FROM held)::uuid[])
), sendable AS MATERIALIZED (
    -- A later message of a key whose earlier one is left out is left out too:
    -- sent now, it could reach Kafka before the earlier one, which another
    -- batch may be sending or which goes back to wait for its turn.
    SELECT c.id
    FROM candidate AS c
    WHERE c.as_claimed
      AND NOT EXISTS (SELECT 1 FROM candidate AS l
                      WHERE NOT l.as_claimed AND l.key_hash = c.key_hash AND l.seq < c.seq)
), marked AS (
    UPDATE outbox.batches AS b
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
        ),
        -- Unchanged (and so not written again) when nothing was left out.
        message_ids = CASE
            WHEN (SELECT count(*) FROM sendable) = cardinality(b.message_ids) THEN b.message_ids
            ELSE ARRAY(SELECT u.id
                       FROM unnest(b.message_ids) WITH ORDINALITY AS u(id, n)
                       WHERE u.id IN (SELECT id FROM sendable)
                       ORDER BY u.n)
        END
    WHERE b.id = (SELECT id FROM held)
), session AS (
    UPDATE outbox.publishers SET transactional_id = %(transactional_id)s
    WHERE id = %(owner)s AND transactional_id IS DISTINCT FROM %(transactional_id)s
)
SELECT id FROM sendable

-- name: settle_batch
-- Close the batch and record the outcome of each of its messages in one
-- statement, with the highest confirmed offset per partition. The batch is
-- closed only if it is still open and this publisher's; otherwise (recovery
-- closed it: the lease was lost) nothing changes. Each message row is written
-- once: its state, where it went, this attempt's fence and count; a message
-- that changed since the claim (its fence moved on), or that the batch does
-- not name (any more: its mark left it out), is left alone. An attempt
-- that did not deliver gets an attempt row; a delivery's record is its batch.
-- An uncertain message waits until the producer that sent it can no longer
-- write before it is reconciled: its write deadline; or, sent in a
-- transaction, none (the reconciler fences the transactional.id before it
-- reads the log).
WITH outcome AS (
    SELECT *
    FROM unnest(%(ids)s::uuid[], %(fences)s::bigint[], %(states)s::text[],
                %(outcomes)s::text[], %(partitions)s::integer[], %(offsets)s::bigint[],
                %(retry_after)s::float8[], %(errors)s::text[], %(send_began)s::boolean[],
                %(failures)s::boolean[], %(send_alone)s::boolean[])
         AS o(id, fence, state, outcome, kafka_partition, kafka_offset,
              retry_after, error, send_began, counts_as_failure, send_alone)
), closed AS (
    UPDATE outbox.batches
    SET settled_at = now()
    WHERE id = %(batch_id)s AND settled_at IS NULL AND publisher_id = %(publisher)s
    RETURNING claimed_at, send_began_at, message_ids,
              CASE WHEN transactional_id IS NULL THEN write_deadline END AS write_deadline
), other_open AS MATERIALIZED (
    -- Read only for a batch that never began sending (see the WHERE below).
    SELECT unnest(message_ids) AS id
    FROM outbox.batches
    WHERE settled_at IS NULL AND id <> %(batch_id)s
), settled AS (
    UPDATE outbox.messages AS m
    SET state = o.state,
        fence = o.fence,
        attempts = m.attempts + 1,
        batch_id = %(batch_id)s,
        kafka_partition = o.kafka_partition,
        kafka_offset = o.kafka_offset,
        delivered_at = CASE WHEN o.state = 'delivered' THEN now() END,
        available_at = CASE o.state
                           WHEN 'pending' THEN now() + make_interval(secs => o.retry_after)
                           WHEN 'uncertain' THEN greatest(now(), c.write_deadline)
                           ELSE m.available_at END,
        last_error = o.error,
        failures = CASE WHEN o.counts_as_failure THEN m.failures + 1 ELSE m.failures END,
        send_alone = o.send_alone,
        -- A pass may have marked it while it was in flight (its snapshot did
        -- not see the claim's batch yet): once settled it waits behind nothing.
        held = false,
        updated_at = now()
    FROM outcome AS o, closed AS c
    -- Each row is looked up by its key, whatever the statistics say. The id
    -- list makes the key an index condition (joined on outcome alone, every
    -- pending row of the backlog was hashed). The state is compared under
    -- the "C" collation (the same test: states are ASCII) so that the
    -- planner cannot read it from the partial index of pending messages
    -- (messages_pending_by_lane) instead: the statistics of a queue table
    -- lag behind it, and when
    -- ANALYZE last saw few pending rows, that index looks like one row to
    -- read while a backlog has filled it (a claim after a stall read 20,000
    -- index entries per statement; recovery, joining twice, read 20,000 per
    -- message: 80 s for one batch).
    WHERE m.id = ANY(%(ids)s::uuid[])
      AND m.id = o.id AND m.fence = o.fence - 1 AND m.state COLLATE "C" = 'pending'
      -- Only what the batch names: the publisher passes no other id, and the
      -- statement does not take its word for it.
      AND m.id = ANY(c.message_ids)
      -- A batch that never began sending (its transaction could not begin, its
      -- topics were refused, its publisher stopped or gave it back) leaves a
      -- message as it is when another open batch names it too (a claim made
      -- on a stale snapshot, see mark_sending): that batch may be sending it,
      -- and moving the fence would refuse its settle and send the message
      -- again. A batch that began sending settles everything it names, sent
      -- or held back behind an earlier message of its key: no other batch can
      -- be sending those (its mark left out what another open batch named,
      -- and a later mark leaves out what it names), and moving their fence is
      -- what keeps a stale claim's mark from sending a later message of a key
      -- before its earlier one. The batch's own column is tested first: one
      -- that began never reads other_open.
      AND (c.send_began_at IS NOT NULL OR m.id NOT IN (SELECT id FROM other_open))
    RETURNING m.id, m.topic, m.attempts, o.fence, o.outcome, o.error, o.send_began,
              o.kafka_partition, o.kafka_offset, c.claimed_at
), recorded AS (
    INSERT INTO outbox.attempts
        (message_id, attempt, publisher_id, fence, started_at, send_began, finished_at,
         outcome, error, kafka_partition, kafka_offset, batch_id)
    SELECT id, attempts, %(publisher)s, fence, claimed_at, send_began, now(),
           outcome, error, kafka_partition, kafka_offset, %(batch_id)s
    FROM settled
    WHERE outcome <> 'delivered'
), confirmed AS (
    INSERT INTO outbox.partition_offsets AS po (topic, kafka_partition, confirmed_offset)
    SELECT topic, kafka_partition, max(kafka_offset)
    FROM settled
    WHERE outcome = 'delivered'
    GROUP BY topic, kafka_partition
    -- In one order for everyone: two publishers settling batches that share
    -- partitions would otherwise lock their rows in opposite orders and
    -- deadlock.
    ORDER BY topic, kafka_partition
    ON CONFLICT (topic, kafka_partition) DO UPDATE
    SET confirmed_offset = greatest(po.confirmed_offset, excluded.confirmed_offset),
        updated_at = now()
)
SELECT id FROM settled

-- name: settle_delivered
-- settle_batch for the common case, every message of the batch delivered:
-- the ids come from the batch row (the claim named them, in claim order) and
-- the publisher sends only each one's fence and where it went, in that order.
-- Closed only if still open and this publisher's; a row is written only while
-- it is pending under the fence before this attempt's. No attempt rows: the
-- batch is the record of the attempt that delivered them.
WITH closed AS (
    UPDATE outbox.batches
    SET settled_at = now()
    WHERE id = %(batch_id)s AND settled_at IS NULL AND publisher_id = %(publisher)s
    RETURNING message_ids
), outcome AS (
    SELECT o.id, o.fence, o.kafka_partition, o.kafka_offset
    FROM closed AS c,
         unnest(c.message_ids, %(fences)s::bigint[], %(partitions)s::integer[],
                %(offsets)s::bigint[])
             AS o(id, fence, kafka_partition, kafka_offset)
), settled AS (
    UPDATE outbox.messages AS m
    SET state = 'delivered',
        fence = o.fence,
        attempts = m.attempts + 1,
        batch_id = %(batch_id)s,
        kafka_partition = o.kafka_partition,
        kafka_offset = o.kafka_offset,
        delivered_at = now(),
        last_error = NULL,
        send_alone = false,
        held = false,  -- as in settle_batch
        updated_at = now()
    FROM outcome AS o
    -- Looked up by key, whatever the statistics say (see settle_batch).
    WHERE m.id = ANY((SELECT message_ids FROM closed)::uuid[])
      AND m.id = o.id AND m.fence = o.fence - 1 AND m.state COLLATE "C" = 'pending'
    RETURNING m.id, m.topic, o.kafka_partition, o.kafka_offset
), confirmed AS (
    INSERT INTO outbox.partition_offsets AS po (topic, kafka_partition, confirmed_offset)
    SELECT topic, kafka_partition, max(kafka_offset)
    FROM settled
    GROUP BY topic, kafka_partition
    -- In one order for everyone: two publishers settling batches that share
    -- partitions would otherwise lock their rows in opposite orders and
    -- deadlock.
    ORDER BY topic, kafka_partition
    ON CONFLICT (topic, kafka_partition) DO UPDATE
    SET confirmed_offset = greatest(po.confirmed_offset, excluded.confirmed_offset),
        updated_at = now()
)
SELECT id FROM settled

-- name: settled_by_batch
-- Which of these messages a settle of this batch recorded. A settle retried
-- after its first try's answer was lost (the connection dropped after the
-- commit) finds the batch closed: by that try, or by recovery once the
-- lease expired. Delivered ones by their row, unless recovery moved them
-- first (the reconciler may have found them since); the others by the
-- attempt the settle wrote (recovery writes 'recovered' ones).
SELECT m.id FROM outbox.messages AS m
WHERE m.id = ANY(%(ids)s::uuid[]) AND m.batch_id = %(batch_id)s AND m.state = 'delivered'
  AND NOT EXISTS (SELECT 1 FROM outbox.attempts AS r
                  WHERE r.message_id = m.id AND r.batch_id = %(batch_id)s
                    AND r.outcome = 'recovered')
UNION
SELECT a.message_id FROM outbox.attempts AS a
WHERE a.message_id = ANY(%(ids)s::uuid[]) AND a.batch_id = %(batch_id)s
  AND a.outcome <> 'recovered'

-- name: recover_expired_leases
-- Close open batches whose lease expired and move their messages by the
-- batch's evidence: nothing was sent (send_began_at is NULL) -> pending;
-- sending may have begun -> uncertain. Each gets a 'recovered' attempt
-- saying why. The batch rows are locked (see mark_sending); locked ones are
-- left for the next pass. The partition an earlier attempt stored is
-- cleared: the reconciler derives this attempt's from the batch's evidence.
-- A lease that expires may be a publisher killed by one of its messages (one
-- that crashes or hangs the producer every time), or, far more often, a
-- publisher killed or cut off for reasons of its own. No failure is
-- counted, since the batch says nothing of which message it was. A message
-- recovered for the second time in a row (its previous attempt was
-- 'recovered' too; one the publisher gave back unsent, 'abandoned', is not)
-- is marked suspect (send_alone): the claim takes it alone
-- from then on. A first recovery marks nothing, so one killed publisher
-- costs its batches one more claim each, not one claim per message (a soak
-- that killed a publisher with 1,000 messages in hand sent them one per
-- batch for minutes); a poison kills a second publisher before it is
-- isolated. A batch that named only a suspect message is its own evidence:
-- it counts a failure (the loop quarantines such a message at its next
-- claim once its failures reach --max-attempts). A healthy message thus
-- needs two recoveries in a row, then --max-attempts more while alone, to be
-- quarantined.
WITH expired AS (
    SELECT b.id, b.publisher_id, b.lease_expires_at, b.claimed_at, b.send_began_at,
           b.message_ids,
           CASE WHEN b.transactional_id IS NULL THEN b.write_deadline END AS write_deadline
    FROM outbox.batches AS b
    WHERE b.settled_at IS NULL AND b.lease_expires_at < now()
    ORDER BY b.id
    LIMIT %(limit)s
    FOR UPDATE OF b SKIP LOCKED
), closed AS (
    UPDATE outbox.batches AS b SET settled_at = now()
    FROM expired AS e
    WHERE b.id = e.id
), decided AS (
    SELECT e.*,
           CASE WHEN e.send_began_at IS NULL THEN 'pending' ELSE 'uncertain' END AS next_state,
           cardinality(e.message_ids) = 1 AS alone,
           format('lease of publisher %%s expired at %%s (last heartbeat %%s); %%s',
                  e.publisher_id, e.lease_expires_at, coalesce(p.heartbeat_at::text, 'never'),
                  CASE WHEN e.send_began_at IS NULL
                       THEN 'sending had not begun, so nothing was sent'
                       ELSE format('sending began at %%s, so the record may be in Kafka',
                                   e.send_began_at) END) AS reason
    FROM expired AS e
    LEFT JOIN outbox.publishers AS p ON p.id = e.publisher_id
), members AS (
    -- Each message once. Since mark_sending rewrites what a batch names, one
    -- message is named by at most one batch that began sending; batches
    -- marked before that (by an earlier version) could both name it, and
    -- then the first to mark is the one that may have sent it (the later
    -- mark saw it in the first's open batch and left it out).
    -- again: the message's previous attempt was ended by a recovery too.
    SELECT DISTINCT ON (u.id) u.id, d.id AS batch_id,
           EXISTS (SELECT 1
                   FROM outbox.messages AS p
                   JOIN outbox.attempts AS a ON a.message_id = p.id AND a.attempt = p.attempts
                   WHERE p.id = u.id AND a.outcome = 'recovered') AS again
    FROM decided AS d
    CROSS JOIN LATERAL unnest(d.message_ids) AS u(id)
    ORDER BY u.id, d.send_began_at IS NULL, d.send_began_at, d.id
), other_open AS MATERIALIZED (
    -- Messages an open batch names that this pass does not close.
    SELECT unnest(b.message_ids) AS id, b.send_began_at
    FROM outbox.batches AS b
    WHERE b.settled_at IS NULL AND b.id NOT IN (SELECT id FROM expired)
), sent_elsewhere AS MATERIALIZED (
    -- Messages of batches recovered here that an open batch this pass does not
    -- close began sending first: marked by an earlier version, the batch
    -- recovered here saw that one open at its mark and left the message out.
    SELECT j.id
    FROM members AS j
    JOIN decided AS d ON d.id = j.batch_id
    JOIN other_open AS o ON o.id = j.id
    WHERE o.send_began_at < d.send_began_at
), moved AS (
    -- SET reads the row as the claim left it (it writes none): send_alone
    -- says whether the message was claimed as a suspect.
    UPDATE outbox.messages AS m
    SET state = d.next_state,
        fence = m.fence + 1,
        attempts = m.attempts + 1,
        batch_id = d.id,
        kafka_partition = NULL,
        kafka_offset = NULL,
        available_at = CASE WHEN d.next_state = 'pending' THEN now()
                            ELSE greatest(now(), d.write_deadline) END,
        failures = m.failures + (m.send_alone AND d.alone)::integer,
        send_alone = m.send_alone OR j.again,
        last_error = d.reason || CASE
            WHEN m.send_alone AND d.alone
            THEN format('; it was claimed alone, suspected of ending its publisher''s claims, '
                        'so this counts as failure %%s', m.failures + 1)
            WHEN m.send_alone OR j.again
            THEN '; no failure is counted, but it is suspect (its batches were recovered '
                 'twice in a row): claimed alone until settled'
            ELSE '; no failure is counted' END,
        held = false,  -- as in settle_batch
        updated_at = now()
    FROM members AS j
    JOIN decided AS d ON d.id = j.batch_id
    -- Looked up by key, whatever the statistics say (see settle_batch).
    WHERE m.id = ANY((SELECT array_agg(id) FROM members)::uuid[])
      AND m.id = j.id AND m.state COLLATE "C" = 'pending'
      -- A batch that never began sending sent nothing: its message is left as
      -- it is when another open batch names it too (a claim made on a stale
      -- snapshot, see mark_sending). That batch may be sending it now, and
      -- moving the fence would refuse its settle and put the message back to
      -- be sent again. One that began sending may have sent it: uncertain.
      AND (d.next_state = 'uncertain' OR m.id NOT IN (SELECT id FROM other_open))
      -- Nor when something moved it since that batch's claim (a claim writes
      -- no message row): a claim made on a stale snapshot named a message
      -- another batch then took, sent and settled. It is that settle's now
      -- (pending again waiting out a backoff, say), not this batch's.
      AND (d.next_state = 'uncertain' OR m.updated_at <= d.claimed_at)
      AND m.id NOT IN (SELECT id FROM sent_elsewhere)
    RETURNING m.id, m.seq, m.attempts, m.fence, d.next_state, d.id AS batch_id,
              d.publisher_id, d.claimed_at, d.send_began_at, m.last_error AS reason
), recorded AS (
    INSERT INTO outbox.attempts
        (message_id, attempt, publisher_id, fence, started_at, send_began, finished_at,
         outcome, error, batch_id)
    SELECT id, attempts, publisher_id, fence, claimed_at, send_began_at IS NOT NULL, now(),
           'recovered', reason, batch_id
    FROM moved
    ON CONFLICT (message_id, attempt) DO NOTHING
)
SELECT id, next_state, attempts, fence, batch_id, publisher_id
FROM moved
ORDER BY seq

-- name: uncertain_due
-- Uncertain messages whose producer can no longer write, with the evidence
-- of their batch, for the reconciler; and whether the grace after that has
-- passed too, so that a record's absence proves it was never written. A
-- message sent in a transaction needs no grace: the reconciler fences its
-- transactional.id and reads only committed records. With how long ago the
-- batch began sending (a compacted topic keeps a tombstone only so long). A
-- page at a time, in seq order from after seq %(after)s: the reconciler goes
-- on after a full page at its next pass, so a page whose messages all wait
-- cannot keep those after it waiting for ever.
SELECT m.id, m.topic, m.key, m.fence, m.kafka_partition, b.partition_counts,
       b.confirmed_offsets, m.seq,
       b.transactional_id IS NOT NULL
           OR m.available_at + make_interval(secs => %(grace)s::float8) <= now(),
       b.transactional_id, extract(epoch FROM now() - b.send_began_at)::float8
FROM outbox.messages AS m
LEFT JOIN outbox.batches AS b ON b.id = m.batch_id
WHERE m.state = 'uncertain' AND m.escalated_at IS NULL AND m.available_at <= now()
  AND m.seq > %(after)s
ORDER BY m.seq
LIMIT %(limit)s

-- name: uncertain_left
-- What outbox-publisher reconcile leaves uncertain, by what it waits for:
-- escalated (an operator decides); the write deadline and the absence grace
-- (%(grace)s seconds; not for a message sent in a transaction), with when the
-- last of them passes; anything else (last_error says why: a session Kafka
-- would not let be fenced, a range not readable now).
SELECT count(*) FILTER (WHERE m.escalated_at IS NOT NULL),
       count(*) FILTER (WHERE w.until > now()),
       max(w.until) FILTER (WHERE w.until > now()),
       count(*) FILTER (WHERE m.escalated_at IS NULL AND w.until <= now())
FROM outbox.messages AS m
LEFT JOIN outbox.batches AS b ON b.id = m.batch_id
CROSS JOIN LATERAL (
    SELECT CASE WHEN m.escalated_at IS NOT NULL THEN NULL
                WHEN b.transactional_id IS NOT NULL THEN m.available_at
                ELSE m.available_at + make_interval(secs => %(grace)s::float8) END AS until
) AS w
WHERE m.state = 'uncertain'

-- name: note_waiting
-- Say on uncertain messages why their reconciliation waits (Kafka refused to
-- let their producer session be fenced, a transaction left open holds the
-- partition's reads back): in last_error, which outbox list and outbox
-- inspect show. With %(note)s NULL (the session is fenced now, the reads go
-- on), such a note gives way again to the error of the message's last
-- attempt, which outbox.attempts keeps all along, unless it is %(keep)s
-- (NULL: any note gives way); a note is told apart by its %(prefix)s
-- (outbox.states.WAITING_NOTE). Only a message still undecided at
-- the fence the reconciler read is written, and only when its note changes
-- (rows whose note is already right are not even locked: a lock is a
-- write), so a pass that fails the same way again writes nothing; a row
-- another transaction holds (an operator's decision) is skipped, not waited
-- for.
WITH changing AS (
    SELECT m.id
    FROM outbox.messages AS m
    JOIN unnest(%(ids)s::uuid[], %(fences)s::bigint[]) AS w(id, fence) ON w.id = m.id
    -- Looked up by key, whatever the statistics say (see settle_batch).
    WHERE m.id = ANY(%(ids)s::uuid[]) AND m.fence = w.fence
      AND m.state COLLATE "C" = 'uncertain' AND m.escalated_at IS NULL
      AND CASE WHEN %(note)s::text IS NULL
               THEN starts_with(m.last_error, %(prefix)s)
                    AND m.last_error IS DISTINCT FROM %(keep)s::text
               ELSE m.last_error IS DISTINCT FROM %(note)s::text END
    FOR NO KEY UPDATE OF m SKIP LOCKED
)
UPDATE outbox.messages AS m
SET last_error = coalesce(%(note)s::text, (SELECT a.error
                                          FROM outbox.attempts AS a
                                          WHERE a.message_id = m.id
                                          ORDER BY a.attempt DESC
                                          LIMIT 1)),
    updated_at = now()
FROM changing AS c
WHERE m.id = ANY(%(ids)s::uuid[]) AND m.id = c.id

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
-- to_state 'uncertain' escalates: the reconciler could not decide (its reason
-- says why) and an operator decides.
-- Each decision raises the fence, as an operator's does: an operator's
-- decision made from a reading taken before it is refused.
-- A message whose row another transaction holds (an operator's decision not
-- committed yet, which may stay open as long as its caller's transaction) is
-- skipped, not waited for: the pass goes on, and the message, if still
-- uncertain, is decided at a later one.
WITH d AS (
    SELECT *
    FROM unnest(%(ids)s::uuid[], %(fences)s::bigint[], %(to_states)s::text[],
                %(partitions)s::integer[], %(offsets)s::bigint[], %(reasons)s::text[],
                %(evidence)s::jsonb[])
         AS d(id, fence, to_state, kafka_partition, kafka_offset, reason, evidence)
), free AS (
    SELECT id FROM outbox.messages WHERE id = ANY(%(ids)s::uuid[]) FOR UPDATE SKIP LOCKED
), decided AS (
    UPDATE outbox.messages AS m
    SET state = d.to_state,
        fence = m.fence + 1,
        kafka_partition = coalesce(d.kafka_partition, m.kafka_partition),
        kafka_offset = d.kafka_offset,
        delivered_at = CASE WHEN d.to_state = 'delivered' THEN now() END,
        available_at = CASE WHEN d.to_state = 'pending' THEN now() ELSE m.available_at END,
        escalated_at = CASE WHEN d.to_state = 'uncertain' THEN now() END,
        last_error = CASE WHEN d.to_state = 'delivered' THEN NULL ELSE d.reason END,
        updated_at = now()
    FROM d
    -- Looked up by key, whatever the statistics say (see settle_batch): after
    -- a broker outage the uncertain messages may be many.
    WHERE m.id = ANY(%(ids)s::uuid[]) AND m.id IN (SELECT id FROM free)
      AND m.id = d.id AND m.fence = d.fence AND m.state COLLATE "C" = 'uncertain'
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
    -- In one order for everyone: two publishers settling batches that share
    -- partitions would otherwise lock their rows in opposite orders and
    -- deadlock.
    ORDER BY topic, kafka_partition
    ON CONFLICT (topic, kafka_partition) DO UPDATE
    SET confirmed_offset = greatest(po.confirmed_offset, excluded.confirmed_offset),
        updated_at = now()
)
SELECT id FROM decided

-- name: decision_check
-- What an operator's decision is checked against, read without taking a lock
-- (a refused decision holds none: see resolve_lock): the message's state as
-- outbox.message_status derives it, its fence (raised by every settle, every
-- recovery and every operator decision, so a decision names the fence it was
-- made from; a claim writes only its batch), its attempts and the last decision taken on it; and, for an
-- uncertain message, what may still write its record: until write_deadline
-- the producer that sent it (idempotent delivery; the batch's deadline, or
-- the row's available_at for a row without one), or its Kafka transaction
-- session until the reconciler has fenced it (transactional delivery: the
-- reconciler fences a session before it decides or escalates any of its
-- messages, so an escalated message's session is fenced). The clock is the
-- wall clock, as the publisher's deadline is. sent_to_partition: the
-- partition an uncertain message's record was sent to, when known; its record
-- is there or nowhere. proven_absent: the last decision is the reconciler's
-- escalation of an uncertain message whose record it proved absent while
-- later messages of its key are in Kafka (its evidence names them,
-- later_of_key).
SELECT s.state, s.fence, s.attempts, clock_timestamp() AS checked_at,
       CASE WHEN s.state = 'uncertain' THEN s.kafka_partition END AS sent_to_partition,
       CASE WHEN s.state = 'uncertain' AND b.transactional_id IS NULL
            THEN coalesce(b.write_deadline, s.available_at) END AS write_deadline,
       CASE WHEN s.state = 'uncertain' AND s.escalated_at IS NULL
            THEN b.transactional_id END AS unfenced_session,
       d.decided_at, d.decided_by, d.from_state, d.to_state,
       s.escalated_at IS NOT NULL AS escalated,
       s.state = 'uncertain' AND s.escalated_at IS NOT NULL
           AND d.from_state = 'uncertain' AND d.to_state = 'uncertain'
           AND coalesce(d.evidence ? 'later_of_key', false) AS proven_absent
FROM outbox.message_status AS s
LEFT JOIN outbox.batches AS b ON b.id = s.batch_id
LEFT JOIN LATERAL (
    SELECT decided_at, decided_by, from_state, to_state, evidence
    FROM outbox.decisions
    WHERE message_id = s.id
    ORDER BY id DESC
    LIMIT 1
) AS d ON true
WHERE s.id = %(id)s

-- name: transaction_isolation
-- The isolation level of the current transaction ("read committed", ...).
SELECT current_setting('transaction_isolation')

-- name: resolve_lock
-- Second step of an operator's decision, taken only once decision_check found
-- nothing to refuse, in the decision's transaction: lock the message, and its
-- lane's advisory lock (keyed by outbox.lanes' oid and the lane number). A
-- claim holds the shared lock of each lane it reads until it commits, so this
-- waits for a claim in progress; resolve_message, the next statement, then
-- sees every batch that names the message: at READ COMMITTED, the only level
-- decisions run at (a snapshot taken before the wait would not see that
-- claim's batch). Until the decision's transaction ends, claims skip the lane
-- instead of waiting for it, and the lane row itself is not locked: a
-- decision held open in a caller's long transaction holds back that lane's
-- messages only, never the publisher's other lanes or its heartbeat. A claim
-- whose snapshot was taken before the decision committed may still name the
-- message; mark_sending drops it from the batch. A decision refused after
-- this (the message changed meanwhile) rolls its transaction, or savepoint,
-- back, which releases both locks.
SELECT pg_advisory_xact_lock('outbox.lanes'::regclass::oid::integer, m.lane)
FROM outbox.messages AS m
WHERE m.id = %(id)s
FOR UPDATE OF m

-- name: resolve_message
-- An operator's decision on one message, recorded with its reason. The
-- message moves only if it is in one of from_states (the state as
-- outbox.message_status derives it: a pending message named by an open batch
-- is in flight), still at the fence the decision names (NULL: not checked),
-- and, for an uncertain message, unless forced, not too soon (as
-- decision_check says): to pending (a second copy) or discarded (its key
-- released while its record may land after later ones) only once nothing can
-- write its record any more, and to pending only absence_grace seconds after
-- its write deadline too (a record written by then may stay unreadable that
-- long; not once escalated: the reconciler read Kafka after its own grace);
-- to delivered not while its Kafka transaction session is unfenced
-- (the record an operator saw there may yet be aborted). The decision
-- raises the fence: a second decision made from the same reading is refused.
-- decided_by is the operator's name (user@host of the command) and the
-- database user it logged in as: the login is what was authenticated.
-- The result says which state it was in and whether it moved.
WITH target AS (
    SELECT s.id, s.state, s.fence,
           s.state = 'uncertain' AND CASE
               WHEN b.transactional_id IS NOT NULL THEN s.escalated_at IS NULL
               WHEN %(to_state)s::text = 'delivered' THEN false
               ELSE coalesce(b.write_deadline, s.available_at)
                    + make_interval(secs => CASE WHEN %(to_state)s::text = 'pending'
                                                      AND s.escalated_at IS NULL
                                                 THEN %(absence_grace)s::float8 ELSE 0 END)
                    > clock_timestamp()
           END AS too_soon
    FROM outbox.message_status AS s
    LEFT JOIN outbox.batches AS b ON b.id = s.batch_id
    WHERE s.id = %(id)s
), decision AS (
    SELECT %(to_state)s::text AS to_state, %(reason)s::text AS reason,
           %(partition)s::integer AS kafka_partition, %(offset)s::bigint AS kafka_offset
), moved AS (
    UPDATE outbox.messages AS m
    SET state = d.to_state,
        fence = m.fence + 1,
        -- Given, or the partition an uncertain message's send went to (a
        -- quarantined message's record never reached the one it was aimed at).
        kafka_partition = CASE WHEN d.to_state = 'delivered'
                               THEN coalesce(d.kafka_partition,
                                             CASE WHEN t.state = 'uncertain'
                                                  THEN m.kafka_partition END) END,
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
      AND (%(fence)s::bigint IS NULL OR m.fence = %(fence)s::bigint)
      AND NOT (t.too_soon AND NOT %(force_before_deadline)s::boolean)
    RETURNING m.id, t.state AS from_state, d.to_state, d.reason, t.too_soon AS forced
), logged AS (
    -- The evidence says forced_before_deadline only when the override let the
    -- decision through: asked for after the deadline, it overrode nothing.
    INSERT INTO outbox.decisions (message_id, decided_by, from_state, to_state, reason, evidence)
    SELECT id, format('%%s (database user %%s)', %(decided_by)s::text, session_user),
           from_state, to_state, reason,
           CASE WHEN forced THEN %(evidence)s::jsonb || '{"forced_before_deadline": true}'
                ELSE %(evidence)s::jsonb END
    FROM moved
)
SELECT (SELECT state FROM target), EXISTS (SELECT 1 FROM moved)

-- name: quarantined_ids
-- The quarantined messages (of one topic, or all), through their partial
-- index (messages_quarantined), in seq order: what outbox retry --quarantined
-- would send again.
SELECT id FROM outbox.messages
WHERE state = 'quarantined' AND (%(topic)s::text IS NULL OR topic = %(topic)s::text)
ORDER BY seq

-- name: overtaken_by
-- Of these uncertain or quarantined messages, the later messages of their key
-- (same topic and key, higher seq) that may already be in Kafka: delivered in
-- the batch of the message's last send (settles record it as the row's
-- batch_id), or uncertain, whichever batch sent them. Sending the message
-- again would write it after them: an operator's decision that would
-- (resolve --pending, retry) is refused unless it says --out-of-order. Those
-- two are the only ways a later message of a stuck key gets there: a claim
-- takes no message of a key behind an uncertain or quarantined one, so none
-- can be sent between this reading and the decision. One row a later
-- message, in seq order; and one 'unknown' row (no id) for a message whose
-- last batch retention purged (its evidence window passed): what was sent
-- with it can no longer be told.
-- Read by primary key, and the uncertain ones by key_hash through
-- messages_holding_keys, whatever the statistics say: the states are
-- compared apart (COLLATE "C", see settle_batch) and each branch is its own
-- subquery (OFFSET 0), so that no plan reads every uncertain message once
-- per message (27 s for 2,000 messages after an outage left 100,000
-- uncertain that the statistics had not seen).
SELECT s.id AS message_id, l.id AS later_id, l.state AS later_state
FROM outbox.messages AS s
CROSS JOIN LATERAL (
    (SELECT u.id, u.seq, u.state FROM outbox.messages AS u
     WHERE u.key_hash = s.key_hash AND u.key IS NOT NULL
       AND u.state IN ('in_flight', 'uncertain', 'quarantined')
       AND u.state COLLATE "C" = 'uncertain'
       AND u.seq > s.seq AND u.topic = s.topic AND u.key = s.key
     OFFSET 0)
    UNION ALL
    (SELECT d.id, d.seq, d.state
     FROM outbox.batches AS b
     JOIN outbox.messages AS d ON d.id = ANY(b.message_ids)
     WHERE b.id = s.batch_id AND d.seq > s.seq AND d.state COLLATE "C" = 'delivered'
       AND d.topic = s.topic AND d.key = s.key
     OFFSET 0)
    UNION ALL
    SELECT NULL::uuid, NULL::bigint, 'unknown'
    WHERE s.batch_id IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM outbox.batches AS p WHERE p.id = s.batch_id)
) AS l
WHERE s.id = ANY(%(ids)s::uuid[]) AND s.key IS NOT NULL
  AND s.state COLLATE "C" IN ('uncertain', 'quarantined')
ORDER BY s.seq, l.seq

-- name: retry_quarantined
-- An operator sends these quarantined messages again, with a fresh retry
-- budget (those of them still quarantined); each decision is recorded with
-- its reason and raises the fence, as resolve_message does. A quarantined
-- message's record was refused, not sent, so no write deadline applies.
WITH moved AS (
    UPDATE outbox.messages AS m
    SET state = 'pending',
        fence = m.fence + 1,
        available_at = now(),
        failures = 0,
        last_error = format('pending by an operator: %%s', %(reason)s::text),
        updated_at = now()
    WHERE m.id = ANY(%(ids)s::uuid[]) AND m.state = 'quarantined'
    RETURNING m.id
), logged AS (
    INSERT INTO outbox.decisions (message_id, decided_by, from_state, to_state, reason)
    SELECT id, format('%%s (database user %%s)', %(decided_by)s::text, session_user),
           'quarantined', 'pending', %(reason)s::text
    FROM moved
)
SELECT id FROM moved

-- name: hold_behind_stuck
-- Mark held the pending messages of this publisher's lanes (%(lanes)s) that
-- wait behind an uncertain or quarantined message of their key (its "stuck"
-- message): a claim then reads no more of them (claimable_in_lane reads the
-- messages that are not held). Run by the publisher's hold pass
-- (publisher/holds.py), in a transaction of its own; returns the ids marked.
-- Of each key, only the messages after its first stuck message and after the
-- last one already held are read (through messages_open_keys), so a pass
-- reads what arrived since the last one, not the whole queue behind the key.
-- A message in flight is left alone (its batch settles it). Whatever moves a
-- stuck message on releases the messages held behind it (release_held_of);
-- should that run before this pass commits and miss what it marked,
-- release_stale_holds releases them at the next pass, and until then the
-- claim counts them as holding their key back: late, never out of order.
WITH stuck AS (
    -- Read through the small partial indexes of the two states, one each.
    SELECT DISTINCT ON (s.key_hash, s.topic, s.key) s.key_hash, s.topic, s.key, s.seq
    FROM (SELECT key_hash, topic, key, seq, lane FROM outbox.messages
          WHERE state = 'uncertain'
          UNION ALL
          SELECT key_hash, topic, key, seq, lane FROM outbox.messages
          WHERE state = 'quarantined') AS s
    WHERE s.key IS NOT NULL AND s.lane = ANY(%(lanes)s::smallint[])
    ORDER BY s.key_hash, s.topic, s.key, s.seq
), held_after AS (
    -- The last message held: read backwards through messages_holding_keys,
    -- whose last entries of a key are its held messages.
    SELECT s.key_hash, s.topic, s.key,
           greatest(s.seq, (SELECT h.seq
                            FROM outbox.messages AS h
                            WHERE h.key_hash = s.key_hash AND h.key IS NOT NULL
                              AND (h.state IN ('in_flight', 'uncertain', 'quarantined')
                                   OR (h.state = 'pending' AND (h.failures > 0 OR h.held)))
                              AND h.state = 'pending' AND h.held
                              AND h.topic = s.topic AND h.key = s.key
                            ORDER BY h.seq DESC
                            LIMIT 1)) AS seq
    FROM stuck AS s
), waiting AS (
    -- Each key's next messages in seq order through messages_open_keys (its
    -- condition is repeated for that), at most %(most)s a key: a pass is a
    -- short transaction, and the next one goes on from there.
    SELECT w.id
    FROM held_after AS a,
         LATERAL (SELECT m.id
                  FROM outbox.messages AS m
                  WHERE m.key_hash = a.key_hash AND m.seq > a.seq AND m.key IS NOT NULL
                    AND m.state IN ('pending', 'in_flight', 'uncertain', 'quarantined')
                    AND m.state = 'pending' AND NOT m.held
                    AND m.topic = a.topic AND m.key = a.key
                  ORDER BY m.seq
                  LIMIT %(most)s) AS w
)
UPDATE outbox.messages AS m
SET held = true
-- Looked up by id (an array, so that the primary key is the index read).
WHERE m.id = ANY(ARRAY(SELECT id FROM waiting))
  AND m.state = 'pending' AND NOT m.held
  AND m.id NOT IN (SELECT message_id FROM outbox.in_flight)
RETURNING m.id

-- name: release_keys
-- The end of release_held_of and release_stale_holds: of each key hash in
-- held_key, release (held = false) the held messages before the key's first
-- uncertain or quarantined message, or all of them when it has none. Both
-- reads go through messages_holding_keys (its condition is repeated for
-- that): a key's first stuck message is among its first entries there, and
-- the messages released are the ones read; they are then written by id. The
-- bound is taken once per key (MATERIALIZED: inlined, it was taken again for
-- every message, reading the key's entries each time). Two keys of one hash
-- (a 64-bit hash: in practice never) are released together, up to the first
-- stuck message of either.
, release_bound AS MATERIALIZED (
    SELECT k.key_hash,
           coalesce((SELECT s.seq
                     FROM outbox.messages AS s
                     WHERE s.key_hash = k.key_hash AND s.key IS NOT NULL
                       AND (s.state IN ('in_flight', 'uncertain', 'quarantined')
                            OR (s.state = 'pending' AND (s.failures > 0 OR s.held)))
                       AND s.state IN ('uncertain', 'quarantined')
                     ORDER BY s.seq
                     LIMIT 1), 9223372036854775807) AS stuck_seq
    FROM held_key AS k
    WHERE k.key_hash IS NOT NULL
), released AS (
    -- Per key, oldest first, at most %(most)s a key (LATERAL with a limit, so
    -- that its bound is an index condition: joined whole, the planner hashed
    -- every held message of the key). What is left is released by the next
    -- pass's release_stale_holds, a short transaction each.
    SELECT w.id
    FROM release_bound AS r,
         LATERAL (SELECT m.id
                  FROM outbox.messages AS m
                  WHERE m.key_hash = r.key_hash AND m.seq < r.stuck_seq AND m.key IS NOT NULL
                    AND (m.state IN ('in_flight', 'uncertain', 'quarantined')
                         OR (m.state = 'pending' AND (m.failures > 0 OR m.held)))
                    AND m.state = 'pending' AND m.held
                  ORDER BY m.seq
                  LIMIT %(most)s) AS w
)
UPDATE outbox.messages AS m
SET held = false
WHERE m.id = ANY(ARRAY(SELECT id FROM released))
  AND m.state = 'pending' AND m.held
RETURNING m.id

-- name: release_held_of
-- After messages %(ids)s moved on from uncertain or quarantined (a decision
-- of the reconciler or an operator, in the decision's transaction or right
-- after it): release what was held behind them ({release_keys}).
WITH held_key AS (
    SELECT DISTINCT key_hash
    FROM outbox.messages
    WHERE id = ANY(%(ids)s::uuid[]) AND key IS NOT NULL
)
{release_keys}

-- name: held_key_hashes
-- The hashes of the keys that have held messages (held_key, a common table
-- expression; its last row is NULL), found by skipping through
-- messages_holding_keys from one key hash to the next: a recursive query,
-- one probe per key, however many messages each holds. Part of
-- release_stale_holds and stale_holds_left.
WITH RECURSIVE held_key (key_hash) AS (
    (SELECT m.key_hash
     FROM outbox.messages AS m
     WHERE m.key IS NOT NULL
       AND (m.state IN ('in_flight', 'uncertain', 'quarantined')
            OR (m.state = 'pending' AND (m.failures > 0 OR m.held)))
       AND m.state = 'pending' AND m.held
     ORDER BY m.key_hash
     LIMIT 1)
    UNION ALL
    SELECT (SELECT m.key_hash
            FROM outbox.messages AS m
            WHERE m.key_hash > k.key_hash AND m.key IS NOT NULL
              AND (m.state IN ('in_flight', 'uncertain', 'quarantined')
                   OR (m.state = 'pending' AND (m.failures > 0 OR m.held)))
              AND m.state = 'pending' AND m.held
            ORDER BY m.key_hash
            LIMIT 1)
    FROM held_key AS k
    WHERE k.key_hash IS NOT NULL
)

-- name: release_stale_holds
-- Release the held messages whose key has nothing uncertain or quarantined
-- left before them ({release_keys}): those marked by a pass that committed
-- after the decision that moved their stuck message had released its key,
-- or held by a version of the publisher that did not release. The keys with
-- held messages are {held_key_hashes}'s.
{held_key_hashes}
{release_keys}

-- name: held_keys
SELECT topic, key, held_by, state, waiting, reason, next_action
FROM outbox.held_keys
ORDER BY topic, key

-- name: work_left
-- Whether anything may still need a publisher: a batch open, a message
-- uncertain and not yet escalated, or pending and not held back behind a
-- message only an operator can move (quarantined, or uncertain and escalated).
-- A held message waits behind an uncertain or quarantined one: the first is
-- counted by the second line, the second needs an operator. (Or behind
-- nothing any more, until the next hold pass releases it: stale_holds_left.)
SELECT EXISTS (SELECT 1 FROM outbox.batches WHERE settled_at IS NULL)
    OR EXISTS (SELECT 1 FROM outbox.messages WHERE state = 'uncertain' AND escalated_at IS NULL)
    OR EXISTS (
        SELECT 1
        FROM outbox.messages AS m
        WHERE m.state = 'pending' AND NOT m.held
          AND (m.key IS NULL OR NOT EXISTS (
              SELECT 1
              FROM outbox.messages AS e
              WHERE e.key_hash = m.key_hash AND e.seq < m.seq
                AND e.key IS NOT NULL
                AND (e.state IN ('in_flight', 'uncertain', 'quarantined')
                     OR (e.state = 'pending' AND (e.failures > 0 OR e.held)))
                AND e.topic = m.topic AND e.key = m.key
                AND (e.state = 'quarantined'
                     OR (e.state = 'uncertain' AND e.escalated_at IS NOT NULL)))))

-- name: stale_holds_left
-- Whether a key's held messages have nothing before them that only an
-- operator can move (quarantined, or uncertain and escalated): a mark can
-- outlive its stuck message until the next hold pass releases it (a decision
-- releases at most MOST_HELD_PER_KEY of a key, and a pass that raced the
-- decision commits its marks after it). Then the key is work left, which
-- --exit-when-idle asks once work_left says none, so that it does not exit
-- before those messages go; a publisher that keeps running needs not ask,
-- its next pass releases them. A key's first held message tells for all its
-- held ones (what holds it back holds the later ones too). One probe per key
-- with held messages ({held_key_hashes}): some 600 ms next to 100,000 keys
-- each held behind its own quarantined message.
{held_key_hashes}
SELECT EXISTS (
    SELECT 1
    FROM held_key AS k
    CROSS JOIN LATERAL (
        SELECT f.key_hash, f.seq, f.topic, f.key
        FROM outbox.messages AS f
        WHERE f.key_hash = k.key_hash AND f.key IS NOT NULL
          AND (f.state IN ('in_flight', 'uncertain', 'quarantined')
               OR (f.state = 'pending' AND (f.failures > 0 OR f.held)))
          AND f.state = 'pending' AND f.held
        ORDER BY f.seq
        LIMIT 1) AS first_held
    WHERE NOT EXISTS (
        SELECT 1
        FROM outbox.messages AS e
        WHERE e.key_hash = first_held.key_hash AND e.seq < first_held.seq
          AND e.key IS NOT NULL
          AND (e.state IN ('in_flight', 'uncertain', 'quarantined')
               OR (e.state = 'pending' AND (e.failures > 0 OR e.held)))
          AND e.topic = first_held.topic AND e.key = first_held.key
          AND (e.state = 'quarantined'
               OR (e.state = 'uncertain' AND e.escalated_at IS NOT NULL))))

-- name: owned_lanes
-- The lanes this publisher owns under a live lease.
SELECT lane FROM outbox.lanes WHERE owner = %(owner)s AND lease_expires_at > now()

-- name: seconds_until_due
-- Seconds until the next message needs this publisher: a pending message of
-- its lanes (%(lanes)s, from owned_lanes; not in flight, not held: a held one
-- moves when the message it waits behind does) becomes claimable, a
-- batch's lease expires, or an uncertain message can be reconciled (zero or
-- less: now). NULL when none will. Measured by the database clock, the same
-- clock that set those times. Only this publisher's lanes are read for
-- pending messages: it cannot claim the others, and a backlog in another
-- publisher's lanes would be read whole after each of its empty claims. The
-- lanes are a value, not a subquery, so that the planner knows them: told
-- only "some lanes", with a million messages in one lane it planned a
-- sequential scan of the table per lane (3.6 s, against 2 ms).
SELECT extract(epoch FROM least(
           (SELECT min(available_at) FROM outbox.messages
            WHERE state = 'pending' AND lane = ANY(%(lanes)s::smallint[]) AND NOT held
              AND id NOT IN (SELECT message_id FROM outbox.in_flight)),
           (SELECT min(lease_expires_at) FROM outbox.batches WHERE settled_at IS NULL),
           (SELECT min(available_at) FROM outbox.messages
            WHERE state = 'uncertain' AND escalated_at IS NULL)
       ) - clock_timestamp())::float8

-- name: pin_read_committed
-- Every transaction of the session, implicit (autocommit) or begun, runs at
-- READ COMMITTED whatever default_transaction_isolation the server, database
-- or role sets (see publisher/connector.py).
SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED

-- name: pin_search_path
-- Resolve every unqualified name in pg_catalog (then pg_temp), never in a
-- schema another role can create objects in (public, say): PostgreSQL
-- prefers the closest type match among every schema on the path, so a
-- function planted there (a format(text, text, name) beside pg_catalog's
-- variadic one) would otherwise run as whoever runs these statements, the
-- operator, the publisher or, in a migration, the schema owner. Every outbox
-- object is named with its schema. For the rest of the session, or (true)
-- of the transaction. Returns the path it replaced (restore_search_path).
SELECT current_setting('search_path') AS previous,
       set_config('search_path', 'pg_catalog, pg_temp', %s)

-- name: restore_search_path
-- Put back, for the rest of the transaction, the path pin_search_path replaced
-- (a migration run in the caller's transaction, as Alembic's: its own
-- statements that follow find their tables on its path).
SELECT set_config('search_path', %s, true)

-- name: listen
-- The waker's session of its own: woken by the commits that notify, which are
-- those made while a publisher sleeps (see announce_sleep).
LISTEN outbox_pending

-- name: announce_sleep
-- A publisher about to sleep holds outbox.wakeup in SHARE mode until a claim
-- finds work (or for about a poll interval): from then on each enqueuing
-- transaction fails to take it in ROW EXCLUSIVE mode as it commits and sends
-- NOTIFY (the trigger of outbox.messages). The lock waits for the writers that
-- took it before, committing without a notification: once granted, their
-- messages are visible, and the publisher claims once more before it sleeps.
-- Such a writer holds it only from its pre-commit to its commit, unless it
-- made the trigger immediate (SET CONSTRAINTS): past the lock timeout the
-- publisher gives up this once and claims again instead.
SET LOCAL lock_timeout = '500ms';
LOCK TABLE outbox.wakeup IN SHARE MODE

-- name: register_publisher
INSERT INTO outbox.publishers (id, host, pid, version, lease_seconds)
VALUES (%(id)s, %(host)s, %(pid)s, %(version)s, %(lease_seconds)s)

-- name: heartbeat
-- Say this publisher is alive and, when asked to, renew the leases that would
-- expire soon of its open batches that its loop still works on (all of them
-- when batches is NULL): a batch the loop gave up on, or never heard of (its
-- claim's answer was lost), is left to expire and to recovery. An expired
-- lease is never renewed: once expired, a batch belongs to recovery. Batch
-- rows locked by a settle or a recovery in progress are skipped (they are
-- being closed), so a heartbeat never waits on one. Returns how many batch
-- leases were renewed.
WITH alive AS (
    UPDATE outbox.publishers
    SET heartbeat_at = now(),
        -- When it last reached Kafka (NULL: not said; see others_reach_kafka).
        kafka_reached_at = CASE WHEN %(kafka_reached)s::boolean IS TRUE THEN now()
                                ELSE kafka_reached_at END
    WHERE id = %(id)s
), expiring AS (
    SELECT id
    FROM outbox.batches
    WHERE %(renew)s AND settled_at IS NULL AND publisher_id = %(id)s
      AND (%(batches)s::bigint[] IS NULL OR id = ANY(%(batches)s::bigint[]))
      AND lease_expires_at > now()
      AND lease_expires_at < now() + make_interval(secs => %(lease_seconds)s::float8 / 2)
    FOR UPDATE SKIP LOCKED
), renewed AS (
    UPDATE outbox.batches AS b
    SET lease_expires_at = now() + make_interval(secs => %(lease_seconds)s::float8)
    FROM expiring AS e
    WHERE b.id = e.id
    RETURNING b.id
)
SELECT count(*) FROM renewed

-- name: others_reach_kafka
-- Whether another live publisher (beating within its lease) reached Kafka
-- within its lease: a publisher that cannot reach Kafka lets its lanes go to
-- such a one (publisher.heartbeat), and keeps them when there is none.
SELECT EXISTS (
    SELECT 1 FROM outbox.publishers
    WHERE id <> %(id)s AND stopped_at IS NULL
      AND now() - heartbeat_at
          < make_interval(secs => coalesce(lease_seconds, %(lease_seconds)s::float8))
      AND now() - kafka_reached_at
          < make_interval(secs => coalesce(lease_seconds, %(lease_seconds)s::float8))
)

-- name: renew_lanes
-- Renew the leases of the lanes this publisher owns; an expired one is lost
-- (another publisher may have taken it). Returns the lanes still owned. The
-- rows are locked in lane order, as a claim locks them (an UPDATE alone would
-- lock them in the order it finds them on disk, which updates change).
UPDATE outbox.lanes AS l
SET lease_expires_at = now() + make_interval(secs => %(lease_seconds)s::float8)
WHERE l.lane IN (SELECT lane FROM outbox.lanes
                 WHERE owner = %(owner)s AND lease_expires_at > now()
                 ORDER BY lane
                 FOR UPDATE)
  AND l.owner = %(owner)s AND l.lease_expires_at > now()
RETURNING l.lane

-- name: fair_share
-- How many lanes each live publisher should own (rounded up). A publisher is
-- live until its own lease has passed since its last heartbeat (the caller's
-- lease for one that recorded none: registered before 0015).
SELECT ceil((SELECT count(*) FROM outbox.lanes)::numeric
            / greatest(count(*), 1))::integer
FROM outbox.publishers
WHERE stopped_at IS NULL
  -- An age against a lease: a lease of any size stays in range (a timestamp
  -- minus a huge interval would not).
  AND now() - heartbeat_at < make_interval(
        secs => coalesce(lease_seconds, %(lease_seconds)s::float8))

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
-- Give lanes up (all of this publisher's when lanes is NULL), for others to
-- take; locked in lane order, as renew_lanes does.
UPDATE outbox.lanes AS l
SET owner = NULL, lease_expires_at = NULL, fence = l.fence + 1
WHERE l.lane IN (SELECT lane FROM outbox.lanes
                 WHERE owner = %(owner)s
                   AND (%(lanes)s::smallint[] IS NULL OR lane = ANY(%(lanes)s::smallint[]))
                 ORDER BY lane
                 FOR UPDATE)
  AND l.owner = %(owner)s
RETURNING l.lane

-- name: stop_publisher
UPDATE outbox.publishers SET stopped_at = now(), heartbeat_at = now() WHERE id = %(id)s

-- name: status
-- exact is false on a line whose count is an estimate (delivered messages on
-- a large table: see schema/0009_status_at_scale.sql).
SELECT topic, state, messages, oldest_created_at, oldest_age_seconds, waiting_retry, retrying,
       attempts, max_failures, lease_owners, next_lease_expiry, leases_expired, escalated,
       overdue, held_keys, live_publishers, healthy, next_action, exact
FROM outbox.status

-- name: idle_transaction_limit
-- For the publisher's store: the server ends the session (rolling its
-- transaction back) once a transaction of it has stayed idle %(limit)s
-- milliseconds. Its transactions last two statements; one held open longer
-- is a process that stopped between them (frozen, paused with its host), whose
-- row locks would otherwise hold others back for as long as it stays so.
SELECT set_config('idle_in_transaction_session_timeout', %(limit)s, false)

-- name: jit_off
-- For a session whose statements take milliseconds (the status readers, the
-- publisher's store): with many open messages their estimated cost passes
-- jit_above_cost, where compiling them would take longer than running them.
SET jit = off

-- name: jit_off_local
-- As jit_off, for the rest of the transaction only: a session that a pooler
-- in transaction mode hands to another client keeps nothing of it.
SELECT set_config('jit', 'off', true)

-- name: open_status
-- The open states per topic, for the metrics at every scrape: each is read
-- through its own partial index (in flight: from the open batches), so the
-- cost follows the open messages, not the delivered ones kept for retention
-- (outbox.status reads them the same way, and estimates the delivered ones).
-- With each, how many of them are stuck, as outbox.status counts them: in
-- flight under an expired lease (no publisher recovers them), uncertain and
-- escalated (an operator decides), uncertain and overdue (undecided five
-- minutes after they became decidable: reconciliation is off or cannot
-- reach Kafka; outbox.status's overdue, and outbox.inspection.OVERDUE_AFTER).
SELECT topic, 'pending' AS state, count(*),
       extract(epoch FROM now() - min(created_at))::float8, 0, 0, 0
FROM outbox.messages
WHERE state = 'pending' AND id NOT IN (SELECT message_id FROM outbox.in_flight)
GROUP BY topic
UNION ALL
SELECT m.topic, 'in_flight', count(*), extract(epoch FROM now() - min(m.created_at))::float8,
       0, 0, count(*) FILTER (WHERE f.lease_expires_at < now())
FROM outbox.in_flight AS f
JOIN outbox.messages AS m ON m.id = f.message_id AND m.state = 'pending'
GROUP BY m.topic
UNION ALL
SELECT topic, 'uncertain', count(*), extract(epoch FROM now() - min(created_at))::float8,
       count(*) FILTER (WHERE escalated_at IS NOT NULL),
       count(*) FILTER (WHERE escalated_at IS NULL
                          AND available_at < now() - interval '5 minutes'),
       0
FROM outbox.messages WHERE state = 'uncertain' GROUP BY topic
UNION ALL
SELECT topic, 'quarantined', count(*), extract(epoch FROM now() - min(created_at))::float8,
       0, 0, 0
FROM outbox.messages WHERE state = 'quarantined' GROUP BY topic

-- name: message
-- One message, for outbox inspect; value_bytes instead of the payload.
SELECT id, seq, topic, key, state, created_at, available_at, lease_owner, lease_expires_at,
       fence, attempts, failures, kafka_partition, kafka_offset, delivered_at, updated_at,
       last_error, idempotency_key, header_names, lane, batch_id, escalated_at, send_alone,
       octet_length(value) AS value_bytes
FROM outbox.message_status
WHERE id = %(id)s

-- name: message_attempts
-- Every attempt of a message, with the process that made it and the
-- evidence its batch recorded (kept while the batch is). A delivery writes
-- no attempt row: its batch is its record, named by the message row (once
-- retention purged the row, see purged_delivery).
WITH delivery AS (
    SELECT m.attempts AS attempt, m.fence, m.batch_id, m.kafka_partition, m.kafka_offset
    FROM outbox.messages AS m
    WHERE m.id = %(id)s AND m.state = 'delivered'
)
SELECT a.attempt, a.publisher_id, p.host, p.pid, a.fence, a.batch_id, a.started_at,
       a.send_began, b.send_began_at, b.write_deadline, a.finished_at, a.outcome, a.error,
       a.kafka_partition, a.kafka_offset, b.transactional_id
FROM outbox.attempts AS a
LEFT JOIN outbox.publishers AS p ON p.id = a.publisher_id
LEFT JOIN outbox.batches AS b ON b.id = a.batch_id
WHERE a.message_id = %(id)s
UNION ALL
SELECT d.attempt, b.publisher_id, p.host, p.pid, d.fence, b.id, b.claimed_at,
       true, b.send_began_at, b.write_deadline, b.settled_at, 'delivered', NULL,
       d.kafka_partition, d.kafka_offset, b.transactional_id
FROM delivery AS d
JOIN outbox.batches AS b ON b.id = d.batch_id
LEFT JOIN outbox.publishers AS p ON p.id = b.publisher_id
WHERE NOT EXISTS (SELECT 1 FROM outbox.attempts AS a
                  WHERE a.message_id = %(id)s AND a.batch_id = d.batch_id)
ORDER BY 1

-- name: batch_id_range
-- The lowest and highest batch ids kept (the primary key's two ends).
SELECT min(id) AS low, max(id) AS high FROM outbox.batches

-- name: batch_at_or_after
-- The first batch kept from an id on, and when it was claimed.
SELECT id, claimed_at FROM outbox.batches WHERE id >= %(id)s ORDER BY id LIMIT 1

-- name: purged_delivery
-- The batch that delivered a purged message: the first batch from
-- %(from)s on (batch ids grow with their claim time) that began sending,
-- names the message and recorded no attempt of it (every claim that began
-- and did not deliver wrote one; one that never began can leave a message to
-- another batch without an attempt). It is read in primary-key order and
-- stops at the first match; its partition and offset went with the message
-- row.
SELECT coalesce((SELECT max(attempt) FROM outbox.attempts WHERE message_id = %(id)s), 0) + 1
           AS attempt,
       b.publisher_id, p.host, p.pid, NULL::bigint AS fence, b.id AS batch_id,
       b.claimed_at AS started_at, true AS send_began, b.send_began_at, b.write_deadline,
       b.settled_at AS finished_at, 'delivered' AS outcome, NULL::text AS error,
       NULL::integer AS kafka_partition, NULL::bigint AS kafka_offset, b.transactional_id
FROM outbox.batches AS b
LEFT JOIN outbox.publishers AS p ON p.id = b.publisher_id
WHERE b.id >= %(from)s AND b.settled_at IS NOT NULL AND b.send_began_at IS NOT NULL
  AND b.message_ids @> ARRAY[%(id)s::uuid]
  AND b.id NOT IN (SELECT batch_id FROM outbox.attempts
                   WHERE message_id = %(id)s AND batch_id IS NOT NULL)
ORDER BY b.id
LIMIT 1

-- name: statement_timeout
-- Bound the statements that follow in this transaction; returns the bound
-- that held before, to put back.
SELECT current_setting('statement_timeout') AS previous,
       set_config('statement_timeout', %(timeout)s, true)

-- name: message_claim
-- The claim a message is in now (in flight), or that it is uncertain from;
-- its attempt record is written when it settles.
SELECT b.id, b.publisher_id, p.host, p.pid, b.claimed_at, b.send_began_at, b.write_deadline,
       b.transactional_id
FROM outbox.message_status AS m
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
FROM outbox.message_status AS m
JOIN outbox.held_keys AS h ON h.topic = m.topic AND h.key = m.key
WHERE m.id = %(id)s AND m.state = 'pending' AND h.held_by <> m.id

-- name: read_context
-- For outbox inspect: whether a publisher runs (one holds a lane's lease now,
-- as outbox.status and outbox.held_keys judge it), and the database's time,
-- by which a lease or deadline has passed.
SELECT EXISTS (SELECT 1 FROM outbox.lanes WHERE lease_expires_at > now()) AS running,
       now() AS now

-- name: list_messages
-- Messages in one state, oldest first; one more than asked shows there are more.
-- The fence is what an operator's decision names (see decision_check).
-- Each state is read where it is kept, never by reading the whole table
-- (outbox.message_status derives the state, which hides every index): the
-- open states through their partial indexes (messages_pending_by_lane,
-- messages_uncertain, messages_quarantined), in flight from the open
-- batches, discarded through the decisions that discarded them
-- (decisions_discarded, each message then by its key: a row set to
-- 'discarded' by hand, with no decision, is not listed), delivered in
-- primary-key order (ids are UUIDv7: the first are the earliest enqueued; of
-- a topic with few delivered messages, that may read much of the table). Only the branch of the state asked for runs:
-- the others' conditions are false once the parameters are known. Each
-- branch is bounded first, so the view is read for those ids alone.
WITH chosen AS MATERIALIZED (
    (SELECT m.id FROM outbox.messages AS m
     WHERE %(state)s = 'pending' AND m.state = 'pending'
       AND (%(topic)s::text IS NULL OR m.topic = %(topic)s::text)
       AND NOT EXISTS (SELECT 1 FROM outbox.in_flight AS f WHERE f.message_id = m.id)
     ORDER BY m.seq LIMIT %(limit)s)
    UNION ALL
    (SELECT m.id FROM outbox.in_flight AS f JOIN outbox.messages AS m ON m.id = f.message_id
     WHERE %(state)s = 'in_flight' AND (%(topic)s::text IS NULL OR m.topic = %(topic)s::text)
     ORDER BY m.seq LIMIT %(limit)s)
    UNION ALL
    -- (A branch a state, each naming its state: a generic plan, which a
    -- prepared statement may come to, matches a partial index only so.)
    (SELECT m.id FROM outbox.messages AS m
     WHERE %(state)s = 'uncertain' AND m.state = 'uncertain'
       AND (%(topic)s::text IS NULL OR m.topic = %(topic)s::text)
     ORDER BY m.seq LIMIT %(limit)s)
    UNION ALL
    (SELECT m.id FROM outbox.messages AS m
     WHERE %(state)s = 'quarantined' AND m.state = 'quarantined'
       AND (%(topic)s::text IS NULL OR m.topic = %(topic)s::text)
     ORDER BY m.seq LIMIT %(limit)s)
    UNION ALL
    (SELECT m.id
     FROM outbox.decisions AS d
     CROSS JOIN LATERAL (
         SELECT m.id, m.seq FROM outbox.messages AS m
         WHERE m.id = d.message_id AND m.state COLLATE "C" = 'discarded'
           AND (%(topic)s::text IS NULL OR m.topic = %(topic)s::text)
         OFFSET 0) AS m
     WHERE %(state)s = 'discarded' AND d.to_state = 'discarded'
     ORDER BY m.seq LIMIT %(limit)s)
    UNION ALL
    (SELECT m.id FROM outbox.messages AS m
     WHERE %(state)s = 'delivered' AND m.state = 'delivered'
       AND (%(topic)s::text IS NULL OR m.topic = %(topic)s::text)
     ORDER BY m.id LIMIT %(limit)s)
)
SELECT id, topic, key, state, created_at, attempts, fence, failures, available_at, lease_owner,
       lease_expires_at, kafka_partition, kafka_offset, delivered_at, escalated_at, last_error
FROM outbox.message_status
WHERE id IN (SELECT id FROM chosen) AND state = %(state)s
ORDER BY seq

-- name: count_to_purge
-- What one purge with these windows would delete (outbox purge --dry-run), in
-- one statement and one snapshot: the delivered messages purge_delivered
-- would delete, and the evidence purge_attempts, purge_decisions and
-- purge_batches would delete after them in the same run, that of those
-- messages included.
WITH doomed AS MATERIALIZED (
    SELECT m.id FROM outbox.messages AS m
    WHERE m.id < outbox.uuid7_floor(now() - %(delivered)s::interval)
      AND m.state = 'delivered' AND m.delivered_at < now() - %(delivered)s::interval
      AND NOT EXISTS (SELECT 1 FROM outbox.messages AS e
                      WHERE m.key IS NOT NULL
                        AND e.key IS NOT NULL AND e.key_hash = m.key_hash AND e.seq < m.seq
                        AND e.state IN ('pending', 'in_flight', 'uncertain', 'quarantined')
                        AND e.topic = m.topic AND e.key = m.key)
)
SELECT
    (SELECT count(*) FROM doomed),
    (SELECT count(*) FROM outbox.attempts AS a
     WHERE a.message_id < outbox.uuid7_floor(now() - %(evidence)s::interval)
       AND coalesce(a.finished_at, a.started_at) < now() - %(evidence)s::interval
       AND (a.message_id IN (SELECT id FROM doomed)
            OR NOT EXISTS (SELECT 1 FROM outbox.messages AS m WHERE m.id = a.message_id))),
    (SELECT count(*) FROM outbox.decisions AS d
     WHERE d.message_id < outbox.uuid7_floor(now() - %(evidence)s::interval)
       AND d.decided_at < now() - %(evidence)s::interval
       AND (d.message_id IN (SELECT id FROM doomed)
            OR NOT EXISTS (SELECT 1 FROM outbox.messages AS m WHERE m.id = d.message_id))),
    (SELECT count(*) FROM outbox.batches AS b
     WHERE b.claimed_at < now() - %(evidence)s::interval
       AND b.settled_at IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM outbox.messages AS m
                       WHERE m.batch_id = b.id AND m.state = 'uncertain')
       AND b.id NOT IN (SELECT q.batch_id FROM outbox.messages AS q
                        WHERE q.state = 'quarantined' AND q.batch_id IS NOT NULL))

-- name: purge_delivered
-- One bounded step of retention. Looks at up to `limit` messages after
-- `after` in id order, enqueued before the cutoff (ids are UUIDv7: an id
-- range is an enqueue-time range, read from the primary key), and deletes
-- those delivered before the cutoff. Nothing else is ever deleted. Returns
-- the last id looked at (NULL when done) and how many were deleted.
-- A delivered keyed message is kept, whatever its age, while an earlier
-- message of its key (same topic and key, lower seq) is still open: pending
-- (claimed or not: in flight, or waiting out a retry, may end uncertain),
-- uncertain, or quarantined (an operator may retry it). The reconciler
-- decides an uncertain message "absent, but a later message of its key is in
-- Kafka" by finding that later message's row (later_of_key): purged, it
-- would be resent out of order. Delivered and discarded are final and hold
-- nothing. The probe reads the small messages_open_keys index, by key for
-- each row, whatever the statistics say (OFFSET 0 keeps it a subplan run per
-- row): a planner that believes almost nothing is open (statistics taken
-- before a backlog) would otherwise read every open row once and test each
-- of the step's rows against all of them, seconds a step over a backlog.
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
      AND NOT EXISTS (SELECT 1 FROM outbox.messages AS e
                      WHERE m.key IS NOT NULL
                        AND e.key IS NOT NULL AND e.key_hash = m.key_hash AND e.seq < m.seq
                        AND e.state IN ('pending', 'in_flight', 'uncertain', 'quarantined')
                        AND e.topic = m.topic AND e.key = m.key
                      OFFSET 0)
    RETURNING 1
)
SELECT (SELECT id FROM scanned ORDER BY id DESC LIMIT 1), (SELECT count(*) FROM deleted)

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

-- name: purge_batches
-- One bounded step: closed batches claimed before the cutoff, except those
-- an uncertain message still needs for reconciliation (an open batch is in
-- flight: recovery needs it), and those a quarantined message names: they
-- say what was sent with it, which an operator's retry reads (overtaken_by:
-- a later message of its key written in that batch). Each batch's uncertain
-- messages are looked up by its id, whatever the statistics say (OFFSET 0:
-- see purge_delivered); the quarantined messages' batches are read once a
-- step, through their partial index.
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
      AND b.settled_at IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM outbox.messages AS m
                      WHERE m.batch_id = b.id AND m.state = 'uncertain'
                      OFFSET 0)
      AND b.id NOT IN (SELECT q.batch_id FROM outbox.messages AS q
                       WHERE q.state = 'quarantined' AND q.batch_id IS NOT NULL)
    RETURNING 1
)
SELECT CASE WHEN bool_and(s.old) THEN max(s.id) END, 0, (SELECT count(*) FROM deleted)
FROM scanned AS s

-- name: last_seq
-- outbox.testing: where a recorder starts (the highest seq written so far).
SELECT coalesce(max(seq), 0) FROM outbox.messages

-- name: enqueued_since
-- outbox.testing: the intents written after a recorder started, as the
-- reading connection sees them (its own transaction's, and committed ones),
-- in the order they were written.
SELECT id, topic, key, value, header_names, header_values, idempotency_key
FROM outbox.messages
WHERE seq > %(after)s
ORDER BY seq

-- name: database_now
-- The database's time, by which outbox list shows ages.
SELECT now()

-- name: migration_bookkeeping
-- The outbox schema, if missing, and the table of applied migrations.
-- CREATE SCHEMA IF NOT EXISTS would check the CREATE privilege on the
-- database first, which the owner of an existing outbox schema (made by a DBA
-- with AUTHORIZATION) need not have.
DO $$ BEGIN
    IF to_regnamespace('outbox') IS NULL THEN
        CREATE SCHEMA outbox;
    END IF;
END $$;
CREATE TABLE IF NOT EXISTS outbox.schema_migrations (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- name: migrations_recorded
-- Whether outbox.schema_migrations exists (NULL before the first migrate).
SELECT to_regclass('outbox.schema_migrations')

-- name: migrations_applied
SELECT version FROM outbox.schema_migrations

-- name: migration_lock
-- The lock every migration and create_roles hold until their transaction
-- ends: one migration (or grant) at a time.
SELECT pg_advisory_xact_lock(%s)

-- name: migration_lock_timeout
-- How long each statement of the rest of the migration's transaction waits
-- for a lock on an outbox table (see outbox.migrations).
SELECT set_config('lock_timeout', %s, true)

-- name: record_migration
-- Every statement an executor runs returns rows.
INSERT INTO outbox.schema_migrations (version, name) VALUES (%s, %s) RETURNING version

-- name: purge_lock
-- One purge at a time on a database: a session lock, held across the
-- purge's many short transactions.
SELECT pg_try_advisory_lock(%s)

-- name: purge_unlock
SELECT pg_advisory_unlock(%s)

-- name: outbox_tables_owner
-- The owner of the outbox tables, whether the current user may act as it
-- (its member, or a superuser), and the current user. By name, not
-- to_regclass: that one needs USAGE on the schema already.
SELECT c.relowner::regrole::text, pg_has_role(current_user, c.relowner, 'USAGE'), current_user
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = 'outbox' AND c.relname = 'messages'

-- name: roles_named
-- Which of these roles exist, and whether each is a superuser.
SELECT rolname, rolsuper FROM pg_roles WHERE rolname = ANY(%s)

-- name: create_role
-- {role} is the role's name, quoted as an identifier.
CREATE ROLE {role} NOLOGIN

-- name: schema_grantees
-- Roles holding a grant on the outbox schema itself, other than its owner.
SELECT DISTINCT a.grantee::regrole::text
FROM pg_namespace AS n, aclexplode(n.nspacl) AS a
WHERE n.nspname = 'outbox' AND a.grantee <> n.nspowner AND a.grantee <> 0
ORDER BY 1

-- name: open_enqueue_savepoint
-- The savepoint a multi-statement enqueue_many runs in on a psycopg
-- connection (SQLAlchemy's own nested transaction on SQLAlchemy's).
SAVEPOINT outbox_enqueue

-- name: rollback_to_enqueue_savepoint
ROLLBACK TO SAVEPOINT outbox_enqueue

-- name: release_enqueue_savepoint
RELEASE SAVEPOINT outbox_enqueue
