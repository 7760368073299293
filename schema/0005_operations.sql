-- 0005: what operators read and what retention deletes.
--
-- outbox.status becomes the one query an operator starts from: per topic and
-- over all topics, how many messages are in each state, how old the oldest
-- is, who holds the in-flight leases and until when, how much retrying is
-- going on, how many keys are held, whether the line needs a person, and the
-- next safe action in words.
--
-- Retention (`outbox purge`) deletes delivered messages after a window and
-- the evidence of purged messages (attempts, decisions, batches) after a
-- second, longer one. So that evidence can outlive its message, attempts and
-- decisions no longer cascade from messages: nothing but purge deletes them.

ALTER TABLE outbox.attempts DROP CONSTRAINT attempts_message_id_fkey;
ALTER TABLE outbox.decisions DROP CONSTRAINT decisions_message_id_fkey;

-- Purge walks messages, attempts and decisions in message id order: ids are
-- UUIDv7, so the primary keys (and decisions_message) already sort them by
-- enqueue time and no index on a timestamp is needed on these busy tables.
-- Batches are walked by their id, which also grows with time.
--
-- The smallest UUIDv7 of a moment: every id made at or after `at` sorts
-- after it, every id made before sorts before it.
CREATE FUNCTION outbox.uuid7_floor(at timestamptz) RETURNS uuid
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (lpad(to_hex(floor(extract(epoch FROM at) * 1000)::bigint), 12, '0')
            || '00000000000000000000')::uuid
$$;

-- Recovery and reconciliation read the batch of in-flight and uncertain
-- messages: purge keeps those batches whatever their age.
DROP INDEX outbox.messages_batch;
CREATE INDEX messages_batch ON outbox.messages (batch_id)
    WHERE state IN ('in_flight', 'uncertain');
-- The open states are counted through their partial indexes (the metrics read
-- them at every scrape): pending, in flight and uncertain have theirs already.
CREATE INDEX messages_quarantined ON outbox.messages (topic) WHERE state = 'quarantined';

UPDATE outbox.states SET next_action = CASE state
    WHEN 'pending' THEN 'none while a publisher runs; if none does, start outbox-publisher'
    WHEN 'in_flight' THEN 'none while the lease is live; an expired lease means its publisher '
                          'died or stalled: a running publisher recovers it from its evidence, '
                          'or run outbox reconcile'
    WHEN 'delivered' THEN 'none'
    WHEN 'uncertain' THEN 'wait: the reconciler decides it from Kafka once the old producer can '
                          'no longer write (or run outbox reconcile); if escalated, check Kafka '
                          'and decide with outbox resolve ID'
    WHEN 'quarantined' THEN 'read its error (outbox list --state quarantined), fix the cause, '
                            'then outbox retry ID, or outbox discard ID --reason TEXT'
    WHEN 'discarded' THEN 'none: an operator decided not to deliver it'
END;

DROP VIEW outbox.status;
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
    FROM outbox.messages AS m
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
