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
-- makes a message suspect. Attempts written before keep 'abandoned' (a
-- recovery among them no longer counts toward the two: a message recovered
-- once before the upgrade and once after is not suspect yet).
--
-- Replacing the CHECK constraint locks outbox.attempts (ACCESS EXCLUSIVE)
-- for a moment; the new one is checked against the rows there (every one
-- satisfies it: it only adds a value), a read of the table with the lock
-- held.
ALTER TABLE outbox.attempts DROP CONSTRAINT attempts_outcome_known;
ALTER TABLE outbox.attempts ADD CONSTRAINT attempts_outcome_known CHECK (
    outcome IS NULL
    OR outcome IN ('delivered', 'failed', 'uncertain', 'abandoned', 'recovered'));
