-- 0007: one write per message. A claim writes only its batch.
--
-- Until now a message was written three times on its way out: the claim
-- (state in_flight, lease, fence, attempts), the settle, and an attempt row.
-- From here on:
--
-- * A claim writes one row, its batch, naming its messages (message_ids, in
--   claim order) and their keys (key_hashes), under a lease of its own that
--   the publisher's heartbeat renews with its lanes. It writes no message
--   row: a claimed message stays 'pending' in outbox.messages.
-- * A message is in flight while an open batch (settled_at IS NULL) names it.
--   outbox.in_flight lists them, and outbox.message_status shows every
--   message with that state derived: the view operators read. The claim
--   skips messages of open batches and holds back the keys in them.
-- * The settle closes the batch and writes each message row once: state,
--   where it went, fence + 1, attempts + 1. The batch is only closed if it is
--   still open and this publisher's: that is the fence for a settle (a
--   batch that recovery closed is not this publisher's to settle any more).
-- * A delivery writes no attempt row: its batch (the message's batch_id) is
--   the record of that attempt. Attempts that did not deliver, recoveries
--   and decisions keep their rows.
-- * Recovery closes a batch whose lease expired and moves its messages by
--   the batch's evidence, as before.
--
-- 'in_flight' stays a state of outbox.states and of the check constraint, but
-- no message row holds it any more; the indexes that name it are left as they
-- are (rebuilding them would lock the table for nothing).

ALTER TABLE outbox.batches
    ADD COLUMN message_ids uuid[] NOT NULL DEFAULT '{}',
    -- The key_hash of every keyed message of the batch: the claim holds these
    -- keys back while the batch is open.
    ADD COLUMN key_hashes bigint[] NOT NULL DEFAULT '{}',
    -- The claim's lease, renewed by the heartbeat while the publisher works on
    -- the batch. Once it expired, the batch belongs to recovery.
    ADD COLUMN lease_expires_at timestamptz;
-- settled_at now says when the batch was closed: settled by its publisher, or
-- recovered after its lease expired. Open batches are the ones in flight.
-- Claims, heartbeats and recovery read the open batches only.
CREATE INDEX batches_open ON outbox.batches (lease_expires_at) WHERE settled_at IS NULL;

-- Messages in flight under the old model become members of their batch. An
-- old publisher still running can settle none of them (it requires
-- state = 'in_flight'): its batches are recovered when their leases expire.
UPDATE outbox.batches AS b
SET message_ids = f.ids, key_hashes = f.key_hashes, lease_expires_at = f.lease_expires_at
FROM (SELECT batch_id,
             array_agg(id ORDER BY seq) AS ids,
             coalesce(array_agg(DISTINCT key_hash) FILTER (WHERE key_hash IS NOT NULL), '{}')
                 AS key_hashes,
             max(lease_expires_at) AS lease_expires_at
      FROM outbox.messages
      WHERE state = 'in_flight' AND batch_id IS NOT NULL
      GROUP BY batch_id) AS f
WHERE b.id = f.batch_id;
-- Every other batch is closed: settled, or recovered (which did not close it).
UPDATE outbox.batches SET settled_at = coalesce(settled_at, now())
WHERE settled_at IS NULL AND lease_expires_at IS NULL;
-- The old claim counted the attempt; the settle or recovery counts it now.
UPDATE outbox.messages AS m
SET state = 'pending', attempts = m.attempts - 1
FROM outbox.batches AS b
WHERE m.state = 'in_flight' AND b.id = m.batch_id AND b.settled_at IS NULL;
-- In flight with no batch record (rows from before batches, or edited by
-- hand): whether sending began is unknown, so they are uncertain.
WITH legacy AS (
    UPDATE outbox.messages
    SET state = 'uncertain',
        available_at = now(),
        last_error = format('legacy: in flight under publisher %s with no batch record; '
                            'whether sending began is unknown', lease_owner),
        updated_at = now()
    WHERE state = 'in_flight'
    RETURNING id, attempts, fence, lease_owner, last_error
)
INSERT INTO outbox.attempts
    (message_id, attempt, publisher_id, fence, started_at, send_began, finished_at, outcome, error)
SELECT id, attempts, coalesce(lease_owner, '00000000-0000-0000-0000-000000000000'), fence, now(),
       true, now(), 'abandoned', last_error
FROM legacy
ON CONFLICT (message_id, attempt) DO NOTHING;

-- The views read the lease columns; they are rebuilt below.
DROP VIEW outbox.status;
DROP VIEW outbox.held_keys;
-- The lease is the batch's now (drops messages_leased and
-- messages_in_flight_leased with them).
ALTER TABLE outbox.messages DROP COLUMN lease_owner, DROP COLUMN lease_expires_at;

-- The messages of open batches, with their claim: what is in flight.
CREATE VIEW outbox.in_flight AS
SELECT u.message_id,
       b.id AS batch_id,
       b.publisher_id AS lease_owner,
       b.lease_expires_at,
       b.claimed_at,
       b.send_began_at,
       b.transactional_id
FROM outbox.batches AS b
CROSS JOIN LATERAL unnest(b.message_ids) AS u(message_id)
WHERE b.settled_at IS NULL;

-- Every message with its state as operators mean it: 'in_flight' while an
-- open batch names it, else the state its row holds; the lease is the
-- batch's. Read this view, not outbox.messages, for a message's state.
CREATE VIEW outbox.message_status AS
SELECT m.id, m.seq, m.topic, m.key, m.value, m.header_names, m.header_values,
       m.idempotency_key,
       CASE WHEN f.message_id IS NOT NULL THEN 'in_flight' ELSE m.state END AS state,
       m.created_at, m.available_at,
       f.lease_owner, f.lease_expires_at,
       m.fence, m.attempts, m.failures, m.send_alone,
       -- In flight, this attempt has not stored where it went yet; an earlier
       -- attempt's partition and offset are not shown as if they were its own.
       CASE WHEN f.message_id IS NULL THEN m.kafka_partition END AS kafka_partition,
       CASE WHEN f.message_id IS NULL THEN m.kafka_offset END AS kafka_offset,
       m.delivered_at, m.updated_at, m.last_error,
       m.escalated_at, m.lane, m.key_hash,
       coalesce(f.batch_id, m.batch_id) AS batch_id
FROM outbox.messages AS m
LEFT JOIN outbox.in_flight AS f ON f.message_id = m.id AND m.state = 'pending';

CREATE VIEW outbox.held_keys AS
WITH open AS (
    SELECT m.topic, m.key, m.id, m.seq, m.state, m.available_at, m.lease_expires_at,
           m.escalated_at, m.last_error, m.attempts,
           row_number() OVER w AS position,
           count(*) OVER (PARTITION BY m.key_hash, m.topic, m.key) AS open_messages
    FROM outbox.message_status AS m
    WHERE m.key IS NOT NULL AND m.state IN ('pending', 'in_flight', 'uncertain', 'quarantined')
    WINDOW w AS (PARTITION BY m.key_hash, m.topic, m.key ORDER BY m.seq)
)
SELECT topic,
       key,
       id AS held_by,
       state,
       open_messages - 1 AS waiting,
       CASE
           WHEN state = 'quarantined' THEN 'quarantined: ' || coalesce(last_error, '')
           WHEN state = 'uncertain' AND escalated_at IS NOT NULL
               THEN 'uncertain, escalated: ' || coalesce(last_error, '')
           WHEN state = 'uncertain' THEN 'uncertain, awaiting reconciliation'
           WHEN state = 'pending' THEN format('retry %s at %s: %s', attempts + 1,
                                              available_at, coalesce(last_error, ''))
           ELSE format('in flight, lease expired at %s', lease_expires_at)
       END AS reason,
       CASE
           WHEN state = 'quarantined' THEN 'fix the cause, then outbox retry ID; or outbox discard ID --reason TEXT'
           WHEN state = 'uncertain' AND escalated_at IS NOT NULL THEN 'decide with outbox resolve ID'
           WHEN state = 'uncertain' THEN 'wait for reconciliation, or run outbox reconcile'
           WHEN state = 'pending' THEN 'wait for the retry, or outbox discard ID --reason TEXT'
           ELSE 'wait for recovery, or run outbox reconcile'
       END AS next_action
FROM open
WHERE position = 1
  AND open_messages > 1
  AND (state IN ('uncertain', 'quarantined')
       OR (state = 'pending' AND available_at > now())
       OR (state = 'in_flight' AND lease_expires_at < now()));

-- outbox.status as in 0005, counting in-flight messages from their batches.
CREATE VIEW outbox.status AS
WITH live AS (
    -- Publishers alive now: each renews its lane leases while it runs.
    SELECT count(DISTINCT owner) AS publishers
    FROM outbox.lanes
    WHERE lease_expires_at > now()
),
counted AS (
    SELECT m.topic,
           m.state,
           GROUPING(m.topic) = 1                                          AS all_topics,
           count(*)                                                      AS messages,
           min(m.created_at)                                             AS oldest_created_at,
           count(*) FILTER (WHERE m.state = 'pending' AND m.available_at > now())
                                                                         AS waiting_retry,
           count(*) FILTER (WHERE m.failures > 0
                              AND m.state NOT IN ('delivered', 'discarded')) AS retrying,
           coalesce(sum(m.attempts), 0)                                  AS attempts,
           coalesce(max(m.failures) FILTER (
               WHERE m.state NOT IN ('delivered', 'discarded')), 0)      AS max_failures,
           array_agg(DISTINCT m.lease_owner ORDER BY m.lease_owner)
               FILTER (WHERE m.state = 'in_flight')                      AS lease_owners,
           min(m.lease_expires_at) FILTER (WHERE m.state = 'in_flight')  AS next_lease_expiry,
           count(*) FILTER (WHERE m.state = 'in_flight' AND m.lease_expires_at < now())
                                                                         AS leases_expired,
           count(*) FILTER (WHERE m.state = 'uncertain' AND m.escalated_at IS NOT NULL)
                                                                         AS escalated,
           -- Uncertain, not escalated, and still undecided five minutes after
           -- it became decidable: reconciliation is off or cannot reach Kafka.
           count(*) FILTER (WHERE m.state = 'uncertain' AND m.escalated_at IS NULL
                              AND m.available_at < now() - interval '5 minutes')
                                                                         AS overdue
    FROM outbox.message_status AS m
    GROUP BY GROUPING SETS ((m.topic, m.state), (m.state))
),
held AS (
    SELECT h.topic, h.state, GROUPING(h.topic) = 1 AS all_topics, count(*) AS held_keys
    FROM outbox.held_keys AS h
    GROUP BY GROUPING SETS ((h.topic, h.state), (h.state))
),
lines AS (
    -- Every state over all topics, even with no messages; per topic, the
    -- states that have messages.
    SELECT NULL::text AS topic, s.state, s.position, s.healthy, s.next_action,
           c.messages, c.oldest_created_at, c.waiting_retry, c.retrying, c.attempts,
           c.max_failures, c.lease_owners, c.next_lease_expiry, c.leases_expired, c.escalated,
           c.overdue
    FROM outbox.states AS s
    LEFT JOIN counted AS c ON c.state = s.state AND c.all_topics
    UNION ALL
    SELECT c.topic, s.state, s.position, s.healthy, s.next_action,
           c.messages, c.oldest_created_at, c.waiting_retry, c.retrying, c.attempts,
           c.max_failures, c.lease_owners, c.next_lease_expiry, c.leases_expired, c.escalated,
           c.overdue
    FROM outbox.states AS s
    JOIN counted AS c ON c.state = s.state AND NOT c.all_topics
)
SELECT l.topic,
       l.state,
       coalesce(l.messages, 0)                                      AS messages,
       l.oldest_created_at,
       extract(epoch FROM now() - l.oldest_created_at)::float8      AS oldest_age_seconds,
       coalesce(l.waiting_retry, 0)                                 AS waiting_retry,
       coalesce(l.retrying, 0)                                      AS retrying,
       coalesce(l.attempts, 0)                                      AS attempts,
       coalesce(l.max_failures, 0)                                  AS max_failures,
       coalesce(l.lease_owners, '{}')                               AS lease_owners,
       l.next_lease_expiry,
       coalesce(l.leases_expired, 0)                                AS leases_expired,
       coalesce(l.escalated, 0)                                     AS escalated,
       coalesce(l.overdue, 0)                                       AS overdue,
       coalesce(h.held_keys, 0)                                     AS held_keys,
       live.publishers                                              AS live_publishers,
       CASE
           WHEN coalesce(l.messages, 0) = 0 THEN true
           WHEN l.state = 'pending' THEN live.publishers > 0
           WHEN l.state = 'in_flight' THEN l.leases_expired = 0
           -- Waiting for the reconciler is no reason to call anyone, as long
           -- as one runs and it keeps up.
           WHEN l.state = 'uncertain'
               THEN l.escalated = 0 AND l.overdue = 0 AND live.publishers > 0
           ELSE l.healthy
       END                                                          AS healthy,
       CASE
           WHEN coalesce(l.messages, 0) = 0 THEN 'none'
           WHEN l.state = 'pending' AND live.publishers = 0
               THEN 'no publisher is running: start outbox-publisher'
           WHEN l.state = 'pending' THEN 'none: a publisher will claim them'
           WHEN l.state = 'in_flight' AND l.leases_expired > 0 THEN format(
               '%s lease(s) expired: their publisher died or stalled; a running publisher '
               'recovers them from their evidence, or run outbox reconcile',
               l.leases_expired)
           WHEN l.state = 'in_flight' THEN 'none while the leases are live'
           WHEN l.state = 'uncertain' AND l.escalated > 0 THEN format(
               '%s escalated: the evidence in Kafka is gone; check the topic and decide each '
               'with outbox resolve ID --delivered|--pending|--discard --reason TEXT '
               '(outbox list --state uncertain)',
               l.escalated)
           WHEN l.state = 'uncertain' AND live.publishers = 0
               THEN 'no publisher is running to reconcile them: start outbox-publisher, '
                    'or run outbox reconcile'
           WHEN l.state = 'uncertain' AND l.overdue > 0 THEN format(
               '%s undecided 5 minutes past their write deadline: check that publishers '
               'reconcile (--reconcile-interval above 0) and reach Kafka, or run '
               'outbox reconcile', l.overdue)
           ELSE l.next_action
       END                                                          AS next_action
FROM lines AS l
CROSS JOIN live
LEFT JOIN held AS h
    ON h.state = l.state AND h.all_topics = (l.topic IS NULL)
   AND (l.topic IS NULL OR h.topic = l.topic)
ORDER BY l.topic NULLS FIRST, l.position;
