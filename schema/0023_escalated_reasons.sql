-- outbox.status's uncertain line no longer says why every escalated message
-- was escalated.
--
-- It said "the evidence in Kafka is gone; check the topic and decide each
-- with --delivered|--pending|--discard". The reconciler also escalates a
-- message whose record it proved absent, when a later message of its key is
-- already in Kafka: sending it now would put it after that one. Nothing of
-- its evidence is gone, and --delivered would lose it. The line now says
-- that the reconciler could not decide them and that each message's
-- last_error says why and which decisions fit (the reconciler words each
-- reason so; outbox inspect names the decisions for each). Only that text
-- changes; the view keeps its columns and reads the same rows, so CREATE OR
-- REPLACE keeps its grants.
--
-- Replacing a view takes it ACCESS EXCLUSIVE and so waits for the reads of
-- it in progress (outbox migrate waits at most --lock-timeout for them); no
-- write waits, and nothing is written to the tables.

CREATE OR REPLACE VIEW outbox.status AS
WITH live AS (
    -- Publishers alive now: each renews its lane leases while it runs.
    SELECT count(DISTINCT owner) AS publishers
    FROM outbox.lanes
    WHERE lease_expires_at > now()
),
size AS MATERIALIZED (
    -- Whether delivered messages are counted (a small table, or one never
    -- analysed) or estimated, and the live rows to estimate from.
    SELECT s.rows,
           s.bytes <= coalesce(nullif(current_setting('outbox.status_exact_mb', true), ''),
                               '20')::numeric * 1048576
               OR s.rows IS NULL AS exact
    FROM (SELECT pg_relation_size(c.oid) AS bytes,
                 CASE
                     WHEN greatest(pg_stat_get_last_vacuum_time(c.oid),
                                   pg_stat_get_last_autovacuum_time(c.oid),
                                   pg_stat_get_last_analyze_time(c.oid),
                                   pg_stat_get_last_autoanalyze_time(c.oid)) IS NOT NULL
                         THEN pg_stat_get_live_tuples(c.oid)::float8
                     -- Statistics reset (a crash): the planner's own estimate.
                     WHEN c.reltuples >= 0 AND c.relpages > 0
                         THEN c.reltuples / c.relpages
                              * (pg_relation_size(c.oid) / current_setting('block_size')::float8)
                 END AS rows
          FROM pg_class AS c
          WHERE c.oid = 'outbox.messages'::regclass) AS s
),
open AS (
    -- Every open message with its state as outbox.message_status derives it
    -- (in flight: pending and named by an open batch), each state read
    -- through its partial index.
    SELECT m.topic, 'pending'::text AS state, m.created_at, m.available_at, m.failures,
           m.attempts, m.escalated_at, NULL::uuid AS lease_owner,
           NULL::timestamptz AS lease_expires_at, NULL::text AS waiting_note, m.held
    FROM outbox.messages AS m
    WHERE m.state = 'pending' AND m.id NOT IN (SELECT message_id FROM outbox.in_flight)
    UNION ALL
    SELECT m.topic, 'in_flight', m.created_at, m.available_at, m.failures, m.attempts,
           m.escalated_at, f.lease_owner, f.lease_expires_at, NULL, false
    FROM outbox.in_flight AS f
    JOIN outbox.messages AS m ON m.id = f.message_id AND m.state = 'pending'
    UNION ALL
    SELECT m.topic, m.state, m.created_at, m.available_at, m.failures, m.attempts,
           m.escalated_at, NULL, NULL,
           -- Why its reconciliation waits, if the reconciler said so.
           CASE WHEN m.escalated_at IS NULL
                     AND starts_with(m.last_error, 'reconciliation waits: ')
                THEN m.last_error END,
           false
    FROM outbox.messages AS m
    WHERE m.state = 'uncertain'
    UNION ALL
    SELECT m.topic, m.state, m.created_at, m.available_at, m.failures, m.attempts,
           m.escalated_at, NULL, NULL, NULL, false
    FROM outbox.messages AS m
    WHERE m.state = 'quarantined'
),
open_counted AS (
    SELECT o.topic,
           o.state,
           GROUPING(o.topic) = 1                                          AS all_topics,
           count(*)                                                      AS messages,
           min(o.created_at)                                             AS oldest_created_at,
           count(*) FILTER (WHERE o.state = 'pending' AND o.available_at > now())
                                                                         AS waiting_retry,
           count(*) FILTER (WHERE o.failures > 0)                        AS retrying,
           sum(o.attempts)                                               AS attempts,
           max(o.failures)                                               AS max_failures,
           array_agg(DISTINCT o.lease_owner ORDER BY o.lease_owner)
               FILTER (WHERE o.state = 'in_flight')                      AS lease_owners,
           min(o.lease_expires_at) FILTER (WHERE o.state = 'in_flight')  AS next_lease_expiry,
           count(*) FILTER (WHERE o.state = 'in_flight' AND o.lease_expires_at < now())
                                                                         AS leases_expired,
           count(*) FILTER (WHERE o.state = 'uncertain' AND o.escalated_at IS NOT NULL)
                                                                         AS escalated,
           -- Uncertain, not escalated, and still undecided five minutes after
           -- it became decidable: reconciliation is off or cannot reach Kafka.
           count(*) FILTER (WHERE o.state = 'uncertain' AND o.escalated_at IS NULL
                              AND o.available_at < now() - interval '5 minutes')
                                                                         AS overdue,
           count(o.waiting_note)                                         AS waiting,
           min(o.waiting_note)                                           AS waiting_note,
           count(*) FILTER (WHERE o.held)                                AS held_messages
    FROM open AS o
    GROUP BY GROUPING SETS ((o.topic, o.state), (o.state))
),
closed_counted AS (
    -- Delivered and discarded, every row read: only while the table is small.
    SELECT c.topic, c.state, c.all_topics, c.messages, c.oldest_created_at, c.attempts
    FROM outbox.closed_counts() AS c
    WHERE (SELECT exact FROM size)
    UNION ALL
    -- Discarded, from the decisions that discarded them (decisions_discarded).
    SELECT m.topic, m.state, GROUPING(m.topic) = 1, count(*), min(m.created_at),
           sum(m.attempts)
    FROM outbox.messages AS m
    WHERE m.state = 'discarded' AND NOT (SELECT exact FROM size)
      AND m.id IN (SELECT d.message_id FROM outbox.decisions AS d
                   WHERE d.to_state = 'discarded')
    GROUP BY GROUPING SETS ((m.topic, m.state), (m.state))
),
counted_exactly AS (
    SELECT topic, all_topics, messages FROM open_counted
    UNION ALL
    SELECT topic, all_topics, messages FROM closed_counted
),
topic_share AS (
    -- Each topic's share of the rows as the last ANALYZE sampled them.
    SELECT v.topic, v.share
    FROM pg_stats AS st
    CROSS JOIN LATERAL unnest(st.most_common_vals::text::text[], st.most_common_freqs)
        AS v(topic, share)
    WHERE st.schemaname = 'outbox' AND st.tablename = 'messages' AND st.attname = 'topic'
      AND NOT (SELECT exact FROM size)
),
estimated AS (
    -- Delivered, estimated: the live rows less every row counted exactly.
    SELECT NULL::text AS topic, true AS all_topics,
           greatest(round(s.rows)::bigint
                    - coalesce((SELECT sum(c.messages) FROM counted_exactly AS c
                                WHERE c.all_topics), 0), 0)::bigint AS messages,
           (SELECT m.created_at FROM outbox.messages AS m
            WHERE m.state = 'delivered' ORDER BY m.id LIMIT 1) AS oldest_created_at
    FROM size AS s
    WHERE NOT s.exact
    UNION ALL
    SELECT t.topic, false,
           greatest(round(s.rows * t.share)::bigint
                    - coalesce((SELECT sum(c.messages) FROM counted_exactly AS c
                                WHERE NOT c.all_topics AND c.topic = t.topic), 0), 0)::bigint,
           NULL::timestamptz
    FROM size AS s, topic_share AS t
    WHERE NOT s.exact
),
counted AS (
    SELECT o.topic, o.state, o.all_topics, o.messages, o.oldest_created_at, o.waiting_retry,
           o.retrying, o.attempts, o.max_failures, o.lease_owners, o.next_lease_expiry,
           o.leases_expired, o.escalated, o.overdue, o.waiting, o.waiting_note, o.held_messages,
           true AS exact
    FROM open_counted AS o
    UNION ALL
    SELECT c.topic, c.state, c.all_topics, c.messages, c.oldest_created_at, 0, 0, c.attempts,
           0, NULL, NULL, 0, 0, 0, 0, NULL, 0, true
    FROM closed_counted AS c
    UNION ALL
    SELECT e.topic, 'delivered', e.all_topics, e.messages, e.oldest_created_at, 0, 0, NULL,
           0, NULL, NULL, 0, 0, 0, 0, NULL, 0, false
    FROM estimated AS e
    WHERE e.all_topics OR e.messages > 0
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
           c.overdue, c.waiting, c.waiting_note, c.held_messages, c.exact
    FROM outbox.states AS s
    LEFT JOIN counted AS c ON c.state = s.state AND c.all_topics
    UNION ALL
    SELECT c.topic, s.state, s.position, s.healthy, s.next_action,
           c.messages, c.oldest_created_at, c.waiting_retry, c.retrying, c.attempts,
           c.max_failures, c.lease_owners, c.next_lease_expiry, c.leases_expired, c.escalated,
           c.overdue, c.waiting, c.waiting_note, c.held_messages, c.exact
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
       -- Unknown (NULL) on an estimated line.
       CASE WHEN coalesce(l.exact, true) THEN coalesce(l.attempts, 0) END AS attempts,
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
           WHEN l.state = 'pending' AND l.held_messages > 0 THEN format(
               '%s of them marked held behind an uncertain or quarantined message of their key '
               '(outbox.held_keys; that state''s line says what to do)%s', l.held_messages,
               CASE WHEN l.messages > l.held_messages
                    THEN '; the others: none, a publisher will claim them' ELSE '' END)
           WHEN l.state = 'pending' THEN 'none: a publisher will claim them'
           WHEN l.state = 'in_flight' AND l.leases_expired > 0 AND live.publishers = 0
               THEN format(
               '%s lease(s) expired and no publisher is running to recover them: start '
               'outbox-publisher, or run outbox-publisher reconcile', l.leases_expired)
           WHEN l.state = 'in_flight' AND l.leases_expired > 0 THEN format(
               '%s lease(s) expired: their publisher died or stalled; a running publisher '
               'recovers them from their evidence, or run outbox-publisher reconcile',
               l.leases_expired)
           WHEN l.state = 'in_flight' THEN 'none while the leases are live'
           WHEN l.state = 'uncertain' AND l.escalated > 0 THEN format(
               '%s escalated: the reconciler could not decide them from Kafka; each one''s '
               'last_error says why and which decisions fit (outbox inspect ID shows it with '
               'its fence); decide each with outbox resolve ID --fence N '
               '--delivered|--pending|--discard --reason TEXT',
               l.escalated)
           WHEN l.state = 'uncertain' AND live.publishers = 0
               THEN 'no publisher is running to reconcile them: start outbox-publisher, '
                    'or run outbox-publisher reconcile'
           WHEN l.state = 'uncertain' AND l.waiting > 0 THEN format(
               '%s of them: %s (outbox list --state uncertain shows each)',
               l.waiting, l.waiting_note)
           WHEN l.state = 'uncertain' AND l.overdue > 0 THEN format(
               '%s undecided 5 minutes past their write deadline: check that publishers '
               'reconcile (--reconcile-interval above 0) and reach Kafka, or run '
               'outbox-publisher reconcile', l.overdue)
           ELSE l.next_action
       END                                                          AS next_action,
       -- false: messages is an estimate (delivered, on a large table).
       coalesce(l.exact, true)                                      AS exact
FROM lines AS l
CROSS JOIN live
LEFT JOIN held AS h
    ON h.state = l.state AND h.all_topics = (l.topic IS NULL)
   AND (l.topic IS NULL OR h.topic = l.topic)
ORDER BY l.topic NULLS FIRST, l.position;
