-- 0010: storage settings for a queue table: vacuum and analyze follow the
-- churn, and small hot tables update in place.
--
-- Every message is written three times (inserted, settled, deleted by
-- retention), so outbox.messages makes about two dead row versions per
-- message, at the rate messages are enqueued: 2,000 msg/s leaves some 4,000
-- dead rows a second. With PostgreSQL's defaults autovacuum waits until 20%
-- of the table is dead (120,000 rows at a five-minute retention of 2,000
-- msg/s) and then works throttled, while the dead index entries of the
-- partial indexes (messages_claimable above all) are what every claim walks
-- past; and ANALYZE waits for 10% of the table to change, so the planner's
-- idea of how many messages are pending lags behind a backlog by minutes
-- (the statements that matter no longer depend on it: see settle_batch in
-- outbox/queries.sql, but the claim's own plan and the status estimate do).
-- The soak (benchmarks/soak.py, docs/performance.md) measured dead rows of up
-- to 108,000 beside 600,000 live ones with the defaults.
--
-- * outbox.messages: vacuum at 5% dead (plus 1,000 rows), analyze at 2%
--   changed (plus 1,000), vacuum after 5% new rows too (so that the pages
--   retention will delete from are marked all-visible early and the next
--   vacuum skips them), and a cost limit five times the default so that one
--   pass keeps up with the churn. No fillfactor: a settle can never be a HOT
--   update (state is in the partial indexes' predicates, batch_id in one of
--   them), so space kept free on each page would only make the table
--   larger.
-- * outbox.batches: the same vacuum and analyze bounds. A batch row is
--   written four to five times (claimed, marked sending, renewed by the
--   heartbeat, settled); marking it writes no indexed column, so with room
--   on its page (fillfactor 80) that update is HOT and leaves no index
--   entry behind.
-- * outbox.partition_offsets, outbox.lanes, outbox.publishers: a handful of
--   rows, each updated every settle or heartbeat, never in an indexed
--   column. With half of each page free (fillfactor 50) every update is HOT
--   and the page prunes itself; the tables stay a page or two.
--
-- ALTER TABLE ... SET of these parameters takes a SHARE UPDATE EXCLUSIVE
-- lock, which no enqueue, claim or settle conflicts with (only VACUUM and
-- other DDL do), and rewrites nothing: a new fillfactor applies to pages as
-- they fill from now on.

ALTER TABLE outbox.messages SET (
    autovacuum_vacuum_scale_factor = 0.05,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_vacuum_insert_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_analyze_threshold = 1000,
    autovacuum_vacuum_cost_limit = 1000
);

ALTER TABLE outbox.batches SET (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.05,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_analyze_threshold = 1000
);

ALTER TABLE outbox.partition_offsets SET (fillfactor = 50);
ALTER TABLE outbox.lanes SET (fillfactor = 50);
ALTER TABLE outbox.publishers SET (fillfactor = 50);
