-- The next safe actions name today's commands. Reconciling with Kafka is
-- `outbox-publisher reconcile` (the command moved to the publisher's side,
-- which has the Kafka client), and a decision names the fence it was made
-- from (`outbox resolve ID --fence N ...`, the N that `outbox inspect ID`
-- shows), so that a decision taken on stale output is refused. Only text
-- changes: the views keep their columns, so CREATE OR REPLACE keeps their
-- grants, and nothing touches outbox.messages.

UPDATE outbox.states SET next_action = CASE state
    WHEN 'in_flight' THEN 'none while the lease is live; an expired lease means its publisher '
                          'died or stalled: a running publisher recovers it from its evidence, '
                          'or run outbox-publisher reconcile'
    WHEN 'uncertain' THEN 'wait: the reconciler decides it from Kafka once the old producer can '
                          'no longer write (or run outbox-publisher reconcile); if escalated, '
                          'check Kafka and decide with outbox resolve ID --fence N'
    WHEN 'quarantined' THEN 'read its error (outbox list --state quarantined), fix the cause, '
                            'then outbox retry ID --fence N, or outbox discard ID --fence N '
                            '--reason TEXT'
    ELSE next_action
END;

CREATE OR REPLACE VIEW outbox.held_keys AS
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
           WHEN state = 'quarantined' THEN 'fix the cause, then outbox retry ID --fence N; or outbox discard ID --fence N --reason TEXT (outbox inspect ID shows N)'
           WHEN state = 'uncertain' AND escalated_at IS NOT NULL THEN 'decide with outbox resolve ID --fence N (outbox inspect ID shows N)'
           WHEN state = 'uncertain' THEN 'wait for reconciliation, or run outbox-publisher reconcile'
           WHEN state = 'pending' THEN 'wait for the retry, or outbox discard ID --fence N --reason TEXT'
           ELSE 'wait for recovery, or run outbox-publisher reconcile'
       END AS next_action
FROM open
WHERE position = 1
  AND open_messages > 1
  AND (state IN ('uncertain', 'quarantined')
       OR (state = 'pending' AND available_at > now())
       OR (state = 'in_flight' AND lease_expires_at < now()));

-- outbox.status as in 0007, with the commands of today.
CREATE OR REPLACE VIEW outbox.status AS
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
               'recovers them from their evidence, or run outbox-publisher reconcile',
               l.leases_expired)
           WHEN l.state = 'in_flight' THEN 'none while the leases are live'
           WHEN l.state = 'uncertain' AND l.escalated > 0 THEN format(
               '%s escalated: the evidence in Kafka is gone; check the topic and decide each '
               'with outbox resolve ID --fence N --delivered|--pending|--discard --reason TEXT '
               '(outbox list --state uncertain shows each fence)',
               l.escalated)
           WHEN l.state = 'uncertain' AND live.publishers = 0
               THEN 'no publisher is running to reconcile them: start outbox-publisher, '
                    'or run outbox-publisher reconcile'
           WHEN l.state = 'uncertain' AND l.overdue > 0 THEN format(
               '%s undecided 5 minutes past their write deadline: check that publishers '
               'reconcile (--reconcile-interval above 0) and reach Kafka, or run '
               'outbox-publisher reconcile', l.overdue)
           ELSE l.next_action
       END                                                          AS next_action
FROM lines AS l
CROSS JOIN live
LEFT JOIN held AS h
    ON h.state = l.state AND h.all_topics = (l.topic IS NULL)
   AND (l.topic IS NULL OR h.topic = l.topic)
ORDER BY l.topic NULLS FIRST, l.position;
