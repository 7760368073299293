"""The publisher's statements stay fast when the table's statistics lag behind a backlog.

A queue table's statistics are always late: ANALYZE samples the table while
the publishers keep up (hardly a row pending), then a stall or a crash
leaves a backlog of tens of thousands, and until the next ANALYZE the
planner believes the partial index ``messages_pending_by_lane`` holds one row. A
statement that addresses messages by id but also tests ``state = 'pending'``
may then read that whole index instead of looking each id up by its key:
recovery did so twice over, once per message, and took 80 s for one batch
of 500 over a backlog of 20,000, while the loop that ran it stopped turning.

These tests build exactly that: statistics taken with nothing pending, then
a backlog, and check each statement's plan and result. The plans are
checked because they are what fails: the timings only follow.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import outbox
from outbox.queries import query
from publisher.store import Batch, array_literal
from tests.support import ClaimingStore, claiming_store

pytestmark = pytest.mark.integration

BACKLOG = 5000
BATCH = 500


@pytest.fixture
def stale_backlog(database_url: str) -> Iterator[tuple[str, ClaimingStore]]:
    """A backlog of BACKLOG pending messages that the statistics say is not there."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        # No autovacuum for this table here: it would make the statistics right.
        conn.execute("ALTER TABLE outbox.messages SET (autovacuum_enabled = false)")
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(conn, [outbox.Message("t", b"v", key=b"k%d" % i) for i in range(2000)])
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox.messages SET state = 'delivered', delivered_at = now(), "
            "kafka_partition = 0, kafka_offset = 0"
        )
        conn.execute("ANALYZE outbox.messages")
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(
            conn, [outbox.Message("t", b"v", key=b"k%d" % i) for i in range(BACKLOG)]
        )
    store = claiming_store(database_url)
    try:
        yield database_url, store
    finally:
        store.close()


def _plan(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]) -> str:
    return "\n".join(row[0] for row in conn.execute("EXPLAIN " + sql, params).fetchall())


def _assert_looked_up_by_key(plan: str) -> None:
    """Not read through an open state's partial index (by key, or a scan priced honestly).

    A scan of the whole table is priced from its true size, so it is chosen
    only where it is cheap (here, a table of a few thousand rows).
    """
    for partial in ("messages_pending_by_lane", "messages_uncertain"):
        assert partial not in plan, f"read through {partial}:\n{plan}"


def _settle_batch_params(store: ClaimingStore, batch: Batch, *, delivered: bool) -> dict[str, Any]:
    """settle_batch's parameters: every message delivered (over six partitions), or refused."""
    n = len(batch.messages)
    return {
        "batch_id": batch.id,
        "publisher": store.publisher_id,
        "ids": array_literal(m.id for m in batch.messages),
        "fences": array_literal(m.fence for m in batch.messages),
        "states": array_literal(["delivered" if delivered else "pending"] * n),
        "outcomes": array_literal(["delivered" if delivered else "failed"] * n),
        "partitions": array_literal(i % 6 if delivered else None for i in range(n)),
        "offsets": array_literal(i if delivered else None for i in range(n)),
        "retry_after": array_literal([0.0 if delivered else 1.0] * n),
        "errors": array_literal([None if delivered else "refused"] * n),
        "send_began": array_literal([True] * n),
        "failures": array_literal([not delivered] * n),
        "send_alone": array_literal([False] * n),
    }


def test_the_statistics_are_stale_as_the_tests_need(stale_backlog: tuple[str, Any]) -> None:
    url, _ = stale_backlog
    with psycopg.connect(url) as conn:
        plan = _plan(conn, "SELECT * FROM outbox.messages WHERE state = 'pending'", {})
    # The planner expects (almost) nothing pending although BACKLOG are.
    assert "rows=1 " in plan, plan


def test_recovery_and_settles_look_messages_up_by_key(
    stale_backlog: tuple[str, ClaimingStore],
) -> None:
    url, store = stale_backlog
    batch = store.claim(BATCH, 30.0)
    assert batch is not None
    assert len(batch.messages) == BATCH
    n = len(batch.messages)
    with psycopg.connect(url) as conn:
        _assert_looked_up_by_key(
            _plan(
                conn,
                query("settle_delivered"),
                {
                    "batch_id": batch.id,
                    "publisher": store.publisher_id,
                    "fences": array_literal(m.fence for m in batch.messages),
                    "partitions": array_literal([0] * n),
                    "offsets": array_literal(range(n)),
                },
            )
        )
        _assert_looked_up_by_key(
            _plan(
                conn,
                query("mark_sending"),
                {
                    "batch_id": batch.id,
                    "owner": store.publisher_id,
                    "write_deadline_seconds": 30.0,
                    "transactional_id": None,
                    "partition_counts": Jsonb({"t": 1}),
                    "topics": ["t"],
                    "ids": [m.id for m in batch.messages],
                    "fences": [m.fence - 1 for m in batch.messages],
                },
            )
        )
        _assert_looked_up_by_key(
            _plan(
                conn,
                query("settle_batch"),
                _settle_batch_params(store, batch, delivered=False),
            )
        )
        # The batch's lease runs out: recovery takes it.
        conn.execute(
            "UPDATE outbox.batches SET lease_expires_at = now() - interval '1 second', "
            "send_began_at = now() WHERE id = %s",
            (batch.id,),
        )
        conn.commit()
        _assert_looked_up_by_key(_plan(conn, query("recover_expired_leases"), {"limit": 100}))
    recovered = store.recover_expired_leases()
    assert {r.message_id for r in recovered} == {m.id for m in batch.messages}
    assert {r.state.value for r in recovered} == {"uncertain"}


def _backlog_made_uncertain(conn: psycopg.Connection[Any]) -> list[uuid.UUID]:
    """A broker outage leaves the backlog uncertain; the statistics saw none."""
    rows = conn.execute(
        "UPDATE outbox.messages SET state = 'uncertain', fence = fence + 1 "
        "WHERE state = 'pending' RETURNING id"
    ).fetchall()
    conn.commit()
    return [row[0] for row in rows]


def test_reconciliation_looks_uncertain_messages_up_by_key(
    stale_backlog: tuple[str, ClaimingStore],
) -> None:
    url, _ = stale_backlog
    with psycopg.connect(url) as conn:
        ids = _backlog_made_uncertain(conn)
        decided = ids[:BATCH]
        _assert_looked_up_by_key(
            _plan(
                conn,
                query("decide_uncertain"),
                {
                    "ids": decided,
                    "fences": [1] * len(decided),
                    "to_states": ["pending"] * len(decided),
                    "partitions": [None] * len(decided),
                    "offsets": [None] * len(decided),
                    "reasons": ["absent"] * len(decided),
                    "evidence": [Jsonb({})] * len(decided),
                    "decided_by": f"test-{uuid.uuid4()}",
                },
            )
        )


def test_operator_decisions_look_later_messages_of_a_key_up_by_key(
    stale_backlog: tuple[str, ClaimingStore],
) -> None:
    """``outbox retry --quarantined`` after an outage: overtaken_by reads each message by
    its id and the uncertain later ones by key, not the whole uncertain index per message
    (27 s for 2,000 messages over 100,000 uncertain ones the statistics had not seen)."""
    url, _ = stale_backlog
    with psycopg.connect(url) as conn:
        ids = _backlog_made_uncertain(conn)
        plan = _plan(conn, query("overtaken_by"), {"ids": ids[:BATCH]})
        _assert_looked_up_by_key(plan)
        assert "messages_pkey" in plan, plan
        assert "messages_holding_keys" in plan or "messages_open_keys" in plan, plan
        # The backlog's keys are its own: nothing later of any of them.
        assert conn.execute(query("overtaken_by"), {"ids": ids[:BATCH]}).fetchall() == []


def test_settles_lock_partition_offsets_in_one_order(
    stale_backlog: tuple[str, ClaimingStore],
) -> None:
    """Two publishers settling batches that share partitions take their rows in one order.

    The confirmed offsets are upserted per partition; rows locked in the
    order a hash aggregate happens to produce differ between two batches,
    and two settles deadlocked (PostgreSQL ended one of them after a second).
    """
    url, store = stale_backlog
    batch = store.claim(BATCH, 30.0)
    assert batch is not None
    n = len(batch.messages)
    with psycopg.connect(url) as conn:
        plans = {
            "settle_delivered": _plan(
                conn,
                query("settle_delivered"),
                {
                    "batch_id": batch.id,
                    "publisher": store.publisher_id,
                    "fences": array_literal(m.fence for m in batch.messages),
                    "partitions": array_literal(i % 6 for i in range(n)),
                    "offsets": array_literal(range(n)),
                },
            ),
            "settle_batch": _plan(
                conn,
                query("settle_batch"),
                _settle_batch_params(store, batch, delivered=True),
            ),
        }
    for name, plan in plans.items():
        upsert = plan[plan.index("Insert on partition_offsets") :]
        sorted_rows = re.search(r"Sort Key: (settled\w*)\.topic, \1\.kafka_partition", upsert)
        assert sorted_rows is not None, (name, plan)


def _assert_probed_per_row(plan: str) -> None:
    """An EXISTS probe run once per row through an index, not one hash of every open row
    (which the planner picks when it believes there are almost none: each step of 1,000
    rows then reads the whole open backlog once, and tests each row against it). The one
    hash allowed is purge_batches' of the quarantined messages' batches, read once a step
    through their partial index (a quarantined row has no index by batch)."""
    lines = plan.splitlines()
    for hashed in re.findall(r"hashed SubPlan (\d+)", plan):
        [at] = [i for i, line in enumerate(lines) if line.strip() == f"SubPlan {hashed}"]
        assert "messages_quarantined" in lines[at + 1], plan
    assert "Anti Join" not in plan, plan


def test_retention_probes_open_messages_per_row(
    stale_backlog: tuple[str, ClaimingStore],
) -> None:
    """purge_delivered looks for an earlier open message of each delivered one's key, and
    purge_batches for an uncertain message of each batch: by key, whatever the statistics
    say of the open backlog; and they still keep what they must."""
    url, store = stale_backlog
    batch = store.claim(BATCH, 30.0)
    assert batch is not None
    store.mark_sending(batch, {"t": 1}, write_deadline_seconds=0.0)
    with psycopg.connect(url) as conn:
        # Its messages uncertain, the batch settled: it is evidence they still need.
        conn.execute(
            "UPDATE outbox.messages SET state = 'uncertain', fence = fence + 1, batch_id = %s "
            "WHERE id = ANY(%s)",
            (batch.id, [m.id for m in batch.messages]),
        )
        conn.execute("UPDATE outbox.batches SET settled_at = now() WHERE id = %s", (batch.id,))
        conn.commit()
        params = {"after": uuid.UUID(int=0), "after_n": 0, "age": "0 seconds", "limit": 1000}
        _assert_probed_per_row(_plan(conn, query("purge_delivered"), params))
        _assert_probed_per_row(_plan(conn, query("purge_batches"), {**params, "after": 0}))
        _, deleted = conn.execute(query("purge_delivered"), params).fetchone() or (None, 0)
        conn.commit()
        # The 2,000 delivered messages came before the backlog of their keys: none waits.
        assert deleted == 1000
        conn.execute(query("purge_batches"), {**params, "after": 0})
        kept = conn.execute(
            "SELECT count(*) FROM outbox.batches WHERE id = %s", (batch.id,)
        ).fetchone()
        assert kept == (1,)
