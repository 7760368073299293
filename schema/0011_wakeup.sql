-- 0011: commits notify only while a publisher sleeps.
--
-- Until now every enqueuing transaction sent NOTIFY outbox_pending. PostgreSQL
-- serialises the commits of transactions that notified: at pre-commit each
-- takes one cluster-wide lock (PreCommit_Notify in async.c) and holds it until
-- its commit record is flushed, so their WAL flushes cannot be shared (group
-- commit). With many writers that capped enqueuing transactions at one flush
-- each, in turn, however many writers ran (docs/performance.md, "Writer
-- scaling"). A notification only matters to a publisher that is asleep: a
-- busy one claims again as soon as its batch is done.
--
-- So a publisher announces its sleep by holding outbox.wakeup in SHARE mode
-- (in a transaction of its own, until it has work again), and an enqueuing
-- transaction, once, as it commits, tries to take outbox.wakeup in ROW
-- EXCLUSIVE mode without waiting: the two conflict, and writers do not
-- conflict with one another, nor sleepers. If a publisher sleeps (or is
-- about to), the try fails and the transaction notifies as before. If not,
-- the writer holds its lock until its commit is visible: a publisher
-- announcing its sleep meanwhile waits for that, then claims once more
-- before it sleeps, and finds that writer's messages. Nothing committed goes
-- unnoticed, and a busy system sends no notification at all. A lock, not a
-- row: it is neither written nor read under a snapshot, so it works for
-- writers at every isolation level.
--
-- The trigger becomes a deferred constraint trigger so that the try comes at
-- commit (a constraint trigger fires per row; the first row decides for the
-- transaction), not when the row is inserted: a publisher announcing its
-- sleep then waits only for commits in progress, never for a writer's
-- transaction that goes on after its enqueue. A writer whose role lacks the
-- grant on outbox.wakeup (roles not renewed after this migration) notifies
-- on every commit, as before. A publisher of an older version never
-- announces its sleep: deploy this version's publishers before applying this
-- migration, or they wake only every --poll-interval until replaced.
--
-- Dropping and creating the trigger locks outbox.messages (ACCESS EXCLUSIVE)
-- for a moment; nothing is read or rewritten.

-- Holds nothing (and nothing can be inserted into it): only its lock is used.
CREATE VIEW outbox.wakeup AS SELECT WHERE false;

-- Fired per row at commit; the first row decides for the transaction (the
-- setting lasts until the transaction ends, and is undone with a rolled back
-- savepoint, as the lock is).
CREATE OR REPLACE FUNCTION outbox.notify_pending() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox.wakeup_decided', true) = 'on' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('outbox.wakeup_decided', 'on', true);
    BEGIN
        LOCK TABLE outbox.wakeup IN ROW EXCLUSIVE MODE NOWAIT;
    EXCEPTION WHEN lock_not_available OR insufficient_privilege THEN
        PERFORM pg_notify('outbox_pending', '');
    END;
    RETURN NULL;
END;
$$;

DROP TRIGGER messages_notify_pending ON outbox.messages;
CREATE CONSTRAINT TRIGGER messages_notify_pending
AFTER INSERT ON outbox.messages
DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW EXECUTE FUNCTION outbox.notify_pending();
