-- 0003: per-key order and holds.
--
-- A message's key identity is (topic, key). Enqueues of one key serialise on
-- a transaction-scoped advisory lock on its hash (see insert_messages), so one
-- key's messages get their seq in commit order. The claim takes a keyed
-- message only when no earlier message of its key is still open and not
-- claimable now, so one stuck message holds back its own key and nothing else.

-- Which lane a message belongs to: keys (or, for unkeyed messages, ids)
-- hashed into a fixed number of lanes, the unit of work publishers own.
ALTER TABLE outbox.messages
    ADD COLUMN key_hash bigint GENERATED ALWAYS AS (
        CASE WHEN key IS NULL THEN NULL
             ELSE hashtextextended(topic || E'\n' || encode(key, 'hex'), 0) END
    ) STORED;

-- Attempts that ended "not written" since the last operator decision; past
-- the publisher's maximum the message is quarantined. (attempts keeps
-- counting every attempt ever made and numbers the attempt records.)
ALTER TABLE outbox.messages ADD COLUMN failures integer NOT NULL DEFAULT 0;
-- Set when the last attempt was refused together with other records of its
-- partition: the next attempt sends it alone, so a refusal is its own.
ALTER TABLE outbox.messages ADD COLUMN send_alone boolean NOT NULL DEFAULT false;

-- Open messages of a key, for the held_keys view and work_left; delivered and
-- discarded rows are not in it.
CREATE INDEX messages_open_keys ON outbox.messages (key_hash, seq)
    WHERE key IS NOT NULL AND state IN ('pending', 'in_flight', 'uncertain', 'quarantined');
-- The messages that can hold a key back: in flight, uncertain, quarantined,
-- or pending after a failure (only those can be waiting out a retry). The
-- claim's hold check probes this small index once per candidate, instead of
-- walking every earlier pending message of a busy key.
CREATE INDEX messages_key_blockers ON outbox.messages (key_hash, seq)
    WHERE key IS NOT NULL
      AND (state IN ('in_flight', 'uncertain', 'quarantined')
           OR (state = 'pending' AND failures > 0));

-- Keys whose oldest open message cannot move on by itself, and what waits
-- behind it: the hold is visible, with the message that holds it and why.
CREATE VIEW outbox.held_keys AS
WITH open AS (
    SELECT m.topic, m.key, m.id, m.seq, m.state, m.available_at, m.lease_expires_at,
           m.escalated_at, m.last_error, m.attempts,
           row_number() OVER w AS position,
           count(*) OVER (PARTITION BY m.key_hash, m.topic, m.key) AS open_messages
    FROM outbox.messages AS m
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
