-- 0013: messages held behind a key's stuck message leave the claim's way.
--
-- A keyed message waits while an earlier message of its key is uncertain or
-- quarantined, and a claim used to read every such waiting message again:
-- pending, in its publisher's lanes, older than what it can take. A busy key
-- quarantined for an hour, or uncertain through a long outage, put hundreds
-- of thousands of them in front of every claim of that publisher (a claim of
-- 500 free messages took 100 ms next to 100,000 held ones and 800 ms next to
-- a million: benchmarks/claim_scale.py, docs/performance.md).
--
-- Such a message is now marked held: a pass of the publisher (every
-- --recovery-interval, beside its loop) marks the pending messages behind an
-- uncertain or quarantined message of their key, and whatever moves that
-- message on (the reconciler's decision, an operator's) releases them; the
-- pass also releases any whose key has nothing uncertain or quarantined left
-- before them. The claim reads
-- only the messages that are not held (held is the second column of the
-- index of pending messages, after the lane), so held ones cost it nothing,
-- and it counts a held message as holding its key back, so that a message
-- marked or released late is never sent before an earlier one of its key.
--
-- * held: the new column, false for every message that exists. Adding a
--   column with a constant default rewrites nothing; it takes an ACCESS
--   EXCLUSIVE lock on outbox.messages (outbox migrate waits at most
--   --lock-timeout for it and tries again), held to the migration's end:
--   while the indexes below are built, every statement on the table waits.
-- * messages_pending_by_lane replaces messages_claimable_by_lane: the same
--   pending messages, by lane, then held, then seq. A claim reads one lane's
--   messages that are not held in seq order, as before; reads that want every
--   pending message read it as they read the old one. An index entry is as
--   wide as before (the boolean fits in the lane's padding), and an enqueue
--   writes as many entries as before.
-- * messages_holding_keys replaces messages_key_blockers: the messages that
--   can hold a key back (in flight, uncertain, quarantined, pending after a
--   failure) and now the held ones, by key. The claim's test of a message
--   probes it as before; the pass finds the held messages of a key, and the
--   last one held, through it. It holds no message that is simply pending.
--
-- Each index build reads the whole table while every statement on it waits
-- (behind the column's lock; a migration runs in a transaction, where
-- CONCURRENTLY cannot). On a large live table, add the column and build both first,
-- without blocking writes, then migrate (docs/operations.md, "Upgrading"):
--
--   ALTER TABLE outbox.messages ADD COLUMN IF NOT EXISTS held boolean NOT NULL DEFAULT false;
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS messages_pending_by_lane
--       ON outbox.messages (lane, held, seq) WHERE state = 'pending';
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS messages_holding_keys
--       ON outbox.messages (key_hash, seq)
--       WHERE key IS NOT NULL
--         AND (state IN ('in_flight', 'uncertain', 'quarantined')
--              OR (state = 'pending' AND (failures > 0 OR held)));
--
-- The migration then finds them and only drops the old indexes.

ALTER TABLE outbox.messages ADD COLUMN IF NOT EXISTS held boolean NOT NULL DEFAULT false;

CREATE INDEX IF NOT EXISTS messages_pending_by_lane
    ON outbox.messages (lane, held, seq) WHERE state = 'pending';

CREATE INDEX IF NOT EXISTS messages_holding_keys
    ON outbox.messages (key_hash, seq)
    WHERE key IS NOT NULL
      AND (state IN ('in_flight', 'uncertain', 'quarantined')
           OR (state = 'pending' AND (failures > 0 OR held)));

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
      AND c.relname IN ('messages_pending_by_lane', 'messages_holding_keys')
      AND NOT (i.indisvalid AND i.indisready);
    IF broken IS NOT NULL THEN
        RAISE EXCEPTION 'index % of outbox.messages is INVALID (a CREATE INDEX CONCURRENTLY that failed)', broken
            USING HINT = 'DROP INDEX CONCURRENTLY it, then build it again as docs/operations.md ("Upgrading a live database") says, or let this migration build it';
    END IF;
END $$;

DROP INDEX outbox.messages_claimable_by_lane;
DROP INDEX outbox.messages_key_blockers;
