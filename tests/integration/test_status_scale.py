"""``outbox.status`` at scale: the open states exact and read through their indexes.

Since migration 0009 the status view reads the open messages through their
partial indexes and, on a large table, estimates the delivered ones. The
reference here is the view as 0008 defined it, which counts every row: on
small tables the two agree line by line through every transition a message
goes through; with the estimate forced (``outbox.status_exact_mb = 0``, what
a large table gets) every line but the delivered ones still agrees; and
neither the status nor ``outbox.held_keys`` reads a delivered row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

import outbox
import outbox.ids
from outbox.operator import Resolution, discard, resolve
from outbox.retention import purge
from outbox.states import OPEN_STATES, State
from outbox.status import read_open_status
from publisher.outcomes import AttemptOutcome
from publisher.store import Decision, Settlement
from tests.support import ClaimingStore, claiming_store, wait_until

pytestmark = pytest.mark.integration

SCHEMA = Path(__file__).resolve().parents[2] / "schema"
#: Every column of the view but ``exact``, which 0008's did not have.
COLUMNS = (
    "topic, state, messages, oldest_created_at, oldest_age_seconds, waiting_retry, retrying, "
    "attempts, max_failures, lease_owners, next_lease_expiry, leases_expired, escalated, "
    "overdue, held_keys, live_publishers, healthy, next_action"
)
DAY_NS = 86_400 * 10**9


def _reference_views(conn: psycopg.Connection[Any]) -> None:
    """0008's outbox.held_keys and outbox.status, as pg_temp views of this session."""
    text = (SCHEMA / "0008_current_commands.sql").read_text()
    held = text[
        text.index("CREATE OR REPLACE VIEW outbox.held_keys AS") : text.index(
            "-- outbox.status as in 0007"
        )
    ]
    status = text[text.index("CREATE OR REPLACE VIEW outbox.status AS") :]
    # The escalated line's words since 0023 (every count and flag as 0008's).
    escalated = status[status.index("'%s escalated: ") : status.index("l.escalated)")]
    latest = (SCHEMA / "0023_escalated_reasons.sql").read_text()
    status = status.replace(
        escalated, latest[latest.index("'%s escalated: ") : latest.index("l.escalated)")]
    )
    conn.execute(held.replace("VIEW outbox.held_keys", "VIEW pg_temp.held_keys_0008"))
    conn.execute(
        status.replace("VIEW outbox.status", "VIEW pg_temp.status_0008").replace(
            "FROM outbox.held_keys", "FROM pg_temp.held_keys_0008"
        )
    )


def _lines(conn: psycopg.Connection[Any], view: str) -> dict[tuple[str | None, str], Any]:
    rows = conn.execute(f"SELECT {COLUMNS} FROM {view}").fetchall()
    return {(row[0], row[1]): row for row in rows}


def _agree(url: str) -> list[tuple[Any, ...]]:
    """Assert the status agrees with 0008's full count, counted and estimated; return it.

    Counted (a small table): every line, every column, and every line exact.
    Estimated (forced, after ANALYZE): every line but the delivered ones, which
    are estimated (attempts unknown). Each read in one transaction with the
    reference, so that now() is the same for both. The held keys: which, by
    what and how many wait; their reasons and next actions are worded
    differently since (0014, 0018: test_ordering and test_reconcile check them), and so
    is the status view's escalated line (0023), whose words the reference takes.
    """
    held = "SELECT topic, key, held_by, state, waiting FROM {} ORDER BY topic, key, held_by"
    with psycopg.connect(url) as conn:
        _reference_views(conn)
        conn.commit()
        reference = _lines(conn, "pg_temp.status_0008")
        assert _lines(conn, "outbox.status") == reference
        # The metrics' read: the open states per topic, and the stuck among them
        # (leases expired, escalated, overdue), as the status counts them.
        assert {
            (c.topic, c.state): (c.messages, c.leases_expired, c.escalated, c.overdue)
            for c in read_open_status(conn)
        } == {
            (topic, state): (line[2], line[11], line[12], line[13])
            for (topic, state), line in reference.items()
            if topic is not None and state in {s.value for s in OPEN_STATES} and line[2] > 0
        }
        exact = conn.execute("SELECT bool_and(exact) FROM outbox.status").fetchone()
        assert exact == (True,)
        assert conn.execute(held.format("outbox.held_keys")).fetchall() == (
            conn.execute(held.format("pg_temp.held_keys_0008")).fetchall()
        )
        conn.commit()
        conn.execute("ANALYZE outbox.messages")
        conn.commit()
        conn.execute("SET LOCAL outbox.status_exact_mb = 0")
        again = _lines(conn, "pg_temp.status_0008")
        estimated = _lines(conn, "outbox.status")
        assert {k: v for k, v in estimated.items() if k[1] != "delivered"} == {
            k: v for k, v in again.items() if k[1] != "delivered"
        }
        for (topic, _), line in ((k, v) for k, v in estimated.items() if k[1] == "delivered"):
            assert line[7] is None  # attempts: unknown on an estimated line
            if topic is not None:
                assert line[3] is None  # no oldest per topic
        flags = conn.execute(
            "SELECT state = 'delivered', bool_and(NOT exact) FROM outbox.status GROUP BY 1"
        ).fetchall()
        assert dict(flags) == {True: True, False: False}
        return list(reference.values())


def _enqueue(url: str, topic: str, *keys: str | None) -> list[uuid.UUID]:
    with psycopg.connect(url) as conn:
        return outbox.enqueue_many(conn, [outbox.Message(topic, b"v", key=k) for k in keys])


def _settlement(message_id: uuid.UUID, fence: int, state: State, **kw: Any) -> Settlement:
    outcome = {
        State.DELIVERED: AttemptOutcome.DELIVERED,
        State.UNCERTAIN: AttemptOutcome.UNCERTAIN,
    }.get(state, AttemptOutcome.FAILED)
    return Settlement(message_id, fence, state, outcome, **kw)


def _line(lines: list[tuple[Any, ...]], state: str, topic: str | None = None) -> tuple[Any, ...]:
    return next(line for line in lines if line[0] == topic and line[1] == state)


def _backdate_and_deliver(
    url: str, monkeypatch: pytest.MonkeyPatch, store: ClaimingStore, count: int
) -> list[uuid.UUID]:
    """``count`` messages enqueued and delivered ten days ago (ids are UUIDv7), and every
    message claimable before them delivered now."""
    then = time.time_ns() - 10 * DAY_NS
    with monkeypatch.context() as m:
        m.setattr(outbox.ids, "time", SimpleNamespace(time_ns=lambda: then))
        m.setattr(outbox.ids, "_last_ms", 0)
        ids = _enqueue(url, "old", *(None for _ in range(count)))
    waiting = set(ids)
    while waiting:
        batch = store.claim(100, lease_seconds=60)
        assert batch is not None
        n = len(batch.messages)
        assert len(store.settle_delivered(batch, [0] * n, list(range(n)))) == n
        waiting -= {m.id for m in batch.messages}
    with psycopg.connect(url) as conn:
        conn.execute(
            "UPDATE outbox.messages SET delivered_at = now() - interval '10 days', "
            "created_at = now() - interval '10 days' WHERE id = ANY(%s)",
            (ids,),
        )
    return ids


def test_status_agrees_with_a_full_count_through_every_transition(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Enqueue, claim, deliver, retry, uncertain, quarantine, expired lease, recovery,
    escalation, discard, resolve and purge: after each, every line (counts, ages, retries,
    leases, escalated, overdue, held keys, health, next action) is what a full count says."""
    url = database_url
    _enqueue(url, "orders", "a", "a", "b", "b", "c", None, None)
    _enqueue(url, "payments", "p", "p", None)
    lines = _agree(url)
    assert _line(lines, "pending")[2] == 10
    assert _line(lines, "pending")[16] is False  # no publisher running

    store = claiming_store(url)
    try:
        batch = store.claim(6, lease_seconds=60)
        assert batch is not None
        lines = _agree(url)
        assert _line(lines, "in_flight")[2] == 6
        assert _line(lines, "in_flight")[9] == [store.publisher_id]
        assert _line(lines, "pending")[16] is True  # a publisher runs

        first, second, third, fourth, fifth, sixth = batch.messages
        settled = store.settle(
            batch,
            [
                _settlement(first.id, first.fence, State.DELIVERED, partition=0, offset=1),
                _settlement(second.id, second.fence, State.DELIVERED, partition=0, offset=2),
                _settlement(third.id, third.fence, State.UNCERTAIN, error="no answer"),
                _settlement(
                    fourth.id, fourth.fence, State.QUARANTINED, error="MessageSizeTooLarge"
                ),
                _settlement(
                    fifth.id,
                    fifth.fence,
                    State.PENDING,
                    retry_after=3600,
                    error="broker away",
                    counts_as_failure=True,
                ),
                _settlement(sixth.id, sixth.fence, State.DELIVERED, partition=1, offset=1),
            ],
        )
        assert len(settled) == 6
        lines = _agree(url)
        assert (_line(lines, "pending")[5], _line(lines, "pending")[6]) == (1, 1)  # waiting
        assert _line(lines, "quarantined")[16] is False
        assert sum(line[14] for line in lines if line[0] is None) > 0  # keys held

        # A claim whose publisher died: its lease runs out.
        dying = store.claim(10, lease_seconds=60)
        assert dying is not None
        with psycopg.connect(url) as conn:
            conn.execute(
                "UPDATE outbox.batches SET lease_expires_at = now() - interval '1 second' "
                "WHERE id = %s",
                (dying.id,),
            )
        lines = _agree(url)
        assert _line(lines, "in_flight")[11] == len(dying.messages)
        assert _line(lines, "in_flight")[16] is False

        assert store.recover_expired_leases()
        lines = _agree(url)
        assert _line(lines, "in_flight")[2] == 0

        # Decidable for ten minutes, and still undecided: overdue.
        with psycopg.connect(url) as conn:
            conn.execute(
                "UPDATE outbox.messages SET available_at = now() - interval '10 minutes' "
                "WHERE id = %s",
                (third.id,),
            )
        lines = _agree(url)
        assert _line(lines, "uncertain")[13] == 1

        # The reconciler gives up on the uncertain one: escalated.
        escalated = store.decide(
            [Decision(third.id, third.fence, State.UNCERTAIN, "topic deleted")], "reconciler"
        )
        assert escalated == {third.id}
        lines = _agree(url)
        assert _line(lines, "uncertain")[12] == 1

        with psycopg.connect(url) as conn:
            discard(conn, fourth.id, "too large for good", fence=fourth.fence)
            conn.commit()
            fence = conn.execute(
                "SELECT fence FROM outbox.messages WHERE id = %s", (third.id,)
            ).fetchone()
            assert fence is not None
            resolve(conn, third.id, Resolution.DELIVERED, "found it", fence=fence[0])
            conn.commit()
        lines = _agree(url)
        assert _line(lines, "discarded")[2] == 1
        assert _line(lines, "uncertain")[2] == 0

        old = _backdate_and_deliver(url, monkeypatch, store, 4)
        lines = _agree(url)
        delivered = _line(lines, "delivered")[2]
        with psycopg.connect(url) as conn:
            report = purge(conn, delivered_older_than=timedelta(days=1))
        assert report.messages == len(old)
        lines = _agree(url)
        assert _line(lines, "delivered")[2] == delivered - len(old)
    finally:
        store.close()
    lines = _agree(url)
    assert lines[0][15] == 0  # no publisher running any more


FILL = """
INSERT INTO outbox.messages
    (id, topic, key, value, state, created_at, fence, attempts, kafka_partition,
     kafka_offset, delivered_at)
SELECT (lpad(to_hex(ms), 12, '0') || '70008' || lpad(to_hex(i), 15, '0'))::uuid,
       CASE WHEN i %% 4 = 0 THEN 'payments' ELSE 'orders' END,
       CASE WHEN i %% 10 <> 0 THEN convert_to('customer-' || (i %% 100), 'UTF8') END,
       convert_to(repeat('x', 100), 'UTF8'), 'delivered', to_timestamp(ms / 1000.0), 1, 1,
       0, i, to_timestamp(ms / 1000.0)
FROM (SELECT i, round(extract(epoch FROM now() - interval '2 days') * 1000)::bigint + i AS ms
      FROM generate_series(1, %(rows)s) AS i) AS history
"""


def _history(url: str, rows: int) -> None:
    """``rows`` delivered messages (3 in 4 'orders'), enqueued two days ago, one ms apart."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(FILL, {"rows": rows})


def _open_scene(url: str) -> int:
    """Open messages of every kind and a discarded one; how many rows that is."""
    ids = _enqueue(url, "orders", "customer-1", "customer-1", "k", None)
    _enqueue(url, "payments", "customer-2", "customer-2")
    store = claiming_store(url)
    try:
        batch = store.claim(3, lease_seconds=60)
        assert batch is not None
        first, second, _ = batch.messages
        store.settle(
            batch,
            [
                _settlement(first.id, first.fence, State.QUARANTINED, error="too large"),
                _settlement(second.id, second.fence, State.UNCERTAIN, error="no answer"),
            ],
        )
        assert store.claim(1, lease_seconds=60) is not None  # one in flight
    finally:
        store.close()
    with psycopg.connect(url) as conn:
        discard(conn, ids[3], "not wanted")
    return 6


def _flush_and_analyze(url: str) -> None:
    """ANALYZE outbox.messages once every count of its rows reached the statistics.

    A backend reports the rows it inserted or deleted when it goes idle or
    exits; a report arriving after ANALYZE would count those rows twice. So
    the connections that wrote are gone first, and this one reports its own.
    """
    with psycopg.connect(url, autocommit=True) as conn:

        def alone() -> bool:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
            ).fetchone()
            return row == (0,)

        wait_until(alone, timeout=10, what="the other connections to close")
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("ANALYZE outbox.messages")


def _rows_read(conn: psycopg.Connection[Any], statement: str) -> tuple[int, int]:
    """Seq scans of outbox.messages and its rows read by ``statement``, in this transaction."""
    counters = (
        "SELECT seq_scan, coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) "
        "FROM pg_stat_xact_user_tables WHERE schemaname = 'outbox' AND relname = 'messages'"
    )
    before = conn.execute(counters).fetchone()
    conn.execute(statement).fetchall()
    after = conn.execute(counters).fetchone()
    assert before is not None
    assert after is not None
    return after[0] - before[0], after[1] - before[1]


def test_status_and_held_keys_read_the_open_messages_not_the_delivered_ones(
    database_url: str,
) -> None:
    """With 20,000 delivered messages and a few open ones, estimated as on a large table, the
    status view and held_keys make no sequential scan of outbox.messages and read about as
    many rows as are open (0008's status read every row)."""
    url = database_url
    _history(url, 20_000)
    open_rows = _open_scene(url)
    _flush_and_analyze(url)
    with psycopg.connect(url) as conn:
        conn.execute("SET LOCAL outbox.status_exact_mb = 0")
        scans, rows = _rows_read(conn, "SELECT * FROM outbox.status")
        assert scans == 0
        # Each open row is read for the counts and again for the held keys; the
        # in-flight one a third time (through its batch), the discarded one
        # through its decision, and the oldest delivered one by the primary key.
        assert rows <= 3 * open_rows + 2, rows
        assert _rows_read(conn, "SELECT * FROM outbox.held_keys")[0] == 0
        assert _rows_read(conn, "SELECT * FROM outbox.held_keys")[1] <= 2 * open_rows
        [(exact,)] = conn.execute(
            "SELECT exact FROM outbox.status WHERE topic IS NULL AND state = 'delivered'"
        ).fetchall()
        assert exact is False


def test_the_delivered_estimate_is_the_live_rows_less_the_exact_counts(
    database_url: str,
) -> None:
    """On a large table the delivered line is the live rows PostgreSQL counts, less every
    row counted exactly (per topic: the topic's share of them): right on an analysed table,
    marked not exact, attempts unknown; over all topics the oldest is still given."""
    url = database_url
    _history(url, 2_000)
    _open_scene(url)
    _flush_and_analyze(url)
    with psycopg.connect(url, row_factory=dict_row) as conn:
        conn.execute("SET LOCAL outbox.status_exact_mb = 0")
        shown = {
            line["topic"]: line
            for line in conn.execute("SELECT * FROM outbox.status WHERE state = 'delivered'")
        }
        real = {
            row["topic"]: row
            for row in conn.execute(
                "SELECT topic, count(*) AS messages, min(created_at) AS oldest "
                "FROM outbox.messages WHERE state = 'delivered' GROUP BY ROLLUP (topic)"
            )
        }
    assert {t: line["messages"] for t, line in shown.items()} == {
        None: 2_000,
        "orders": 1_500,
        "payments": 500,
    }
    assert {t: r["messages"] for t, r in real.items()} == {
        None: 2_000,
        "orders": 1_500,
        "payments": 500,
    }
    assert all(line["exact"] is False and line["attempts"] is None for line in shown.values())
    assert shown[None]["oldest_created_at"] == real[None]["oldest"]
    assert shown["orders"]["oldest_created_at"] is None


def test_a_small_or_never_analysed_table_is_counted_exactly(database_url: str) -> None:
    """Below outbox.status_exact_mb (20 MB) delivered messages are counted one by one; so
    they are, whatever the bound, on a table never analysed (nothing to estimate from)."""
    url = database_url
    _history(url, 40)  # under autovacuum's 50 changed rows: it leaves the table alone
    with psycopg.connect(url) as conn:
        conn.execute("SET LOCAL outbox.status_exact_mb = 0")
        line = conn.execute(
            "SELECT messages, exact, attempts FROM outbox.status "
            "WHERE topic IS NULL AND state = 'delivered'"
        ).fetchone()
    assert line == (40, True, 40)
    _flush_and_analyze(url)
    with psycopg.connect(url) as conn:
        counted = conn.execute(
            "SELECT exact FROM outbox.status WHERE topic IS NULL AND state = 'delivered'"
        ).fetchone()
        conn.execute("SET LOCAL outbox.status_exact_mb = 0")
        estimated = conn.execute(
            "SELECT exact FROM outbox.status WHERE topic IS NULL AND state = 'delivered'"
        ).fetchone()
    assert (counted, estimated) == ((True,), (False,))


def test_outbox_status_marks_an_estimate_with_a_tilde(database_url: str) -> None:
    """The command shows an estimated count as ~N with a note saying what is exact, and its
    JSON says exact: false on that line only."""
    url = database_url
    _history(url, 300)
    _open_scene(url)
    _flush_and_analyze(url)
    env = {**os.environ, "PGOPTIONS": "-c outbox.status_exact_mb=0"}

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "outbox.cli", "--database-url", url, "status", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    table = status()
    assert table.returncode == 1, table.stderr  # quarantined, escalated: action needed
    [delivered] = [line for line in table.stdout.splitlines() if line.startswith("delivered")]
    assert delivered.split()[1] == "~300"
    assert "~ estimated: on a large table delivered messages are not counted" in table.stdout
    [pending] = [line for line in table.stdout.splitlines() if line.startswith("pending")]
    assert pending.split()[1] == "2"
    report = json.loads(status("--json").stdout)
    assert report["counts"]["delivered"] == 300
    assert {line["state"]: line["exact"] for line in report["states"]} == {
        "pending": True,
        "in_flight": True,
        "delivered": False,
        "uncertain": True,
        "quarantined": True,
        "discarded": True,
    }
