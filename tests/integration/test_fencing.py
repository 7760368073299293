"""Claims take a lease and raise the fence; a stale fence's word changes nothing."""

from __future__ import annotations

import uuid

import psycopg
import pytest

import outbox
from outbox.states import State
from publisher.store import Settlement
from tests.support import claiming_store

pytestmark = pytest.mark.integration


def _row(database_url: str, message_id: uuid.UUID) -> tuple[object, ...]:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT state, fence, attempts, lease_owner, kafka_partition, kafka_offset, "
            "lease_expires_at > now() FROM outbox.messages WHERE id = %s",
            (message_id,),
        ).fetchone()
    assert row is not None
    return row


def test_claim_leases_in_order_and_raises_the_fence(database_url: str) -> None:
    """One claim statement leases the oldest pending messages, fence and attempts + 1."""
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(conn, [outbox.Message("t", f"{i}") for i in range(5)])
    store = claiming_store(database_url)
    batch = store.claim(limit=3, lease_seconds=30)
    assert batch is not None
    assert [m.id for m in batch.messages] == ids[:3]
    assert all(m.fence == 1 and m.attempt == 1 for m in batch.messages)
    assert _row(database_url, ids[0]) == ("in_flight", 1, 1, store.publisher_id, None, None, True)
    assert _row(database_url, ids[3])[0] == "pending"
    second = claiming_store(database_url).claim(limit=10, lease_seconds=30)
    assert second is not None
    assert [m.id for m in second.messages] == ids[3:]  # SKIP LOCKED / state: no overlap
    store.close()


def test_confirm_with_a_stale_fence_changes_nothing(database_url: str) -> None:
    """After another publisher re-claimed a message, the old owner's confirm is ignored."""
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, "t", b"x")
    old = claiming_store(database_url)
    old_batch = old.claim(limit=10, lease_seconds=30)
    assert old_batch is not None
    # The lease is taken away (as recovery does after it expires) and re-claimed.
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE outbox.messages SET state = 'pending', lease_owner = NULL, "
            "lease_expires_at = NULL WHERE id = %s",
            (message_id,),
        )
    new = claiming_store(database_url)
    new_batch = new.claim(limit=10, lease_seconds=30)
    assert new_batch is not None
    assert new_batch.messages[0].fence == old_batch.messages[0].fence + 1
    before = _row(database_url, message_id)

    stale = Settlement(
        message_id,
        old_batch.messages[0].fence,
        State.DELIVERED,
        "delivered",
        partition=0,
        offset=123,
    )
    assert old.settle(old_batch, [stale]) == set()
    assert _row(database_url, message_id) == before
    with psycopg.connect(database_url) as conn:
        attempts = conn.execute("SELECT count(*) FROM outbox.attempts").fetchone()
    assert attempts == (0,)

    current = Settlement(
        message_id, new_batch.messages[0].fence, State.DELIVERED, "delivered", partition=2, offset=7
    )
    assert new.settle(new_batch, [current]) == {message_id}
    assert _row(database_url, message_id)[:6] == ("delivered", 2, 2, None, 2, 7)
    old.close()
    new.close()


def test_settle_records_each_outcome_and_its_attempt(database_url: str) -> None:
    """One settle statement moves each message to its own next state with evidence."""
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(conn, [outbox.Message("t", f"{i}") for i in range(4)])
    store = claiming_store(database_url)
    batch = store.claim(limit=10, lease_seconds=30)
    assert batch is not None
    f = [m.fence for m in batch.messages]
    settlements = [
        Settlement(ids[0], f[0], State.DELIVERED, "delivered", partition=1, offset=5),
        Settlement(
            ids[1], f[1], State.PENDING, "failed", retry_after=30, error="E1", send_began=False
        ),
        Settlement(ids[2], f[2], State.UNCERTAIN, "uncertain", partition=2, error="E2"),
        Settlement(ids[3], f[3], State.QUARANTINED, "failed", error="E3", send_began=False),
    ]
    assert store.settle(batch, settlements) == set(ids)
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT m.state, m.last_error, m.available_at > now() + interval '20 seconds', "
            "a.outcome, a.send_began, a.publisher_id, a.kafka_partition "
            "FROM outbox.messages m JOIN outbox.attempts a ON a.message_id = m.id "
            "ORDER BY m.seq"
        ).fetchall()
    me = store.publisher_id
    assert rows == [
        ("delivered", None, False, "delivered", True, me, 1),
        ("pending", "E1", True, "failed", False, me, None),
        ("uncertain", "E2", False, "uncertain", True, me, 2),
        ("quarantined", "E3", False, "failed", False, me, None),
    ]
    assert store.claim(limit=10, lease_seconds=30) is None  # backoff: not claimable yet
    store.close()
