"""A claim writes only its batch; the settle closes it and raises the fence.

A publisher whose batch was recovered changes nothing when it settles.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest

import outbox
from outbox.states import State
from publisher.outcomes import AttemptOutcome
from publisher.store import Settlement
from tests.support import claiming_store

pytestmark = pytest.mark.integration


def _row(database_url: str, message_id: uuid.UUID) -> tuple[object, ...]:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT state, fence, attempts, lease_owner, kafka_partition, kafka_offset, "
            "lease_expires_at > now() FROM outbox.message_status WHERE id = %s",
            (message_id,),
        ).fetchone()
    assert row is not None
    return row


def _message_rows(database_url: str) -> list[tuple[object, ...]]:
    with psycopg.connect(database_url) as conn:
        return conn.execute("SELECT * FROM outbox.messages ORDER BY seq").fetchall()


def test_claim_writes_one_batch_naming_its_messages_and_no_message_row(
    database_url: str,
) -> None:
    """A claim leases the oldest pending messages by one batch row; their rows are not written."""
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(conn, [outbox.Message("t", f"{i}") for i in range(5)])
    before = _message_rows(database_url)
    store = claiming_store(database_url)
    batch = store.claim(limit=3, lease_seconds=30)
    assert batch is not None
    assert [m.id for m in batch.messages] == ids[:3]
    # This attempt's number and fence: the settle writes them.
    assert all(m.fence == 1 and m.attempt == 1 for m in batch.messages)
    assert _message_rows(database_url) == before
    with psycopg.connect(database_url) as conn:
        claimed = conn.execute(
            "SELECT message_ids, publisher_id, settled_at, lease_expires_at > now() "
            "FROM outbox.batches WHERE id = %s",
            (batch.id,),
        ).fetchone()
    assert claimed == (ids[:3], store.publisher_id, None, True)
    # In flight, derived from the open batch, with the batch's lease.
    assert _row(database_url, ids[0]) == ("in_flight", 0, 0, store.publisher_id, None, None, True)
    assert _row(database_url, ids[3])[0] == "pending"
    second = claiming_store(database_url).claim(limit=10, lease_seconds=30)
    assert second is not None
    assert [m.id for m in second.messages] == ids[3:]  # an open batch's messages are not claimed
    store.close()


def test_a_settle_tried_again_after_its_answer_was_lost_finds_what_it_recorded(
    database_url: str,
) -> None:
    """The first try committed and its answer was lost (the connection dropped): tried
    again, the settle changes nothing, and settled_by names what the first recorded, the
    delivered message by its row and the failed one by its attempt. After recovery,
    settled_by names nothing of what recovery moved."""
    with psycopg.connect(database_url) as conn:
        delivered, failed = outbox.enqueue_many(
            conn, [outbox.Message("t", b"1", key="a"), outbox.Message("t", b"2", key="b")]
        )
    store = claiming_store(database_url)
    batch = store.claim(limit=10, lease_seconds=30)
    assert batch is not None
    store.mark_sending(batch, {"t": 3}, write_deadline_seconds=30.0)
    fences = {m.id: m.fence for m in batch.messages}
    settlements = [
        Settlement(delivered, fences[delivered], State.DELIVERED, AttemptOutcome.DELIVERED,
                   partition=0, offset=5),
        Settlement(failed, fences[failed], State.PENDING, AttemptOutcome.FAILED,
                   retry_after=5.0, error="NotEnoughReplicasError", counts_as_failure=True),
    ]  # fmt: skip
    assert store.settle(batch, settlements) == {delivered, failed}

    assert store.settle(batch, settlements) == set()  # the retry
    assert store.settled_by(batch, [delivered, failed]) == {delivered, failed}

    with psycopg.connect(database_url) as conn:
        again = outbox.enqueue(conn, "t", b"3", key="c")
    lost = store.claim(limit=10, lease_seconds=30)
    assert lost is not None
    store.mark_sending(lost, {"t": 3}, write_deadline_seconds=0.0)
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE outbox.batches SET lease_expires_at = now() - interval '1 second' "
            "WHERE id = %s",
            (lost.id,),
        )
    assert [r.message_id for r in store.recover_expired_leases()] == [again]
    assert store.settled_by(lost, [again]) == set()
    store.close()


def test_settle_of_a_batch_recovery_closed_changes_nothing(database_url: str) -> None:
    """Once recovery took an expired batch back and it was claimed again, the old settle is void."""
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, "t", b"x")
    old = claiming_store(database_url)
    old_batch = old.claim(limit=10, lease_seconds=30)
    assert old_batch is not None
    # The lease expires and recovery takes the batch back (nothing was sent).
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE outbox.batches SET lease_expires_at = now() - interval '1 second' "
            "WHERE id = %s",
            (old_batch.id,),
        )
    new = claiming_store(database_url)
    assert [r.message_id for r in new.recover_expired_leases()] == [message_id]
    new_batch = new.claim(limit=10, lease_seconds=30)
    assert new_batch is not None
    assert new_batch.messages[0].fence == old_batch.messages[0].fence + 1
    before = _row(database_url, message_id)

    stale = Settlement(
        message_id,
        old_batch.messages[0].fence,
        State.DELIVERED,
        AttemptOutcome.DELIVERED,
        partition=0,
        offset=123,
    )
    assert old.settle(old_batch, [stale]) == set()
    assert _row(database_url, message_id) == before
    with psycopg.connect(database_url) as conn:
        attempts = conn.execute(
            "SELECT outcome FROM outbox.attempts WHERE message_id = %s ORDER BY attempt",
            (message_id,),
        ).fetchall()
    assert attempts == [("recovered",)]  # recovery's record; nothing from the stale settle

    current = Settlement(
        message_id,
        new_batch.messages[0].fence,
        State.DELIVERED,
        AttemptOutcome.DELIVERED,
        partition=2,
        offset=7,
    )
    assert new.settle(new_batch, [current]) == {message_id}
    assert _row(database_url, message_id)[:6] == ("delivered", 2, 2, None, 2, 7)
    old.close()
    new.close()


def test_settle_with_a_stale_fence_leaves_that_message_alone(database_url: str) -> None:
    """A message whose row moved on since the claim (its fence changed) is not overwritten."""
    with psycopg.connect(database_url) as conn:
        kept, moved = outbox.enqueue_many(
            conn, [outbox.Message("t", "a"), outbox.Message("t", "b")]
        )
    store = claiming_store(database_url)
    batch = store.claim(limit=10, lease_seconds=30)
    assert batch is not None
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE outbox.messages SET fence = fence + 5 WHERE id = %s", (moved,))
    settlements = [
        Settlement(m.id, m.fence, State.DELIVERED, AttemptOutcome.DELIVERED, partition=0, offset=i)
        for i, m in enumerate(batch.messages)
    ]
    assert store.settle(batch, settlements) == {kept}
    assert _row(database_url, moved)[:3] == ("pending", 5, 0)
    store.close()


def test_settle_records_each_outcome_and_the_attempts_that_did_not_deliver(
    database_url: str,
) -> None:
    """One settle statement moves each message to its own next state with evidence."""
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(conn, [outbox.Message("t", f"{i}") for i in range(4)])
    store = claiming_store(database_url)
    batch = store.claim(limit=10, lease_seconds=30)
    assert batch is not None
    f = [m.fence for m in batch.messages]
    settlements = [
        Settlement(ids[0], f[0], State.DELIVERED, AttemptOutcome.DELIVERED, partition=1, offset=5),
        Settlement(
            ids[1],
            f[1],
            State.PENDING,
            AttemptOutcome.FAILED,
            retry_after=30,
            error="E1",
            send_began=False,
        ),
        Settlement(
            ids[2], f[2], State.UNCERTAIN, AttemptOutcome.UNCERTAIN, partition=2, error="E2"
        ),
        Settlement(
            ids[3], f[3], State.QUARANTINED, AttemptOutcome.FAILED, error="E3", send_began=False
        ),
    ]
    assert store.settle(batch, settlements) == set(ids)
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT m.state, m.last_error, m.available_at > now() + interval '20 seconds', "
            "a.outcome, a.send_began, a.publisher_id, a.kafka_partition "
            "FROM outbox.messages m LEFT JOIN outbox.attempts a ON a.message_id = m.id "
            "ORDER BY m.seq"
        ).fetchall()
    me = store.publisher_id
    assert rows == [
        # A delivery writes no attempt row: its batch is the record.
        ("delivered", None, False, None, None, None, None),
        ("pending", "E1", True, "failed", False, me, None),
        ("uncertain", "E2", False, "uncertain", True, me, 2),
        ("quarantined", "E3", False, "failed", False, me, None),
    ]
    assert store.claim(limit=10, lease_seconds=30) is None  # backoff: not claimable yet
    store.close()
