-- 0012: claims read only their own lanes.
--
-- A claim takes the oldest claimable messages of the lanes its publisher owns.
-- Until now it walked every pending message in seq order (messages_claimable,
-- on seq) and skipped those of other publishers' lanes one by one, so a
-- backlog in one publisher's lanes was read again by every claim of every
-- other publisher: an empty claim next to 1,000,000 pending messages of
-- another lane took 1.5 s (benchmarks/claim_scale.py, docs/performance.md),
-- and it runs at every wake-up and poll.
--
-- The pending messages are now indexed by lane, then seq. The claim reads
-- each of its lanes through this index in seq order and merges them (one
-- ordered branch per lane, a Merge Append; see claim_batch in
-- outbox/queries.sql), so it reads about as many entries as it claims, plus
-- one per lane, whatever waits in other lanes. One index replaces the other:
-- an enqueue writes as many index entries as before. Reads that want every
-- pending message (the status view, the metrics, seconds_until_due) read
-- this index as they read the old one.
--
-- Building the index reads the whole table while enqueues wait (CREATE INDEX
-- holds a SHARE lock; a migration runs in a transaction, where CONCURRENTLY
-- cannot). On a large live table, build it first, without blocking writes,
-- then migrate (docs/operations.md, "Upgrading"):
--
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS messages_claimable_by_lane
--       ON outbox.messages (lane, seq) WHERE state = 'pending';
--
-- The migration then finds it and only drops the old index.

CREATE INDEX IF NOT EXISTS messages_claimable_by_lane
    ON outbox.messages (lane, seq) WHERE state = 'pending';

-- An index built beforehand with CREATE INDEX CONCURRENTLY that failed is
-- left INVALID under its name, and IF NOT EXISTS would take it: the old
-- index would then be dropped and every claim read the table (7 s a claim
-- at 200,000 rows). Refused instead, naming what to do.
DO $$
DECLARE
    broken text;
BEGIN
    SELECT string_agg(c.relname, ', ') INTO broken
    FROM pg_index AS i
    JOIN pg_class AS c ON c.oid = i.indexrelid
    WHERE i.indrelid = 'outbox.messages'::regclass
      AND c.relname IN ('messages_claimable_by_lane')
      AND NOT (i.indisvalid AND i.indisready);
    IF broken IS NOT NULL THEN
        RAISE EXCEPTION 'index % of outbox.messages is INVALID (a CREATE INDEX CONCURRENTLY that failed)', broken
            USING HINT = 'DROP INDEX CONCURRENTLY it, then build it again as docs/operations.md ("Upgrading a live database") says, or let this migration build it';
    END IF;
END $$;

DROP INDEX outbox.messages_claimable;
