-- 0006: transactional delivery (outbox-publisher --delivery transactional).
--
-- In that mode a publisher sends each batch inside a Kafka transaction, under
-- a transactional.id of its producer session ("outbox-<publisher id>-<n>": a
-- new one for every producer it opens). The batch records the id it was sent
-- under: before the reconciler decides one of its messages, it fences that
-- id (init_transactions: the session's open transaction is aborted, or its
-- commit completed, and the session can write nothing more), and only then
-- reads the log, read_committed. The publisher row shows the session in use.

ALTER TABLE outbox.publishers ADD COLUMN transactional_id text;
ALTER TABLE outbox.batches ADD COLUMN transactional_id text;

