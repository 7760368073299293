-- 0016: an attempt that recovery ended is 'recovered', told apart from one
-- the publisher gave back unsent.
--
-- Recovery marks a message suspect (send_alone: claimed alone from then on)
-- when its batch is recovered for the second time in a row, which it read
-- from the previous attempt's outcome. Both recovery and the publisher
-- itself wrote 'abandoned': the publisher for a message it gave back unsent
-- (stopping, held back behind its key, the hand-over window closed, its
-- Kafka transaction aborted for another record). So a rolling restart
-- followed by one crash made every message of the crashed batches suspect,
-- and the backlog went out one message per batch: a healthy message was
-- "recovered twice in a row" after one recovery.
--
-- Now recovery writes 'recovered', and only a previous 'recovered' attempt
-- makes a message suspect. Attempts written before keep 'abandoned', and so
-- do the recoveries of publishers of an earlier version still running after
-- the migration, until they are replaced: none of those counts toward the
-- two (a message recovered once by each kind is not suspect yet), and such a
-- publisher still counts a message given back unsent as recovered.
--
-- Replacing the CHECK constraint locks outbox.attempts (ACCESS EXCLUSIVE)
-- for a moment. The new one is added NOT VALID, so the rows there are not
-- read while that lock is held (attempts are kept for the evidence window:
-- reading millions of rows under it would stop every settle); each satisfies
-- the old check, which the new one only widens, and every row written from
-- now on is checked. 0017 then validates it under a lock that writes do not
-- wait for.
ALTER TABLE outbox.attempts DROP CONSTRAINT attempts_outcome_known;
ALTER TABLE outbox.attempts ADD CONSTRAINT attempts_outcome_known CHECK (
    outcome IS NULL
    OR outcome IN ('delivered', 'failed', 'uncertain', 'abandoned', 'recovered'))
    NOT VALID;
