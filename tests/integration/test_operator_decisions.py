"""Operator decisions (``outbox.operator``) against claims, stale evidence and write deadlines."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from psycopg.pq import TransactionStatus

import outbox
from outbox.operator import DecisionRefused, Resolution, discard, resolve
from publisher.store import Batch, claim_statement
from tests.support import (
    ClaimingStore,
    fetch_rows,
    run_outbox_cli,
    wait_until,
    waiting_on_lock,
)

pytestmark = pytest.mark.integration


def _claiming_store_with_lock_timeout(database_url: str) -> ClaimingStore:
    """A claiming store whose statements give up after 5 s waiting for a lock (not forever)."""
    store = ClaimingStore(make_conninfo(database_url, options="-c lock_timeout=5s"), uuid.uuid4())
    store.take_all_lanes()
    return store


def _run_while_held(
    holder: psycopg.Connection[Any],
    target: Callable[[], object],
    database_url: str,
    application_name: str,
    what: str,
) -> None:
    """Run ``target`` in a thread until its session waits on a lock ``holder``'s open
    transaction holds; then commit ``holder`` and wait for ``target`` to finish."""
    thread = threading.Thread(target=target)
    thread.start()
    wait_until(
        lambda: waiting_on_lock(database_url, application_name),
        timeout=10,
        what=f"{what} to wait on a lock",
    )
    holder.commit()
    thread.join(timeout=30)
    assert not thread.is_alive()


def _fence(database_url: str, message_id: uuid.UUID) -> Any:
    [(fence,)] = fetch_rows(
        database_url, "SELECT fence FROM outbox.messages WHERE id = %s", message_id
    )
    return fence


def test_a_refused_decision_held_open_lets_a_claim_take_the_key_in_order(
    database_url: str,
) -> None:
    """A decision refused inside a transaction the caller keeps open holds no lock: a claim
    goes on at once and takes the key's earlier message ahead of the later one."""
    with psycopg.connect(database_url) as conn:
        first, later = outbox.enqueue_many(
            conn, [outbox.Message("t", b"1", key="k"), outbox.Message("t", b"2", key="k")]
        )
    store = _claiming_store_with_lock_timeout(database_url)
    try:
        with psycopg.connect(database_url) as operator:
            operator.execute("SELECT 1")  # the caller's own transaction, left open
            with pytest.raises(DecisionRefused, match=f"message {first} is pending"):
                resolve(
                    operator,
                    first,
                    Resolution.DELIVERED,
                    "seen in the topic",
                    fence=_fence(database_url, first),
                )
            assert operator.info.transaction_status == TransactionStatus.INTRANS

            batch = store.claim(10, lease_seconds=30)

            assert batch is not None
            assert [m.id for m in batch.messages] == [first, later]
            operator.rollback()
    finally:
        store.close()


def test_a_decision_waits_for_a_claim_in_progress_and_sees_what_it_claimed(
    database_url: str,
) -> None:
    """A decision on a pending message waits for a claim of its lane in progress, then sees
    the message in flight and refuses: a decision never races a claim."""
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, "t", b"payload")
    store = _claiming_store_with_lock_timeout(database_url)
    name = f"decision-{uuid.uuid4().hex[:8]}"
    outcome: list[BaseException | str] = []

    def decide() -> None:
        with psycopg.connect(database_url, application_name=name) as conn:
            try:
                discard(conn, message_id, "obsolete", fence=_fence(database_url, message_id))
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                outcome.append(exc)
            else:
                outcome.append("discarded")

    try:
        with psycopg.connect(database_url) as claiming:
            claimed = claiming.execute(
                claim_statement(owner=store.publisher_id, lease_seconds=30.0, limit=10)
            ).fetchall()
            assert [row[0] for row in claimed] == [message_id]
            _run_while_held(claiming, decide, database_url, name, "the decision")
    finally:
        store.close()
    [refused] = outcome
    assert isinstance(refused, DecisionRefused)
    assert f"message {message_id} is in_flight" in str(refused)
    assert fetch_rows(database_url, "SELECT count(*) FROM outbox.decisions") == [(0,)]


def _lane(database_url: str, message_id: uuid.UUID) -> int:
    [(lane,)] = fetch_rows(
        database_url, "SELECT lane FROM outbox.messages WHERE id = %s", message_id
    )
    return int(lane)


def _in_two_lanes(database_url: str) -> tuple[uuid.UUID, uuid.UUID]:
    """Two pending messages whose keys fall in different lanes."""
    with psycopg.connect(database_url) as conn:
        first, *others = outbox.enqueue_many(
            conn, [outbox.Message("t", b"1", key=f"k{n}") for n in range(8)]
        )
    lane = _lane(database_url, first)
    other = next(m for m in others if _lane(database_url, m) != lane)
    with psycopg.connect(database_url) as conn:
        conn.execute("DELETE FROM outbox.messages WHERE id <> ALL(%s)", ([first, other],))
    return first, other


def test_a_decision_held_open_holds_back_its_lane_only(database_url: str) -> None:
    """A decision in a transaction its caller keeps open: claims skip its message's lane
    without waiting and take the other lanes' messages; the heartbeat renews every lane.
    Once the decision commits, its lane is claimed again."""
    discarded, other = _in_two_lanes(database_url)
    with psycopg.connect(database_url) as conn:
        behind = outbox.enqueue(conn, "t", b"3", key="k0")  # in the discarded one's lane
    store = _claiming_store_with_lock_timeout(database_url)  # a wait would fail after 5 s
    try:
        with psycopg.connect(database_url) as operator:
            operator.execute("SELECT 1")  # the caller's transaction, left open
            discard(operator, discarded, "obsolete", fence=_fence(database_url, discarded))

            batch = store.claim(10, lease_seconds=30)
            assert batch is not None
            assert [m.id for m in batch.messages] == [other]
            assert len(store.renew_lanes(30.0)[0]) == 32
            assert store.claim(10, lease_seconds=30) is None

            operator.commit()
        after = store.claim(10, lease_seconds=30)
        assert after is not None
        assert [m.id for m in after.messages] == [behind]
    finally:
        store.close()
    assert fetch_rows(
        database_url, "SELECT state FROM outbox.messages WHERE id = %s", discarded
    ) == [("discarded",)]


def _claim_from_before_a_discard(
    database_url: str, store: ClaimingStore, message_id: uuid.UUID
) -> Batch:
    """A claim whose snapshot was taken before ``message_id`` was discarded (a claim that
    began just before the decision committed): return what it took."""
    store.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    store.conn.execute("SELECT 1")  # the claim's snapshot, from before the discard
    with psycopg.connect(database_url) as operator:
        discard(operator, message_id, "obsolete", fence=_fence(database_url, message_id))
    batch = store.claim(10, 30.0)
    store.conn.execute("COMMIT")
    assert batch is not None
    return batch


def test_a_claim_from_before_a_discard_does_not_send_the_discarded_message(
    database_url: str,
) -> None:
    """A claim that read the messages before a discard committed names the discarded
    message. Marking the batch sending (a fresh snapshot) leaves it out: it is never sent."""
    with psycopg.connect(database_url) as conn:
        discarded, kept = outbox.enqueue_many(
            conn, [outbox.Message("t", b"1", key="a"), outbox.Message("t", b"2", key="b")]
        )
    store = _claiming_store_with_lock_timeout(database_url)
    try:
        batch = _claim_from_before_a_discard(database_url, store, discarded)
        assert [m.id for m in batch.messages] == [discarded, kept]  # read before the discard

        held = store.mark_sending(batch, {"t": 1}, 30.0)

        assert held == {kept}
    finally:
        store.close()
    assert fetch_rows(
        database_url, "SELECT state FROM outbox.messages WHERE id = %s", discarded
    ) == [("discarded",)]


@pytest.mark.parametrize("level", ["REPEATABLE_READ", "SERIALIZABLE"])
def test_a_decision_outside_read_committed_is_refused(database_url: str, level: str) -> None:
    """At REPEATABLE READ or SERIALIZABLE a decision's snapshot, taken before it waits for a
    claim, would not see that claim's batch: the decision is refused, nothing moves."""
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, "t", b"payload")
    with psycopg.connect(database_url) as operator:
        operator.isolation_level = psycopg.IsolationLevel[level]
        with pytest.raises(DecisionRefused, match="operator decisions run at READ COMMITTED"):
            discard(operator, message_id, "obsolete")
    assert fetch_rows(
        database_url, "SELECT state FROM outbox.messages WHERE id = %s", message_id
    ) == [("pending",)]
    assert fetch_rows(database_url, "SELECT count(*) FROM outbox.decisions") == [(0,)]


def test_the_cli_decides_at_read_committed_whatever_the_servers_default(
    database_url: str,
) -> None:
    """`outbox discard` pins its connection to READ COMMITTED, so a database whose default
    is REPEATABLE READ does not refuse (or endanger) its decisions."""
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, "t", b"payload")
    url = make_conninfo(database_url, options="-c default_transaction_isolation=serializable")
    done = run_outbox_cli(url, "discard", str(message_id), "--reason", "obsolete")
    assert done.returncode == 0, done.stderr
    assert fetch_rows(
        database_url, "SELECT state FROM outbox.messages WHERE id = %s", message_id
    ) == [("discarded",)]


def test_a_batch_whose_only_message_was_discarded_is_closed_without_it(
    database_url: str,
) -> None:
    """The claim from before the discard names only the discarded message: the mark holds
    nothing, and settling nothing closes the batch, so it holds no key back."""
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, "t", b"1", key="a")
    store = _claiming_store_with_lock_timeout(database_url)
    try:
        batch = _claim_from_before_a_discard(database_url, store, message_id)
        assert store.mark_sending(batch, {"t": 1}, 30.0) == set()

        assert store.settle(batch, []) == set()
    finally:
        store.close()
    assert fetch_rows(
        database_url, "SELECT settled_at IS NOT NULL FROM outbox.batches WHERE id = %s", batch.id
    ) == [(True,)]
