"""``outbox list --state S`` reads one state's messages, not the whole table.

The list read ``outbox.message_status``, whose state is derived (in flight
while an open batch names a pending row), which hides every partial index:
each listing read every row, 47 ms at 300,000 rows, seconds at ten million,
the scale at which an operator lists the quarantined messages in an
incident. Here a table of 100,000 delivered messages holds a few of every
other state; each listing's plan must not read the table whole, and must
list what the view says is in that state.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import outbox
from outbox.inspection import list_messages
from outbox.operator import discard
from outbox.queries import query
from outbox.states import State
from tests.support import ClaimingStore, claiming_store

pytestmark = pytest.mark.integration

HISTORY = 100_000
LIMIT = 7

# Delivered history, two topics, ids UUIDv7 a millisecond apart; then the
# newer messages the test enqueues. The statistics are taken after.
DELIVERED = """
INSERT INTO outbox.messages (id, topic, key, value, state, created_at, available_at,
                             fence, attempts, kafka_partition, kafka_offset, delivered_at)
SELECT (lpad(to_hex(ms), 12, '0') || '7' || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid,
       CASE WHEN i %% 3 = 0 THEN 'payments' ELSE 'orders' END,
       convert_to('k' || (i %% 5000), 'UTF8'), convert_to(rpad('v', 100, 'x'), 'UTF8'),
       'delivered', at, at, 1, 1, i %% 3, i / 3, at
FROM (SELECT i, md5(i::text) AS h, (1700000000000 + i)::bigint AS ms,
             to_timestamp((1700000000000 + i) / 1000.0) AS at
      FROM generate_series(0, %(rows)s - 1) AS i) AS history
"""


@pytest.fixture
def large_table(database_url: str) -> Iterator[tuple[str, ClaimingStore]]:
    """HISTORY delivered messages, then some of every other state in both topics."""
    with psycopg.connect(database_url) as conn:
        conn.execute(DELIVERED, {"rows": HISTORY})
        ids = outbox.enqueue_many(conn, [_open(i) for i in range(60)])
    with psycopg.connect(database_url, autocommit=True) as conn:
        # Ten uncertain, ten quarantined, the first of each topic's pending ones.
        conn.execute(
            "UPDATE outbox.messages SET state = 'uncertain', attempts = 1 WHERE id = ANY(%s)",
            (ids[:10],),
        )
        conn.execute(
            "UPDATE outbox.messages SET state = 'quarantined', attempts = 5 WHERE id = ANY(%s)",
            (ids[10:20],),
        )
        for message_id in ids[20:30]:
            discard(conn, message_id, "test: discarded")
        conn.execute("VACUUM ANALYZE outbox.messages")
    store = claiming_store(database_url)
    try:
        batch = store.claim(100, 30.0)  # the 30 pending ones, now in flight
        assert batch is not None
        assert len(batch.messages) == 30
        with psycopg.connect(database_url) as conn:  # and 20 pending behind them
            outbox.enqueue_many(conn, [_open(i) for i in range(60, 80)])
        yield database_url, store
    finally:
        store.close()


def _open(i: int) -> outbox.Message:
    return outbox.Message("orders" if i % 2 else "payments", b"v", key=b"open-%d" % i)


def _reference(
    conn: psycopg.Connection[Any], state: State, topic: str | None
) -> tuple[list[uuid.UUID], bool]:
    """What the view says: the state's first LIMIT messages in seq order (delivered: the
    first by id), and whether it holds more."""
    order = "id" if state is State.DELIVERED else "seq"
    rows = conn.execute(
        "SELECT id, seq, total FROM (SELECT id, seq, count(*) OVER () AS total"
        "  FROM outbox.message_status"
        "  WHERE state = %s AND (%s::text IS NULL OR topic = %s::text)"
        f"  ORDER BY {order} LIMIT %s) AS first ORDER BY seq",
        (state.value, topic, topic, LIMIT),
    ).fetchall()
    return [row[0] for row in rows], bool(rows) and rows[0][2] > LIMIT


def test_each_state_is_listed_without_reading_the_table(
    large_table: tuple[str, ClaimingStore],
) -> None:
    url, _ = large_table
    with psycopg.connect(url) as conn:
        for state in State:
            for topic in (None, "payments"):
                params = {"state": state.value, "topic": topic, "limit": LIMIT + 1}
                plan = "\n".join(
                    row[0] for row in conn.execute("EXPLAIN " + query("list_messages"), params)
                )
                assert "Seq Scan on messages" not in plan, (state, topic, plan)
                listing = list_messages(conn, state, topic=topic, limit=LIMIT)
                expected, more = _reference(conn, state, topic)
                assert expected, f"the table holds no {state.value} message to list"
                assert [row["id"] for row in listing.messages] == expected, (state, topic)
                assert all(row["state"] == state.value for row in listing.messages)
                assert listing.more == more, (state, topic)
