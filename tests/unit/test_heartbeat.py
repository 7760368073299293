"""The heartbeat's turns (publisher/heartbeat.py), on a recording store: no database, no sleeps.

Against a real PostgreSQL: tests/integration/test_heartbeat_batches.py and
test_lane_handover.py.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import psycopg

from publisher.health import Contact, KafkaContact
from publisher.heartbeat import Heartbeat


class RecordingStore:
    """Records beats, lane balances and closes; fails the first ``failures`` beats."""

    def __init__(self, failures: int = 0) -> None:
        self.beats = 0
        self.closes = 0
        self.failures = failures
        self.beaten = threading.Event()

    def heartbeat(
        self, lease_seconds: float, *, renew: bool, batches: object, kafka_reached: object = None
    ) -> int:
        if self.failures:
            self.failures -= 1
            raise psycopg.OperationalError("the database went away")
        self.beats += 1
        self.beaten.set()
        return 0

    def close(self) -> None:
        self.closes += 1


class RecordingContact(Contact):
    """The database contact, recording each failure it is told of."""

    def __init__(self) -> None:
        super().__init__("database", clock=lambda: 0.0, wall=lambda: 0.0)
        self.failures: list[str] = []

    def failed(self, error: BaseException | str) -> None:
        self.failures.append(str(error))
        super().failed(error)


class RecordingLanes:
    """A lane keeper that counts its rebalances."""

    def __init__(self) -> None:
        self.balances = 0
        self.released = False
        self.owned: set[int] = set()

    def balance(self) -> set[int]:
        self.balances += 1
        return set()

    def release_all(self) -> None:
        self.released = True


def _heartbeat(store: RecordingStore, *, interval: float, **kwargs: Any) -> Heartbeat:
    return Heartbeat(
        cast(Any, store), interval=interval, lease_seconds=60, progressing=lambda: True, **kwargs
    )


def test_a_turn_between_beats_only_rebalances_the_lanes() -> None:
    """Before the beat interval is up, a turn rebalances the lanes and does not beat."""
    store, lanes = RecordingStore(), RecordingLanes()
    beat = _heartbeat(store, interval=30, lanes=cast(Any, lanes))
    beat.run_once()
    assert (store.beats, lanes.balances) == (0, 1)


def test_a_turn_beats_when_a_beat_is_due() -> None:
    """Once the interval is up, a turn beats (and rebalances the lanes with the beat)."""
    store, lanes = RecordingStore(), RecordingLanes()
    beat = _heartbeat(store, interval=0, lanes=cast(Any, lanes))
    beat.run_once()
    assert (store.beats, lanes.balances) == (1, 1)


def test_a_database_error_is_reported_and_the_next_turn_beats_again() -> None:
    """A failed beat marks the database failed and closes the connection; the thread goes on."""
    store = RecordingStore(failures=1)
    database = RecordingContact()
    beat = _heartbeat(store, interval=0, database=database)
    beat.start()
    try:
        assert store.beaten.wait(timeout=5)
    finally:
        beat.stop(timeout=5)
    assert database.failures == ["the database went away"]
    assert store.closes >= 2  # once after the failure, once on stop
    assert database.ok is True  # the later beat succeeded


def test_a_turn_while_the_loop_is_stuck_reports_no_database_contact() -> None:
    """With the loop stuck the heartbeat asks the database nothing, so it does not report a
    successful contact either: the health shows the stall, not a live database."""
    store, lanes, database = RecordingStore(), RecordingLanes(), RecordingContact()
    beat = _heartbeat(
        store, interval=0, lanes=cast(Any, lanes), database=database, loop_alive=lambda: False
    )
    beat.run_once()
    assert (store.beats, lanes.balances) == (0, 0)
    assert database.ok is None
    assert database.last_success_time is None


class HangingLanes(RecordingLanes):
    """A lane keeper whose rebalance hangs (its statement waits) until told to go on."""

    def __init__(self) -> None:
        super().__init__()
        self.owned = {3}
        self.entered = threading.Event()
        self.go_on = threading.Event()

    def balance(self) -> set[int]:
        self.entered.set()
        self.go_on.wait(timeout=10)
        return super().balance()


def test_a_turn_that_outlives_stop_keeps_its_connection_and_takes_no_more_lanes() -> None:
    """stop() gives up waiting for a hung turn: it neither gives the lanes back on the
    connection that turn is using nor closes it, and a later turn balances nothing."""
    store, lanes = RecordingStore(), HangingLanes()
    beat = _heartbeat(store, interval=0.01, lanes=cast(Any, lanes))
    beat.start()
    try:
        assert lanes.entered.wait(timeout=5)
        beat.stop(timeout=0.1)
        assert beat.running
        assert (lanes.released, store.closes) == (False, 0)
    finally:
        lanes.go_on.set()
    beat.stop(timeout=5)
    assert not beat.running
    assert lanes.balances == 1  # the hung one only: none after the stop
    assert (lanes.released, store.closes) == (True, 1)


def test_stop_gives_the_lanes_back_and_closes_the_connection() -> None:
    """stop() releases every lane and closes the heartbeat's store, started or not."""
    store, lanes = RecordingStore(), RecordingLanes()
    beat = _heartbeat(store, interval=30, lanes=cast(Any, lanes))
    beat.stop()
    assert lanes.released
    assert store.closes == 1


class KafkaPeersStore(RecordingStore):
    """Also says whether another live publisher reaches Kafka, and records each report of
    this one's."""

    def __init__(self) -> None:
        super().__init__()
        self.others_reach = True
        self.reports: list[object] = []

    def heartbeat(
        self, lease_seconds: float, *, renew: bool, batches: object, kafka_reached: object = None
    ) -> int:
        self.reports.append(kafka_reached)
        return super().heartbeat(lease_seconds, renew=renew, batches=batches)

    def others_reach_kafka(self, lease_seconds: float) -> bool:
        return self.others_reach


class SteppingBack:
    """A heartbeat with a Kafka contact and peers, on a clock the test turns: ``at(t)`` runs
    a turn at ``t`` and says whether it stepped back."""

    def __init__(self) -> None:
        self.now = 0.0
        self.kafka = KafkaContact(lambda: self.now, lambda: 0.0)
        self.store = KafkaPeersStore()
        self.beat = Heartbeat(
            cast(Any, self.store), interval=1, lease_seconds=10, progressing=lambda: True,
            kafka=self.kafka, clock=lambda: self.now,
        )  # fmt: skip

    def at(self, t: float) -> bool:
        self.now = t
        self.beat.run_once()
        return self.beat.stepped_back


def test_a_publisher_whose_writes_fail_steps_back_and_tries_again_after_a_growing_hold_off() -> (
    None
):
    """Writes failing for a lease while another publisher reaches Kafka: it stops beating.
    The brokers answering it again bring it back only after the hold-off (a lease, then
    two, ...); failing a lease again after it came back, it stays back twice as long. A
    write that goes through ends it all, and the hold-off starts short again."""
    heartbeat = SteppingBack()
    kafka, store, at = heartbeat.kafka, heartbeat.store, heartbeat.at
    kafka.succeeded()
    assert not at(1.0)
    assert store.reports[-1] is True
    kafka.failed(TimeoutError("no leader answers"))
    kafka.answered()  # a topic lookup: the broker is there, the writes still fail
    assert not at(10.5)  # failing for 9.5s
    assert store.reports[-1] is False  # it no longer tells the others it reaches Kafka
    assert at(11.5)  # 10.5s: back, for a lease at least
    beats = store.beats
    assert at(21.0)  # the hold-off (10s) is not over
    assert store.beats == beats  # no heartbeat while back
    assert not at(21.6)  # over, and the brokers answer: it tries again
    assert not at(31.0)  # a lease to try
    assert at(31.7)  # failed again for a lease since it came back: back for 20s
    assert at(51.0)
    assert not at(51.8)
    kafka.succeeded()  # a write goes through
    assert not at(70.0)
    kafka.failed(TimeoutError("no leader answers"))
    assert at(80.5)  # a lease after the new failure
    assert at(90.6)  # the hold-off (a lease again) is over, but no broker answers it
    kafka.answered()  # its idle probe reaches a broker
    assert not at(91.0)


def test_a_publisher_whose_writes_fail_stays_when_no_other_reaches_kafka() -> None:
    """Stepping back gives its lanes to nobody who does better: when no other publisher
    reaches Kafka, it stays, and one that stepped back comes back at once."""
    heartbeat = SteppingBack()
    heartbeat.kafka.failed(TimeoutError("no broker answers"))
    assert heartbeat.at(11.0)
    heartbeat.store.others_reach = False
    assert not heartbeat.at(12.0)
    assert not heartbeat.at(40.0)
