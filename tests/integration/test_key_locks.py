"""The enqueue's key locks stay within PostgreSQL's lock table, however many keys a
transaction enqueues (take_key_locks in outbox/queries.sql).

Each key's lock lives in the server's shared lock table until the transaction
ends. Locked one by one without a bound, a backfill of tens of thousands of
keys in one transaction filled that table and failed ("out of shared
memory"), and while it held thousands of locks, other transactions' enqueues
failed too. Past max_locks_per_transaction keys a transaction now takes one
lock on all keys instead.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

import outbox
from tests.support import submit_until_waiting

pytestmark = pytest.mark.integration

TOPIC = "key-locks"


def _keyed(prefix: str, n: int) -> list[outbox.Message]:
    return [outbox.Message(TOPIC, b"v", key=f"{prefix}-{i}") for i in range(n)]


def _advisory_locks(conn: psycopg.Connection) -> int:
    """How many advisory locks this connection's backend holds now."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def _values_of(conn: psycopg.Connection, key: str) -> list[tuple[bytes]]:
    """The values of ``key``'s messages, in seq order."""
    return conn.execute(
        "SELECT value FROM outbox.messages WHERE key = %s::bytea ORDER BY seq", (key,)
    ).fetchall()


def _setting(conn: psycopg.Connection, name: str) -> int:
    row = conn.execute("SELECT current_setting(%s)::integer", (name,)).fetchone()
    assert row is not None
    return int(row[0])


def test_a_transaction_of_many_enqueues_holds_a_bounded_number_of_locks(
    database_url: str,
) -> None:
    """A hundred calls of 50 new keys each in one transaction hold at most the budget,
    plus the lock on all keys, however many keys they write."""
    with psycopg.connect(database_url) as conn:
        budget = _setting(conn, "max_locks_per_transaction")
        for call in range(100):
            outbox.enqueue_many(conn, _keyed(f"call{call}", 50))
        held = _advisory_locks(conn)
        conn.commit()
        assert held <= budget + 2, f"{held} advisory locks held for 5,000 keys"
        row = conn.execute("SELECT count(DISTINCT key) FROM outbox.messages").fetchone()
    assert row == (5_000,)


def test_a_key_enqueued_again_is_not_locked_or_counted_again(database_url: str) -> None:
    """A hundred enqueues of one key hold one key lock, and no lock on all keys: another
    transaction enqueues another key meanwhile."""
    with psycopg.connect(database_url) as conn, psycopg.connect(database_url) as other:
        for i in range(100):
            outbox.enqueue(conn, TOPIC, f"event {i}", key="one aggregate")
        locks = conn.execute(
            "SELECT mode, objsubid FROM pg_locks"
            " WHERE pid = pg_backend_pid() AND locktype = 'advisory' ORDER BY objsubid"
        ).fetchall()
        other.execute("SET lock_timeout = '5s'")
        outbox.enqueue(other, TOPIC, b"meanwhile", key="another key")
        other.commit()
        conn.commit()
    # The key's lock (one bigint: objsubid 1) and the lock on all keys, shared.
    assert locks == [("ExclusiveLock", 1), ("ShareLock", 2)]


def test_a_transaction_of_more_keys_than_the_lock_table_holds_commits(database_url: str) -> None:
    """One enqueue_many of three times as many keys as the server's lock table is sized for
    (several statements, locked first by lock_keys) commits them all."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT current_setting('max_locks_per_transaction')::integer"
            " * (current_setting('max_connections')::integer"
            " + current_setting('max_prepared_transactions')::integer)"
        ).fetchone()
        assert row is not None
        keys = 3 * int(row[0])
        ids = outbox.enqueue_many(conn, _keyed("backfill", keys))
        assert _advisory_locks(conn) == 1  # the lock on all keys, nothing else
        conn.commit()
        count = conn.execute("SELECT count(*) FROM outbox.messages").fetchone()
    assert len(ids) == keys
    assert count == (keys,)


def test_past_its_budget_a_transaction_holds_back_every_keyed_enqueue_until_it_ends(
    database_url: str,
) -> None:
    """Another transaction's enqueue of any key waits for it; an unkeyed one does not."""
    name = f"other-{uuid.uuid4().hex[:8]}"
    bulk = psycopg.connect(database_url)
    other = psycopg.connect(database_url, application_name=name)
    try:
        budget = _setting(bulk, "max_locks_per_transaction")
        outbox.enqueue_many(bulk, _keyed("bulk", budget + 1))
        outbox.enqueue(other, TOPIC, b"unkeyed")  # takes no key lock: no wait
        with ThreadPoolExecutor(1) as pool:
            late = submit_until_waiting(
                pool,
                database_url,
                name,
                "the other transaction to wait for the one past its budget",
                outbox.enqueue,
                other,
                TOPIC,
                b"late",
                key="a key of its own",
            )
            bulk.commit()
            late.result(timeout=10)
        other.commit()
    finally:
        bulk.close()
        other.close()


def test_a_transaction_going_past_its_budget_waits_for_the_keys_held_by_others(
    database_url: str,
) -> None:
    """It takes the lock on all keys only once no other transaction holds a key lock, so a key
    it shares with an open transaction still gets its seq in commit order."""
    name = f"bulk-{uuid.uuid4().hex[:8]}"
    first = psycopg.connect(database_url)
    bulk = psycopg.connect(database_url, application_name=name)
    try:
        budget = _setting(bulk, "max_locks_per_transaction")
        outbox.enqueue(first, TOPIC, b"first", key="shared")
        messages = [outbox.Message(TOPIC, b"second", key="shared"), *_keyed("bulk", budget)]
        with ThreadPoolExecutor(1) as pool:
            late = submit_until_waiting(
                pool,
                database_url,
                name,
                "the transaction past its budget to wait for the open key lock",
                outbox.enqueue_many,
                bulk,
                messages,
            )
            first.commit()
            late.result(timeout=10)
        bulk.commit()
        values = _values_of(bulk, "shared")
    finally:
        first.close()
        bulk.close()
    assert values == [(b"first",), (b"second",)]


def test_a_transaction_going_past_its_budget_is_not_deadlocked_by_one_waiting_for_its_key(
    database_url: str,
) -> None:
    """A transaction that waits for a key holds no lock on all keys yet, so one that holds
    that key and then passes its budget takes the lock on all keys without a deadlock."""
    name = f"waiting-{uuid.uuid4().hex[:8]}"
    first = psycopg.connect(database_url)
    waiting = psycopg.connect(database_url, application_name=name)
    try:
        budget = _setting(first, "max_locks_per_transaction")
        outbox.enqueue(first, TOPIC, b"first", key="shared")
        with ThreadPoolExecutor(1) as pool:
            late = submit_until_waiting(
                pool,
                database_url,
                name,
                "the second transaction to wait for the key",
                outbox.enqueue,
                waiting,
                TOPIC,
                b"second",
                key="shared",
            )
            # Passes the budget: waits for every holder of the lock on all keys shared.
            outbox.enqueue_many(first, _keyed("past-the-budget", budget))
            first.commit()
            late.result(timeout=10)
        waiting.commit()
        values = _values_of(waiting, "shared")
    finally:
        first.close()
        waiting.close()
    assert values == [(b"first",), (b"second",)]
