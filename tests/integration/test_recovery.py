"""Recovery of expired leases decides from the batch's evidence, once, and only when expired."""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

import outbox
from outbox.states import State
from publisher.outcomes import AttemptOutcome
from publisher.store import Batch, ClaimedMessage, Recovered, Settlement
from tests.support import ClaimingStore, claiming_store, fetch_rows, wait_until

pytestmark = pytest.mark.integration


def _enqueue(database_url: str, count: int = 1) -> list[uuid.UUID]:
    with psycopg.connect(database_url) as conn:
        return outbox.enqueue_many(conn, [outbox.Message("t", f"{i}") for i in range(count)])


def _expire(database_url: str, *message_ids: uuid.UUID) -> None:
    """Expire the lease of the open batches that name these messages."""
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE outbox.batches SET lease_expires_at = now() - interval '1 second' "
            "WHERE settled_at IS NULL AND message_ids && %s::uuid[]",
            (list(message_ids),),
        )


def _everything(database_url: str) -> list[list[tuple[Any, ...]]]:
    """Every row of the tables recovery writes, in a stable order."""
    return [
        fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq"),
        fetch_rows(database_url, "SELECT * FROM outbox.attempts ORDER BY message_id, attempt"),
        fetch_rows(database_url, "SELECT * FROM outbox.batches ORDER BY id"),
    ]


def test_expired_lease_of_a_batch_that_never_sent_goes_back_to_pending_once(
    database_url: str,
) -> None:
    """A lease that expired before sending began is returned to pending, and only once."""
    ids = _enqueue(database_url, 2)
    store = claiming_store(database_url)
    batch = store.claim(10, lease_seconds=0.3)
    assert batch is not None
    wait_until(
        lambda: fetch_rows(
            database_url,
            "SELECT bool_and(lease_expires_at < now()) FROM outbox.in_flight",
        )[0][0],
        timeout=10,
        what="the leases to expire",
    )

    # What moved, with the claim it was under: attempt 1, fence 1, its batch, its owner.
    assert store.recover_expired_leases() == [
        Recovered(m, State.PENDING, 1, 1, batch.id, store.publisher_id) for m in ids
    ]
    rows = fetch_rows(
        database_url,
        "SELECT state, lease_owner, lease_expires_at, available_at <= now(), last_error "
        "FROM outbox.message_status ORDER BY seq",
    )
    owner = str(store.publisher_id)
    for state, lease_owner, lease_expires_at, available, last_error in rows:
        assert (state, lease_owner, lease_expires_at, available) == ("pending", None, None, True)
        assert owner in last_error
        assert "sending had not begun" in last_error
    attempts = fetch_rows(
        database_url,
        "SELECT a.message_id, a.attempt, a.publisher_id, a.fence, a.outcome, a.send_began, "
        "a.batch_id, a.finished_at IS NOT NULL, a.error FROM outbox.attempts AS a "
        "JOIN outbox.messages AS m ON m.id = a.message_id ORDER BY m.seq",
    )
    assert [a[:8] for a in attempts] == [
        (m, 1, store.publisher_id, 1, "recovered", False, batch.id, True) for m in ids
    ]
    assert all(owner in a[8] and "nothing was sent" in a[8] for a in attempts)

    before = _everything(database_url)
    assert store.recover_expired_leases() == []
    assert _everything(database_url) == before
    store.close()


def test_expired_lease_of_a_batch_that_began_sending_becomes_uncertain_with_evidence(
    database_url: str,
) -> None:
    """A lease that expired after sending began makes the message uncertain, never pending."""
    [message_id] = _enqueue(database_url)
    store = claiming_store(database_url)
    store.register("test", os.getpid(), 30)
    batch = store.claim(10, lease_seconds=30)
    assert batch is not None
    assert store.mark_sending(batch, {"t": 3}, write_deadline_seconds=60) == {message_id}
    _expire(database_url, message_id)
    [(lease_expiry, heartbeat)] = fetch_rows(
        database_url,
        "SELECT b.lease_expires_at::text, p.heartbeat_at::text "
        "FROM outbox.batches AS b JOIN outbox.publishers AS p ON p.id = b.publisher_id",
    )

    assert store.recover_expired_leases() == [
        Recovered(message_id, State.UNCERTAIN, 1, 1, batch.id, store.publisher_id)
    ]
    [row] = fetch_rows(
        database_url,
        "SELECT m.state, m.lease_owner, m.available_at >= b.write_deadline, "
        "b.write_deadline > now(), m.last_error "
        "FROM outbox.message_status AS m JOIN outbox.batches AS b ON b.id = m.batch_id",
    )
    state, lease_owner, after_deadline, deadline_ahead, last_error = row
    assert (state, lease_owner, after_deadline, deadline_ahead) == ("uncertain", None, True, True)
    assert str(store.publisher_id) in last_error
    assert f"expired at {lease_expiry}" in last_error
    assert f"last heartbeat {heartbeat}" in last_error
    assert "may be in Kafka" in last_error
    attempts = fetch_rows(
        database_url,
        "SELECT publisher_id, fence, outcome, send_began, error FROM outbox.attempts",
    )
    assert attempts == [(store.publisher_id, 1, "recovered", True, last_error)]
    # Not claimable: an uncertain message is never resent without a decision.
    assert store.claim(10, lease_seconds=30) is None
    store.close()


def test_live_lease_of_a_slow_publisher_is_left_alone(database_url: str) -> None:
    """Recovery does not touch a lease that has not expired, however stale the heartbeat."""
    [message_id] = _enqueue(database_url)
    store = claiming_store(database_url)
    store.register("test", os.getpid(), 30)
    batch = store.claim(10, lease_seconds=30)
    assert batch is not None
    assert store.mark_sending(batch, {"t": 3}, write_deadline_seconds=0.0) == {message_id}
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE outbox.publishers SET heartbeat_at = now() - interval '1 hour'")
    before = _everything(database_url)

    other = claiming_store(database_url)
    assert other.recover_expired_leases() == []
    assert _everything(database_url) == before
    assert fetch_rows(database_url, "SELECT state, lease_owner FROM outbox.message_status") == [
        ("in_flight", store.publisher_id)
    ]
    other.close()
    store.close()


def test_publisher_that_lost_its_batch_to_recovery_may_send_nothing(database_url: str) -> None:
    """After recovery reclaimed a never-sent batch, its old owner can neither send nor settle."""
    ids = _enqueue(database_url, 2)
    old = claiming_store(database_url)
    batch = old.claim(10, lease_seconds=30)
    assert batch is not None
    _expire(database_url, *ids)
    recovery = claiming_store(database_url)
    assert [(r.message_id, r.state) for r in recovery.recover_expired_leases()] == [
        (m, State.PENDING) for m in ids
    ]
    before = _everything(database_url)

    assert old.mark_sending(batch, {"t": 3}, write_deadline_seconds=0.0) == set()
    assert fetch_rows(
        database_url,
        "SELECT send_began_at, write_deadline FROM outbox.batches WHERE id = %s",
        batch.id,
    ) == [(None, None)]
    settlements = [
        Settlement(m.id, m.fence, State.DELIVERED, AttemptOutcome.DELIVERED, partition=0, offset=i)
        for i, m in enumerate(batch.messages)
    ]
    assert old.settle(batch, settlements) == set()
    after = _everything(database_url)
    assert after[:2] == before[:2]  # messages and attempts: untouched
    assert fetch_rows(database_url, "SELECT count(*) FROM outbox.partition_offsets") == [(0,)]
    old.close()
    recovery.close()


def _stale_claim(
    database_url: str, owner: uuid.UUID, *message_ids: uuid.UUID, expired: bool = True
) -> int:
    """A batch naming a message another open batch names too, sending never begun: what
    a claim made on a snapshot from before the other claim leaves behind (see
    mark_sending); its lease expired (its publisher died before its mark), or live."""
    lease = "- interval '1 second'" if expired else "+ interval '30 seconds'"
    [(batch_id,)] = fetch_rows(
        database_url,
        "INSERT INTO outbox.batches (publisher_id, lease_expires_at, message_ids) "
        f"VALUES (%s, now() {lease}, %s::uuid[]) RETURNING id",
        owner,
        list(message_ids),
    )
    return int(batch_id)


def _sending_and_stale(
    database_url: str, write_deadline_seconds: float
) -> tuple[uuid.UUID, ClaimingStore, Batch, ClaimingStore, int]:
    """One message, claimed and marked sending by one publisher, and named by another's
    stale claim: the message, the sender and its batch, the other and its batch."""
    [message_id] = _enqueue(database_url)
    sender = claiming_store(database_url)
    sender.register("test", os.getpid(), 30)
    batch = sender.claim(10, lease_seconds=30)
    assert batch is not None
    marked = sender.mark_sending(batch, {"t": 3}, write_deadline_seconds=write_deadline_seconds)
    assert marked == {message_id}
    stale = claiming_store(database_url)
    stale.register("test", os.getpid(), 30)
    return (
        message_id,
        sender,
        batch,
        stale,
        _stale_claim(database_url, stale.publisher_id, message_id),
    )


def _settle_delivered(sender: ClaimingStore, batch: Batch, message_id: uuid.UUID) -> None:
    """The sender's settle of its one message, delivered: recorded, not refused as stale."""
    [message] = batch.messages
    delivered = Settlement(
        message.id, message.fence, State.DELIVERED, AttemptOutcome.DELIVERED, partition=1, offset=7
    )
    assert sender.settle(batch, [delivered]) == {message_id}


def test_a_stale_claim_recovered_leaves_the_message_another_batch_is_sending(
    database_url: str,
) -> None:
    """A batch that never began sending sent nothing. If another, live, batch names its
    message and is sending it, recovery leaves the message alone: moving its fence
    would refuse that batch's settle and send the message a second time."""
    message_id, sender, batch, stale, stale_batch = _sending_and_stale(database_url, 60)

    recovery = claiming_store(database_url)
    assert recovery.recover_expired_leases() == []
    assert fetch_rows(
        database_url, "SELECT settled_at IS NOT NULL FROM outbox.batches WHERE id = %s", stale_batch
    ) == [(True,)]
    assert fetch_rows(database_url, "SELECT attempts, fence FROM outbox.messages") == [(0, 0)]

    _settle_delivered(sender, batch, message_id)
    assert fetch_rows(
        database_url, "SELECT state, fence, kafka_offset FROM outbox.message_status"
    ) == [("delivered", 1, 7)]
    for store in (sender, stale, recovery):
        store.close()


def test_a_stale_claim_recovered_leaves_a_message_another_batch_settled_since(
    database_url: str,
) -> None:
    """The other batch sent the message and settled it back to pending, to wait out a
    backoff, before the stale claim expired: recovery leaves the message as that settle
    left it (no backoff skipped, no attempt of the stale claim's recorded)."""
    message_id, sender, batch, stale, stale_batch = _sending_and_stale(database_url, 60)
    [message] = batch.messages
    failed = Settlement(
        message.id, message.fence, State.PENDING, AttemptOutcome.FAILED, retry_after=600.0,
        error="NotEnoughReplicasError", counts_as_failure=True,
    )  # fmt: skip
    assert sender.settle(batch, [failed]) == {message_id}
    settled = "SELECT state, fence, attempts, failures, available_at FROM outbox.messages"
    before = fetch_rows(database_url, settled)

    recovery = claiming_store(database_url)
    assert recovery.recover_expired_leases() == []

    assert fetch_rows(
        database_url, "SELECT settled_at IS NOT NULL FROM outbox.batches WHERE id = %s", stale_batch
    ) == [(True,)]
    assert fetch_rows(database_url, settled) == before
    assert fetch_rows(database_url, "SELECT outcome FROM outbox.attempts") == [("failed",)]
    for store in (sender, stale, recovery):
        store.close()


def test_a_message_two_expired_batches_name_is_uncertain_if_either_began_sending(
    database_url: str,
) -> None:
    """Recovered in one pass, a message named by a batch that began sending and by one
    that did not goes by the first's evidence: uncertain, never back to pending."""
    message_id, sender, batch, stale, _ = _sending_and_stale(database_url, 0.0)
    _expire(database_url, message_id)

    recovery = claiming_store(database_url)
    assert recovery.recover_expired_leases() == [
        Recovered(message_id, State.UNCERTAIN, 1, 1, batch.id, sender.publisher_id)
    ]
    assert fetch_rows(
        database_url, "SELECT count(*) FROM outbox.batches WHERE settled_at IS NULL"
    ) == [(0,)]
    for store in (sender, stale, recovery):
        store.close()


def test_a_mark_leaves_out_what_another_open_batch_names_and_names_it_no_more(
    database_url: str,
) -> None:
    """The stale claim's own mark sends only what no other open batch names, and its
    batch then names only that: a batch that began sending names exactly what it may
    have sent, the evidence its recovery goes by."""
    message_id, sender, _, stale, _ = _sending_and_stale(database_url, 60)
    [other] = _enqueue(database_url)
    stale_batch = _stale_claim(database_url, stale.publisher_id, message_id, other, expired=False)
    claimed = Batch(
        stale_batch,
        [ClaimedMessage(m, "t", None, b"v", [], fence=1, attempt=1) for m in (message_id, other)],
        claimed_at=datetime.now(UTC),
    )
    assert stale.mark_sending(claimed, {"t": 3}, write_deadline_seconds=60) == {other}
    assert fetch_rows(
        database_url, "SELECT message_ids FROM outbox.batches WHERE id = %s", stale_batch
    ) == [([other],)]
    _expire(database_url, other)
    recovered = claiming_store(database_url).recover_expired_leases()
    assert [(r.message_id, r.state) for r in recovered] == [(other, State.UNCERTAIN)]
    assert fetch_rows(
        database_url, "SELECT state, fence FROM outbox.message_status WHERE id = %s", message_id
    ) == [("in_flight", 0)]
    for store in (sender, stale):
        store.close()


def test_a_batch_that_never_sent_settles_nothing_another_open_batch_is_sending(
    database_url: str,
) -> None:
    """A stale claim whose Kafka transaction could not begin settles its messages back to
    pending unsent; the one another batch is sending is left as it is, and that batch's
    settle records its delivery."""
    message_id, sender, batch, stale, stale_batch = _sending_and_stale(database_url, 60)
    unsent = Settlement(
        message_id, 1, State.PENDING, AttemptOutcome.ABANDONED, error="no transaction",
        send_began=False,
    )  # fmt: skip
    claimed = Batch(
        stale_batch,
        [ClaimedMessage(message_id, "t", None, b"v", [], fence=1, attempt=1)],
        claimed_at=datetime.now(UTC),
    )
    assert stale.settle(claimed, [unsent]) == set()
    assert fetch_rows(database_url, "SELECT attempts, fence FROM outbox.messages") == [(0, 0)]
    _settle_delivered(sender, batch, message_id)
    for store in (sender, stale):
        store.close()


def test_two_batches_marked_by_an_earlier_version_recover_by_the_first_to_mark(
    database_url: str,
) -> None:
    """Marked before marks rewrote what a batch names, two batches that began sending can
    name one message: only the first to mark can have sent it (the later mark saw the
    first batch open and left the message out), so its evidence decides."""
    message_id, sender, batch, stale, stale_batch = _sending_and_stale(database_url, 0.0)
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE outbox.batches SET send_began_at = clock_timestamp() + interval '1 second', "
            "write_deadline = now() + interval '1 hour', confirmed_offsets = '{}' WHERE id = %s",
            (stale_batch,),
        )
    _expire(database_url, message_id)

    assert claiming_store(database_url).recover_expired_leases() == [
        Recovered(message_id, State.UNCERTAIN, 1, 1, batch.id, sender.publisher_id)
    ]
    assert fetch_rows(
        database_url, "SELECT batch_id, available_at <= now() FROM outbox.messages"
    ) == [(batch.id, True)]
    for store in (sender, stale):
        store.close()


def _keyed(database_url: str, count: int) -> list[uuid.UUID]:
    with psycopg.connect(database_url) as conn:
        return outbox.enqueue_many(
            conn, [outbox.Message("t", f"{i}", key="k") for i in range(count)]
        )


def _claimed(batch_id: int, *message_ids: uuid.UUID, fence: int = 1) -> Batch:
    """The Batch a stale claim's publisher holds: these messages, at this attempt's fence."""
    return Batch(
        batch_id,
        [ClaimedMessage(m, "t", b"k", b"v", [], fence=fence, attempt=1) for m in message_ids],
        claimed_at=datetime.now(UTC),
    )


def test_a_batch_that_began_settles_a_message_it_held_back_so_a_stale_claim_cannot_send_it(
    database_url: str,
) -> None:
    """Its first message failed and the second, of the same key, was held back unsent:
    the batch began sending, so it settles both (fences move on), and a stale claim of
    the two then sends neither, not the second before the first."""
    first, second = _keyed(database_url, 2)
    sender = claiming_store(database_url)
    sender.register("test", os.getpid(), 30)
    batch = sender.claim(10, lease_seconds=30)
    assert batch is not None
    assert sender.mark_sending(batch, {"t": 3}, write_deadline_seconds=60) == {first, second}
    stale = claiming_store(database_url)
    stale.register("test", os.getpid(), 30)
    stale_batch = _stale_claim(database_url, stale.publisher_id, first, second, expired=False)

    failed = Settlement(first, 1, State.PENDING, AttemptOutcome.FAILED, error="timed out")
    held_back = Settlement(
        second, 1, State.PENDING, AttemptOutcome.ABANDONED, error="held back", send_began=False
    )
    assert sender.settle(batch, [failed, held_back]) == {first, second}
    assert (
        stale.mark_sending(
            _claimed(stale_batch, first, second), {"t": 3}, write_deadline_seconds=60
        )
        == set()
    )
    for store in (sender, stale):
        store.close()


def test_a_mark_leaves_out_a_later_message_of_a_key_whose_earlier_one_it_left_out(
    database_url: str,
) -> None:
    """Another batch is sending the first message of a key; a stale claim of both may
    send neither: the second could reach Kafka before the first."""
    first, second = _keyed(database_url, 2)
    sender = claiming_store(database_url)
    sender.register("test", os.getpid(), 30)
    batch = sender.claim(1, lease_seconds=30)
    assert batch is not None
    assert sender.mark_sending(batch, {"t": 3}, write_deadline_seconds=60) == {first}
    stale = claiming_store(database_url)
    stale.register("test", os.getpid(), 30)
    stale_batch = _stale_claim(database_url, stale.publisher_id, first, second, expired=False)

    assert (
        stale.mark_sending(
            _claimed(stale_batch, first, second), {"t": 3}, write_deadline_seconds=60
        )
        == set()
    )
    assert fetch_rows(
        database_url, "SELECT message_ids FROM outbox.batches WHERE id = %s", stale_batch
    ) == [([],)]
    for store in (sender, stale):
        store.close()


def test_a_legacy_batch_that_marked_second_leaves_the_message_to_the_first_still_open(
    database_url: str,
) -> None:
    """Marked by an earlier version after the batch that is sending the message, and
    recovered alone while that one is still open: it cannot have sent the message, so
    recovery leaves it, and the sender's settle records the delivery."""
    message_id, sender, batch, stale, stale_batch = _sending_and_stale(database_url, 60)
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE outbox.batches SET send_began_at = clock_timestamp() + interval '1 second', "
            "write_deadline = now(), confirmed_offsets = '{}' WHERE id = %s",
            (stale_batch,),
        )

    assert claiming_store(database_url).recover_expired_leases() == []
    _settle_delivered(sender, batch, message_id)
    for store in (sender, stale):
        store.close()


def test_heartbeat_renews_only_leases_about_to_expire(database_url: str) -> None:
    """renew=True extends live leases within half a lease of expiry; renew=False only heartbeats."""
    _enqueue(database_url, 3)
    store = claiming_store(database_url)
    store.register("test", os.getpid(), 30)
    # One batch each: the lease is the batch's.
    soon, later, expired = (store.claim(1, lease_seconds=30) for _ in range(3))
    assert soon is not None
    assert later is not None
    assert expired is not None
    with psycopg.connect(database_url) as conn:
        for batch, offset in ((soon, "5"), (later, "25"), (expired, "-1")):
            conn.execute(
                "UPDATE outbox.batches "
                "SET lease_expires_at = now() + make_interval(secs => %s::float8) WHERE id = %s",
                (offset, batch.id),
            )
        conn.execute("UPDATE outbox.publishers SET heartbeat_at = now() - interval '1 hour'")

    def leases() -> dict[int, object]:
        return dict(fetch_rows(database_url, "SELECT id, lease_expires_at FROM outbox.batches"))

    def heartbeat_age() -> float:
        return float(
            fetch_rows(
                database_url,
                "SELECT extract(epoch FROM now() - heartbeat_at) FROM outbox.publishers",
            )[0][0]
        )

    before = leases()
    assert store.heartbeat(30, renew=False) == 0
    assert leases() == before
    assert heartbeat_age() < 60

    assert store.heartbeat(30, renew=True) == 1
    after = leases()
    assert after[later.id] == before[later.id]
    assert after[expired.id] == before[expired.id]
    [(renewed_ahead,)] = fetch_rows(
        database_url,
        "SELECT extract(epoch FROM lease_expires_at - now()) FROM outbox.batches WHERE id = %s",
        soon.id,
    )
    assert 25 < renewed_ahead <= 30
    store.close()


def test_nothing_at_all_is_no_work_and_never_due(database_url: str) -> None:
    """An empty outbox has no work left and nothing that will become due."""
    store = claiming_store(database_url)
    assert store.work_left() is False
    assert store.seconds_until_due() is None
    store.close()


def test_pending_message_is_work_due_now(database_url: str) -> None:
    """A claimable pending message is work left and due now; a backed-off one is due later."""
    [message_id] = _enqueue(database_url)
    store = claiming_store(database_url)
    assert store.work_left() is True
    due = store.seconds_until_due()
    assert due is not None
    assert due <= 0
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE outbox.messages SET available_at = now() + interval '40 seconds' WHERE id = %s",
            (message_id,),
        )
    due = store.seconds_until_due()
    assert due is not None
    assert 35 < due <= 40
    store.close()


def test_in_flight_message_is_work_due_when_its_lease_expires(database_url: str) -> None:
    """An in-flight message is work left, due when its lease expires."""
    _enqueue(database_url)
    store = claiming_store(database_url)
    assert store.claim(10, lease_seconds=30) is not None
    assert store.work_left() is True
    due = store.seconds_until_due()
    assert due is not None
    assert 25 < due <= 30
    store.close()


def test_uncertain_message_is_work_until_escalated(database_url: str) -> None:
    """An uncertain message is due at its write deadline, and no work once escalated."""
    [message_id] = _enqueue(database_url)
    store = claiming_store(database_url)
    batch = store.claim(10, lease_seconds=30)
    assert batch is not None
    store.mark_sending(batch, {"t": 3}, write_deadline_seconds=50)
    [m] = batch.messages
    uncertain = Settlement(
        m.id, m.fence, State.UNCERTAIN, AttemptOutcome.UNCERTAIN, partition=0, error="E"
    )
    assert store.settle(batch, [uncertain]) == {message_id}
    assert store.work_left() is True
    due = store.seconds_until_due()
    assert due is not None
    assert 45 < due <= 50

    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE outbox.messages SET escalated_at = now()")
    assert store.work_left() is False
    assert store.seconds_until_due() is None
    store.close()


def test_a_settle_changes_only_the_messages_its_batch_names(database_url: str) -> None:
    """A settle is refused for a message its batch does not name, whatever the publisher
    passes: the batch is the evidence of what its publisher may have sent."""
    [claimed_id] = _enqueue(database_url)
    sender = claiming_store(database_url)
    sender.register("test", os.getpid(), 30)
    batch = sender.claim(10, lease_seconds=30)
    assert batch is not None
    [other_id] = _enqueue(database_url)  # pending, named by no batch
    [message] = batch.messages
    settlements = [
        Settlement(
            message_id,
            message.fence,
            State.DELIVERED,
            AttemptOutcome.DELIVERED,
            partition=0,
            offset=offset,
        )
        for offset, message_id in enumerate((claimed_id, other_id))
    ]
    assert sender.settle(batch, settlements) == {claimed_id}
    assert fetch_rows(
        database_url, "SELECT id, state, fence, attempts FROM outbox.messages ORDER BY seq"
    ) == [(claimed_id, "delivered", 1, 1), (other_id, "pending", 0, 0)]
    assert fetch_rows(
        database_url,
        "SELECT topic, kafka_partition, confirmed_offset FROM outbox.partition_offsets",
    ) == [("t", 0, 0)]
    sender.close()
