"""Messages held behind a stuck message of their key stay out of the claim's way.

A keyed message waits while an earlier message of its key is uncertain or
quarantined. The publisher's hold pass marks such messages held, and a claim
reads only pending messages that are not held, so a long queue behind a
quarantined key costs a claim nothing. Whatever moves the stuck message on
releases them in the same step, and the claim counts a held message as
holding its key back, so a mark that comes late or stays too long never
lets a message of the key overtake an earlier one (outbox.holds).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import outbox
from outbox.holds import (
    MOST_HELD_PER_KEY,
    hold_behind_stuck,
    release_stale_holds,
    release_stale_holds_statement,
)
from outbox.operator import discard, retry, retry_quarantined
from outbox.queries import query
from outbox.states import State
from publisher.outcomes import AttemptOutcome
from publisher.store import LANES, Decision, Settlement
from tests.support import (
    ClaimingStore,
    claim_rows_read,
    claiming_store,
    fetch_rows,
    make_uncertain,
    plan_rows_read,
)

pytestmark = pytest.mark.integration

TOPIC = "orders"
WAITING = 2_000


def _held(conn: psycopg.Connection[Any]) -> list[uuid.UUID]:
    return [
        row[0]
        for row in conn.execute(
            "SELECT id FROM outbox.messages WHERE state = 'pending' AND held ORDER BY seq"
        ).fetchall()
    ]


def _quarantine(store: ClaimingStore, message_id: uuid.UUID) -> None:
    """Claim ``message_id`` (the oldest pending message) alone and settle it quarantined."""
    batch = store.claim(1, lease_seconds=30)
    assert batch is not None
    assert [m.id for m in batch.messages] == [message_id]
    store.settle(
        batch,
        [
            Settlement(
                message_id,
                batch.messages[0].fence,
                State.QUARANTINED,
                AttemptOutcome.FAILED,
                error="MessageSizeTooLargeError: too big",
                send_began=True,
            )
        ],
    )


@pytest.fixture
def stuck_key(database_url: str) -> Iterator[tuple[ClaimingStore, uuid.UUID, list[uuid.UUID]]]:
    """A quarantined message of key "stuck" with WAITING messages of its key behind it.

    Yields the store (owning every lane), the quarantined message and the waiting ones.
    """
    with psycopg.connect(database_url, autocommit=True) as conn:
        # The tests measure plans at statistics they choose: autovacuum, run at
        # an unknown moment, would change them in between (a VACUUM without
        # its ANALYZE, after the pass, priced a scan of this small table
        # cheaper than the index for the stuck key's lane).
        conn.execute("ALTER TABLE outbox.messages SET (autovacuum_enabled = false)")
    store = claiming_store(database_url)
    try:
        with psycopg.connect(database_url) as conn:
            head = outbox.enqueue(conn, TOPIC, b"head", key="stuck")
        _quarantine(store, head)
        with psycopg.connect(database_url) as conn:
            waiting = outbox.enqueue_many(
                conn, [outbox.Message(TOPIC, f"w{i}", key="stuck") for i in range(WAITING)]
            )
            conn.execute("ANALYZE outbox.messages")
        yield store, head, waiting
    finally:
        store.close()


def _enqueue_free(database_url: str, n: int) -> list[uuid.UUID]:
    with psycopg.connect(database_url) as conn:
        return outbox.enqueue_many(
            conn, [outbox.Message(TOPIC, f"free{i}", key=f"free-{i}") for i in range(n)]
        )


def _claimed(store: ClaimingStore) -> list[uuid.UUID]:
    batch = store.claim(WAITING + 100, lease_seconds=30)
    return [] if batch is None else [m.id for m in batch.messages]


def test_a_claim_does_not_read_the_messages_held_behind_a_stuck_key(
    database_url: str, stuck_key: tuple[ClaimingStore, uuid.UUID, list[uuid.UUID]]
) -> None:
    """Before the hold pass a claim reads every waiting message; after it, a few per lane."""
    store, _, waiting = stuck_key
    free = _enqueue_free(database_url, 10)
    before = claim_rows_read(store)
    assert before >= WAITING, f"the claim read only {before} rows before the pass"

    assert store.hold_and_release() == (WAITING, 0)
    with psycopg.connect(database_url) as conn:
        assert _held(conn) == waiting
    # Whether or not the statistics have seen the marks yet.
    after = claim_rows_read(store)
    assert after < 10 * LANES, f"the claim read {after} rows next to {WAITING} held messages"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("ANALYZE outbox.messages")
    after = claim_rows_read(store)
    assert after < 10 * LANES, f"after ANALYZE, the claim read {after} rows"
    assert _claimed(store) == free
    assert store.hold_and_release() == (0, 0), "a second pass changed something"


def _rows_read_by(store: ClaimingStore, sql: str, params: dict[str, Any]) -> int:
    """Rows of outbox.messages ``sql`` reads, rolled back."""
    with store.conn.transaction():
        [(plan,)] = store.conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchall()
        raise psycopg.Rollback
    return plan_rows_read(plan[0]["Plan"])


def test_a_pass_reads_only_what_arrived_since_the_last(
    database_url: str, stuck_key: tuple[ClaimingStore, uuid.UUID, list[uuid.UUID]]
) -> None:
    """Marking starts after the last message held, not at the stuck message, and the
    release finds nothing to do without reading what stays held."""
    store, _, waiting = stuck_key
    assert store.hold_and_release() == (WAITING, 0)
    with psycopg.connect(database_url) as conn:
        later = outbox.enqueue_many(
            conn, [outbox.Message(TOPIC, f"late{i}", key="stuck") for i in range(5)]
        )
    most = {"lanes": list(range(LANES)), "most": MOST_HELD_PER_KEY}
    marking = _rows_read_by(store, query("hold_behind_stuck"), most)
    assert marking < 100, f"the mark read {marking} rows, {WAITING} of them held already"
    releasing = _rows_read_by(store, release_stale_holds_statement(), most)
    assert releasing < 100, f"the release read {releasing} rows and released none"
    assert store.hold_and_release() == (5, 0)
    with psycopg.connect(database_url) as conn:
        assert _held(conn) == waiting + later


def _retry(conn: psycopg.Connection[Any], head: uuid.UUID) -> list[uuid.UUID]:
    retry(conn, head, "fixed", fence=None)
    return [head]


def _retry_all(conn: psycopg.Connection[Any], head: uuid.UUID) -> list[uuid.UUID]:
    assert retry_quarantined(conn, reason="fixed").moved == [head]
    return [head]


def _discard(conn: psycopg.Connection[Any], head: uuid.UUID) -> list[uuid.UUID]:
    discard(conn, head, "obsolete")
    return []


@pytest.mark.parametrize(
    "decide", [_retry, _retry_all, _discard], ids=["retry", "retry-quarantined", "discard"]
)
def test_the_decision_that_moves_the_stuck_message_releases_its_key(
    database_url: str,
    stuck_key: tuple[ClaimingStore, uuid.UUID, list[uuid.UUID]],
    decide: Callable[[psycopg.Connection[Any], uuid.UUID], list[uuid.UUID]],
) -> None:
    """Nothing stays held once the decision commits, and the key goes on in order."""
    store, head, waiting = stuck_key
    assert store.hold_and_release() == (WAITING, 0)
    with psycopg.connect(database_url, autocommit=True) as conn:
        first = decide(conn, head)
        assert _held(conn) == []
    assert _claimed(store) == first + waiting


def test_the_reconcilers_decision_releases_what_waited_behind_an_uncertain_message(
    database_url: str,
) -> None:
    """An uncertain head, its key's later messages held; found in Kafka, they go on."""
    with psycopg.connect(database_url) as conn:
        head = outbox.enqueue(conn, TOPIC, b"head", key="stuck")
    [(uncertain, partition)] = make_uncertain(database_url, partitions=1).items()
    assert uncertain == head
    with psycopg.connect(database_url) as conn:
        waiting = outbox.enqueue_many(
            conn, [outbox.Message(TOPIC, f"w{i}", key="stuck") for i in range(20)]
        )
    store = claiming_store(database_url)
    try:
        assert store.hold_and_release() == (20, 0)
        [(fence,)] = store.conn.execute(
            "SELECT fence FROM outbox.messages WHERE id = %s", (head,)
        ).fetchall()
        decided = store.decide(
            [Decision(head, fence, State.DELIVERED, "found", partition=partition, offset=0)],
            "a test",
        )
        assert decided == {head}
        assert _held(store.conn) == []
        assert _claimed(store) == waiting
    finally:
        store.close()


def test_a_message_held_too_long_never_lets_its_key_be_overtaken(
    database_url: str, stuck_key: tuple[ClaimingStore, uuid.UUID, list[uuid.UUID]]
) -> None:
    """The stuck message moves without releasing its key (as a publisher of a version
    before held messages would): a later message of the key is not claimed before the
    held ones, and the next pass releases them."""
    store, head, waiting = stuck_key
    assert store.hold_and_release() == (WAITING, 0)
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE outbox.messages SET state = 'discarded' WHERE id = %s", (head,))
        late = outbox.enqueue(conn, TOPIC, b"late", key="stuck")
    assert _claimed(store) == [], "a message was claimed past the held messages of its key"
    assert store.hold_and_release() == (0, WAITING)
    assert _claimed(store) == [*waiting, late]


@pytest.mark.usefixtures("stuck_key")
def test_a_stuck_message_in_another_publishers_lane_is_left_to_that_publisher(
    database_url: str,
) -> None:
    """A pass marks the messages of the lanes its publisher owns only."""
    with psycopg.connect(database_url) as conn:
        [(lane,)] = conn.execute(
            "SELECT DISTINCT lane FROM outbox.messages WHERE key = 'stuck'::bytea"
        ).fetchall()
        others = [n for n in range(LANES) if n != lane]
        assert hold_behind_stuck(conn, others) == 0
        assert hold_behind_stuck(conn, [lane]) == WAITING


def test_a_long_queue_is_held_and_released_in_bounded_steps_in_order(
    database_url: str, stuck_key: tuple[ClaimingStore, uuid.UUID, list[uuid.UUID]]
) -> None:
    """Each statement marks, or releases, at most ``most`` messages of a key, oldest first;
    what is released is claimed in order, and nothing past what is still held."""
    store, head, waiting = stuck_key
    lanes = list(range(LANES))
    step = WAITING // 4
    with psycopg.connect(database_url, autocommit=True) as conn:
        for done in range(step, WAITING + 1, step):
            assert hold_behind_stuck(conn, lanes, most=step) == step
            assert _held(conn) == waiting[:done]
        assert hold_behind_stuck(conn, lanes, most=step) == 0
        conn.execute("UPDATE outbox.messages SET state = 'discarded' WHERE id = %s", (head,))
        for done in range(step, WAITING + 1, step):
            assert release_stale_holds(conn, most=step) == step
            batch = store.claim(WAITING, lease_seconds=30)
            assert batch is not None
            assert [m.id for m in batch.messages] == waiting[:done]
            # Undo the claim (its batch names the messages), so the next one sees them again.
            conn.execute("DELETE FROM outbox.batches WHERE id = %s", (batch.id,))
        assert _held(conn) == []


def test_held_messages_with_nothing_stuck_before_them_are_work_left(
    database_url: str, stuck_key: tuple[ClaimingStore, uuid.UUID, list[uuid.UUID]]
) -> None:
    """--exit-when-idle exits when no work is left. Messages held behind a quarantined or
    escalated message wait for an operator: no work. Once that message moved on without
    releasing them (a decision releases at most MOST_HELD_PER_KEY of a key, and a pass
    that raced it commits its marks after it), they are work until a pass releases them:
    for the exit's question (stale_holds); a publisher that keeps running claims them
    after its next pass."""
    store, head, waiting = stuck_key
    assert store.hold_and_release() == (WAITING, 0)
    assert store.work_left(stale_holds=True) is False
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE outbox.messages SET state = 'uncertain', escalated_at = now() WHERE id = %s",
            (head,),
        )
    assert store.work_left(stale_holds=True) is False
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE outbox.messages SET state = 'discarded' WHERE id = %s", (head,))
        assert _held(conn) == waiting
    assert store.work_left(stale_holds=True) is True
    assert store.work_left() is False
    assert store.hold_and_release() == (0, WAITING)
    assert store.work_left() is True  # now as pending messages


@pytest.mark.parametrize("outcome", ["delivered", "retried", "recovered"])
def test_a_message_marked_while_in_flight_is_not_held_once_settled(
    database_url: str, outcome: str
) -> None:
    """A pass whose snapshot predates a claim can mark a message of that claim (the claim
    writes no message row). Whichever way its batch ends, it waits behind nothing after."""
    with psycopg.connect(database_url) as conn:
        message = outbox.enqueue(conn, TOPIC, b"m", key="k")
    store = claiming_store(database_url)
    try:
        batch = store.claim(10, lease_seconds=30)
        assert batch is not None
        [m] = batch.messages
        with psycopg.connect(database_url) as conn:
            conn.execute("UPDATE outbox.messages SET held = true WHERE id = %s", (message,))
            if outcome == "recovered":
                conn.execute(
                    "UPDATE outbox.batches SET lease_expires_at = now() - interval '1 second' "
                    "WHERE id = %s",
                    (batch.id,),
                )
        if outcome == "recovered":
            assert [r.message_id for r in store.recover_expired_leases()] == [message]
        else:
            settlement = (
                Settlement(m.id, m.fence, State.DELIVERED, AttemptOutcome.DELIVERED, 0, 0)
                if outcome == "delivered"
                else Settlement(
                    m.id, m.fence, State.PENDING, AttemptOutcome.FAILED, error="E", send_began=True
                )
            )
            assert store.settle(batch, [settlement]) == {message}
    finally:
        store.close()
    [(state, held)] = fetch_rows(
        database_url, "SELECT state, held FROM outbox.messages WHERE id = %s", message
    )
    assert (state, held) == (
        {"delivered": "delivered", "retried": "pending", "recovered": "pending"}[outcome],
        False,
    )
