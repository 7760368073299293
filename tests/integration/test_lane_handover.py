"""A publisher that starts gets its share of the lanes within seconds, not heartbeats."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

import outbox
from outbox.states import State
from publisher.health import Contact
from publisher.heartbeat import Heartbeat
from publisher.lanes import LaneKeeper
from publisher.outcomes import AttemptOutcome
from publisher.store import Batch, ClaimedMessage, PublisherStore, Settlement
from tests.support import ClaimingStore, claiming_store, fetch_rows, wait_until

pytestmark = pytest.mark.integration

LANES = 32


def _heartbeat(
    database_url: str,
    *,
    interval: float = 30,
    lease_seconds: float = 60,
    loop_alive: Callable[[], bool] = lambda: True,
    kafka: Contact | None = None,
) -> tuple[PublisherStore, Heartbeat]:
    store = PublisherStore(database_url, uuid.uuid4())
    store.register("test", 0, lease_seconds)
    # By default a heartbeat interval far longer than the handover may take.
    beat = Heartbeat(
        store,
        interval=interval,
        lease_seconds=lease_seconds,
        progressing=lambda: True,
        lanes=LaneKeeper(store, lease_seconds),
        loop_alive=loop_alive,
        kafka=kafka,
    )
    beat.beat()
    beat.start()
    return store, beat


def _owned(database_url: str, store: PublisherStore) -> int:
    [(count,)] = fetch_rows(
        database_url, "SELECT count(*) FROM outbox.lanes WHERE owner = %s", store.publisher_id
    )
    return int(count)


def test_the_first_publisher_gives_half_its_lanes_to_a_second_within_seconds(
    database_url: str,
) -> None:
    """With 30 s heartbeats, lanes still move within a few seconds of the second start."""
    first, first_beat = _heartbeat(database_url)
    second_beat = None
    try:
        assert _owned(database_url, first) == LANES
        second, second_beat = _heartbeat(database_url)
        wait_until(
            lambda: _owned(database_url, second) == LANES // 2,
            timeout=8,
            what="the second publisher to own half the lanes",
        )
        assert _owned(database_url, first) == LANES // 2
    finally:
        if second_beat is not None:
            second_beat.stop()
        first_beat.stop()


def test_a_publisher_whose_loop_stopped_turning_lets_its_lanes_go_to_the_others(
    database_url: str,
) -> None:
    """It stops beating and renewing lanes: they expire and move; they come back after."""
    alive = [True]
    stuck, stuck_beat = _heartbeat(
        database_url, interval=1, lease_seconds=3, loop_alive=lambda: alive[0]
    )
    other_beat = None
    try:
        other, other_beat = _heartbeat(database_url, interval=1, lease_seconds=3)
        wait_until(
            lambda: _owned(database_url, other) == LANES // 2,
            timeout=8,
            what="the lanes to be shared",
        )
        alive[0] = False
        wait_until(
            lambda: _owned(database_url, other) == LANES,
            timeout=15,
            what="the stuck publisher's lanes to move to the other one",
        )
        assert _owned(database_url, stuck) == 0
        alive[0] = True  # it turns again: it takes its share back
        wait_until(
            lambda: _owned(database_url, stuck) == LANES // 2,
            timeout=15,
            what="the recovered publisher to take its share again",
        )
    finally:
        if other_beat is not None:
            other_beat.stop()
        stuck_beat.stop()


def _kafka(*, reached: bool) -> Contact:
    """A Kafka contact whose last contact succeeded (``reached``) or failed."""
    contact = Contact("kafka", time.monotonic, time.time)
    if reached:
        contact.succeeded()
    else:
        contact.failed("the brokers do not answer")
    return contact


def test_a_publisher_that_cannot_reach_kafka_lets_its_lanes_go_to_one_that_can(
    database_url: str,
) -> None:
    """Cut off from Kafka for a lease while another publisher reaches it, a publisher stops
    beating: its lanes expire and the other takes them all. Once it reaches Kafka again,
    it beats and takes its share back."""
    cut_off = _kafka(reached=True)
    lonely, lonely_beat = _heartbeat(database_url, interval=1, lease_seconds=3, kafka=cut_off)
    other_beat = None
    try:
        other, other_beat = _heartbeat(
            database_url, interval=1, lease_seconds=3, kafka=_kafka(reached=True)
        )
        wait_until(
            lambda: _owned(database_url, other) == LANES // 2,
            timeout=8,
            what="the lanes to be shared",
        )
        cut_off.failed("the brokers do not answer")
        wait_until(
            lambda: _owned(database_url, other) == LANES,
            timeout=20,
            what="the lanes of the publisher cut off from Kafka to move to the other one",
        )
        assert _owned(database_url, lonely) == 0
        assert lonely_beat.stepped_back
        cut_off.succeeded()  # its probe reaches the brokers again
        wait_until(
            lambda: _owned(database_url, lonely) == LANES // 2,
            timeout=15,
            what="the publisher that reaches Kafka again to take its share again",
        )
        assert not lonely_beat.stepped_back
    finally:
        if other_beat is not None:
            other_beat.stop()
        lonely_beat.stop()


def test_when_no_publisher_reaches_kafka_none_lets_its_lanes_go(database_url: str) -> None:
    """Kafka away for all: stepping back would give the lanes to no one who can do better,
    and leave none held (the status would say no publisher runs). They stay shared."""
    beats = []
    contacts = [_kafka(reached=True) for _ in range(2)]
    try:
        stores = []
        for contact in contacts:
            store, beat = _heartbeat(database_url, interval=1, lease_seconds=2, kafka=contact)
            stores.append(store)
            beats.append(beat)
        wait_until(
            lambda: [_owned(database_url, s) for s in stores] == [LANES // 2] * 2,
            timeout=8,
            what="the lanes to be shared",
        )
        for contact in contacts:
            contact.failed("the brokers do not answer")
        # Both have not reached Kafka for a lease, twice over, and their reports age out:
        # neither steps back, and both keep their lanes.
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            assert not any(beat.stepped_back for beat in beats)
            assert [_owned(database_url, s) for s in stores] == [LANES // 2] * 2
            time.sleep(0.2)
    finally:
        for beat in beats:
            beat.stop()


def test_a_dead_publisher_is_judged_by_its_own_lease_not_the_survivors(
    database_url: str,
) -> None:
    """Leases differ (a rolling change of --lease-seconds): the one with a 3 s lease dies;
    the survivor, whose lease is 60 s, takes its lanes once they expire, not after 60 s
    (it counted the dead one live for its own lease)."""
    dead, dead_beat = _heartbeat(database_url, interval=1, lease_seconds=3)
    survivor_beat = None
    try:
        survivor, survivor_beat = _heartbeat(database_url, interval=1, lease_seconds=60)
        wait_until(
            lambda: _owned(database_url, survivor) == LANES // 2,
            timeout=8,
            what="the lanes to be shared",
        )
        dead_beat.stop(give_lanes_back=False)  # it dies: no stop record, lanes kept
        wait_until(
            lambda: _owned(database_url, survivor) == LANES,
            timeout=15,
            what="the dead publisher's lanes to move to the survivor",
        )
        assert _owned(database_url, dead) == 0
    finally:
        if survivor_beat is not None:
            survivor_beat.stop()
        dead_beat.stop()


def _stale_claim_of(database_url: str, store: ClaimingStore, batch: Batch) -> Batch:
    """The batch a claim of ``store`` would have made had it read ``batch``'s messages with a
    snapshot from before ``batch`` was claimed (its lane left and came back meanwhile)."""
    [(batch_id, claimed_at)] = fetch_rows(
        database_url,
        "INSERT INTO outbox.batches (publisher_id, lease_expires_at, message_ids) "
        "VALUES (%s, now() + interval '1 hour', %s) RETURNING id, claimed_at",
        store.publisher_id,
        [m.id for m in batch.messages],
    )
    return Batch(id=batch_id, messages=batch.messages, claimed_at=claimed_at)


def test_a_claim_that_read_a_message_before_another_claimed_it_does_not_send_it(
    database_url: str,
) -> None:
    """A claim's snapshot predates another publisher's claim of a message (the lane left and
    came back within the claim's statement): its batch names the message too. Marking it
    sending leaves the message out while the other batch is open, and after that batch
    settled it back to pending (its fence moved on): it is sent once, by the other."""
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, "t", b"v", key="k")
    other = claiming_store(database_url)
    try:
        theirs = other.claim(10, 30.0)
        assert theirs is not None
        assert [m.id for m in theirs.messages] == [message_id]
        mine = claiming_store(database_url)
        try:
            stale = _stale_claim_of(database_url, mine, theirs)
            assert mine.mark_sending(stale, {"t": 1}, 30.0) == set()

            # The other batch settles the message back to pending (a retry).
            other.settle(theirs, [_retry(theirs.messages[0])])
            stale = _stale_claim_of(database_url, mine, theirs)
            assert mine.mark_sending(stale, {"t": 1}, 30.0) == set()
        finally:
            mine.close()
    finally:
        other.close()


def _retry(m: ClaimedMessage) -> Settlement:
    return Settlement(
        message_id=m.id,
        fence=m.fence,
        state=State.PENDING,
        attempt_outcome=AttemptOutcome.FAILED,
        error="retry",
        retry_after=0.0,
    )


class StoppingStore(PublisherStore):
    """A store whose process stops (SIGSTOP, a paused host) inside renew_lanes, between its
    two statements, until ``go`` is set."""

    def __init__(self, database_url: str, *, idle_transaction_limit: float) -> None:
        super().__init__(database_url, uuid.uuid4(), idle_transaction_limit=idle_transaction_limit)
        self.stopped = threading.Event()
        self.go = threading.Event()

    def _sql(self, name: str) -> str:
        if name == "fair_share":  # renew_lanes ran; its lane rows are locked
            self.stopped.set()
            self.go.wait(60)
        return super()._sql(name)


@pytest.mark.parametrize("limited", [True, False], ids=["limited", "unlimited"])
def test_a_publisher_stopped_inside_its_lane_renewal_does_not_hold_its_lanes_for_ever(
    database_url: str, *, limited: bool
) -> None:
    """Stopped between renew_lanes and the commit, a publisher keeps its lane rows locked:
    a claim of free or expired lanes skips locked rows, so no other publisher could take
    them, whatever their leases said. The server ends such a session once its transaction
    has been idle ``idle_transaction_limit``: the lanes go to the others once their leases
    run out (without the limit, they stay), and the stopped publisher, woken, sees a lost
    connection, which it retries, not an error that would end its heartbeat."""
    frozen = StoppingStore(database_url, idle_transaction_limit=0.5 if limited else 3600.0)
    other = PublisherStore(database_url, uuid.uuid4())
    try:
        assert len(frozen.acquire_lanes(LANES, lease_seconds=1.0)) == LANES
        with ThreadPoolExecutor(1) as pool:
            renewal = pool.submit(frozen.renew_lanes, 1.0)
            assert frozen.stopped.wait(10)
            taken: set[int] = set()

            def others_take_them() -> bool:
                taken.update(other.acquire_lanes(LANES, lease_seconds=30.0))
                return len(taken) == LANES

            try:
                if limited:
                    wait_until(others_take_them, timeout=15, what="the others to take the lanes")
                else:
                    with pytest.raises(AssertionError):
                        wait_until(others_take_them, timeout=3, what="the lanes, still locked")
                    assert taken == set()
            finally:
                frozen.go.set()
            if limited:
                with pytest.raises(psycopg.OperationalError, match="ended this session"):
                    renewal.result(timeout=10)
                assert frozen.renew_lanes(1.0)[0] == set()  # reconnected; the lanes are gone
            else:
                assert renewal.result(timeout=10)[0] == set(range(LANES))
    finally:
        frozen.close()
        other.close()
