-- 0019: 'in_flight' is derived, never stored.
--
-- Since 0007 a message is in flight while an open batch names it
-- (outbox.in_flight, outbox.message_status), and its own row says
-- 'pending'. A row whose own state is 'in_flight' (set by hand since) is
-- named by no batch: recovery, which reads batches, never moves it, no
-- operator command may, and it holds its key back for good. Such rows
-- become uncertain here, as 0007 made its legacy ones: whether one was
-- sent is unknown, so the reconciler decides it from its partition. No
-- batch recorded what was confirmed before its attempt, so the partition is
-- read from its start (its batch_id is cleared: an earlier batch's evidence
-- is not this attempt's). The attempt is counted, with the fence, as
-- recovery counts one.
--
-- Then a check refuses the value from now on, naming the constraint to
-- whoever tries. It is added NOT VALID, so the table is not read under the
-- ACCESS EXCLUSIVE lock that adding it takes (for a moment): every row
-- passes it after the update above, and every row written from now on is
-- checked. 0020 validates it under a lock that writes do not wait for.
WITH legacy AS (
    UPDATE outbox.messages
    SET state = 'uncertain',
        fence = fence + 1,
        attempts = attempts + 1,
        batch_id = NULL,
        kafka_partition = NULL,
        kafka_offset = NULL,
        available_at = now(),
        held = false,
        last_error = 'legacy: its row said in_flight, and no batch named it (set by hand); '
                     'whether it was sent is unknown',
        updated_at = now()
    WHERE state = 'in_flight'
    RETURNING id, attempts, fence, last_error
)
INSERT INTO outbox.attempts
    (message_id, attempt, publisher_id, fence, started_at, send_began, finished_at, outcome, error)
SELECT id, attempts, '00000000-0000-0000-0000-000000000000', fence, now(), true, now(),
       'recovered', last_error
FROM legacy
ON CONFLICT (message_id, attempt) DO NOTHING;

ALTER TABLE outbox.messages
    ADD CONSTRAINT messages_in_flight_derived CHECK (state <> 'in_flight') NOT VALID;
