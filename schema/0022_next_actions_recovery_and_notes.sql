-- 0022: outbox.status names the next action of messages in flight under
-- expired leases when no publisher is running to recover them, and
-- outbox.held_keys words a waiting note's next action for every kind of note.
--
-- Its in_flight line said "a running publisher recovers them from their
-- evidence, or run outbox-publisher reconcile" whether or not one ran. With
-- none running (no lane leased now, outbox.lanes, as the pending and
-- uncertain lines judge it), nothing recovers them until someone starts
-- one: the line now says so, as outbox.held_keys (0018) and outbox inspect
-- do for such a message. With a publisher running it is unchanged, and so
-- is the line's health (unhealthy while a lease is expired, either way).
--
-- It no longer looks for rows whose own state says in_flight (left by
-- versions before 0007, or set by hand): 0019 made them uncertain and its
-- check, validated by 0020, refuses the value. Otherwise only that line's
-- next action changes; the view keeps its columns, so CREATE OR REPLACE
-- keeps its grants.
--
-- Notes. An uncertain message whose reconciliation waits on Kafka says why
-- in its last_error, a note that starts 'reconciliation waits: '. The
-- reconciler wrote one kind (Kafka would not let the producer session that
-- sent it be fenced), and outbox.held_keys's next action for a key such a
-- message holds named it: "reconciliation decides it once Kafka lets its
-- producer session be fenced". It now writes another too (a transaction left
-- open in the partition holds read_committed reads back below where its
-- record may be), so the next action no longer names the cause: the reason,
-- the note itself, does. Only that text changes; the view keeps its
-- columns and reads the same rows.
--
-- Replacing a view takes it ACCESS EXCLUSIVE and so waits for the reads of
-- it in progress (outbox migrate waits at most --lock-timeout for them); no
-- write waits, and nothing is written to the tables.

CREATE OR REPLACE VIEW outbox.held_keys AS
WITH open AS (
    -- The open keyed messages, read through messages_open_keys (its
    -- condition, on the row's state); in flight is derived from the open
    -- batches as outbox.message_status does.
    SELECT m.topic, m.key, m.id, m.seq,
           CASE WHEN f.message_id IS NOT NULL THEN 'in_flight' ELSE m.state END AS state,
           m.available_at, f.lease_expires_at, m.escalated_at, m.last_error, m.attempts,
           row_number() OVER w AS position,
           count(*) OVER (PARTITION BY m.key_hash, m.topic, m.key) AS open_messages
    FROM outbox.messages AS m
    LEFT JOIN outbox.in_flight AS f ON f.message_id = m.id AND m.state = 'pending'
    WHERE m.key IS NOT NULL AND m.state IN ('pending', 'in_flight', 'uncertain', 'quarantined')
    WINDOW w AS (PARTITION BY m.key_hash, m.topic, m.key ORDER BY m.seq)
),
live AS (
    -- Whether a publisher runs: one holds a lane's lease now (outbox.status
    -- counts them the same way).
    SELECT EXISTS (SELECT 1 FROM outbox.lanes WHERE lease_expires_at > now()) AS running
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
           WHEN state = 'uncertain' AND starts_with(last_error, 'reconciliation waits: ')
               THEN 'uncertain, ' || last_error
           WHEN state = 'uncertain' THEN 'uncertain, awaiting reconciliation'
           WHEN state = 'pending' THEN format(
               'retry %s at %s UTC: %s', attempts + 1,
               to_char(available_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS'),
               coalesce(last_error, ''))
           ELSE format('in flight, lease expired at %s UTC',
                       to_char(lease_expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS'))
       END AS reason,
       CASE
           WHEN state = 'quarantined' THEN 'fix the cause, then outbox retry ID --fence N; or outbox discard ID --fence N --reason TEXT (outbox inspect ID shows N)'
           WHEN state = 'uncertain' AND escalated_at IS NOT NULL THEN 'decide with outbox resolve ID --fence N (outbox inspect ID shows N)'
           WHEN state = 'uncertain' AND NOT live.running
               THEN 'no publisher is running to reconcile it: start outbox-publisher, or run outbox-publisher reconcile'
           WHEN state = 'uncertain' AND starts_with(last_error, 'reconciliation waits: ')
               THEN 'do what the reason says: reconciliation goes on once Kafka lets it (outbox-publisher reconcile tries now)'
           WHEN state = 'uncertain' AND available_at < now() - interval '5 minutes'
               THEN 'undecided 5 minutes past its write deadline: check that publishers reconcile (--reconcile-interval above 0) and reach Kafka, or run outbox-publisher reconcile'
           WHEN state = 'uncertain' THEN 'wait for reconciliation, or run outbox-publisher reconcile'
           WHEN state = 'pending' AND NOT live.running
               THEN 'no publisher is running to retry it: start outbox-publisher; or outbox discard ID --fence N --reason TEXT'
           WHEN state = 'pending' THEN 'wait for the retry, or outbox discard ID --fence N --reason TEXT'
           WHEN NOT live.running
               THEN 'no publisher is running to recover it: start outbox-publisher, or run outbox-publisher reconcile'
           ELSE 'wait for recovery, or run outbox-publisher reconcile'
       END AS next_action
FROM open
CROSS JOIN live
WHERE position = 1
  AND open_messages > 1
  AND (state IN ('uncertain', 'quarantined')
       OR (state = 'pending' AND available_at > now())
       OR (state = 'in_flight' AND lease_expires_at < now()));

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
               '%s escalated: the evidence in Kafka is gone; check the topic and decide each '
               'with outbox resolve ID --fence N --delivered|--pending|--discard --reason TEXT '
               '(outbox list --state uncertain shows each fence)',
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
