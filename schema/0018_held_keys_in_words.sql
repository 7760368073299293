-- 0018: outbox.held_keys says when in UTC, and names the next action of a
-- key no publisher is running to move on.
--
-- Times. A key held by a message waiting out a retry, or in flight under an
-- expired lease, gave the time as PostgreSQL prints a timestamptz: in the
-- session's time zone, to the microsecond ('2026-12-03 23:56:16.070431+01').
-- The reason now gives it to the second in UTC, as outbox status and outbox
-- inspect print every time ('2026-12-03 22:56:16 UTC'), whatever the
-- session's TimeZone.
--
-- No publisher running. A key held by a message that waits for a retry, a
-- recovery or a reconciliation said "wait for ...": nothing comes while no
-- publisher runs. Its next action now says so, as the status view's pending
-- and uncertain lines do (its in_flight line says "a running publisher
-- recovers them"), judged the same way: no lane leased now (outbox.lanes,
-- one row a lane), and in the same order: for an uncertain message,
-- escalated first (a person decides it either way), then no publisher, then
-- the reconciler's note that it waits on Kafka, then overdue. A quarantined
-- message needs an operator either way: unchanged.
--
-- Overdue. A key held by an uncertain message still undecided 5 minutes
-- past its write deadline said "wait for reconciliation"; its next action
-- is now the status view's for overdue messages (check that publishers
-- reconcile and reach Kafka).
--
-- The view keeps its columns, so CREATE OR REPLACE keeps its grants and the
-- status view that counts it. It reads the same rows of outbox.messages as
-- before, through messages_open_keys. Replacing a view takes it ACCESS
-- EXCLUSIVE and so waits for the reads of it in progress (outbox migrate
-- waits at most --lock-timeout for them); no write waits.

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
               THEN 'do what the reason says: reconciliation decides it once Kafka lets its producer session be fenced (outbox-publisher reconcile tries now)'
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
