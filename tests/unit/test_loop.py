"""The publisher loop (publisher/loop.py) against a fake store and a fake sink.

The fakes record every call in one shared event list, so the tests can check
what happened and in which order (e.g. the producer is discarded before the
outcome is recorded).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from kafka import errors as kafka_errors

from outbox.ids import new_message_id
from outbox.states import State
from publisher.config import PublisherConfig
from publisher.loop import HAND_OVER_CLOSED, OUTAGE, Publisher
from publisher.outcomes import AttemptOutcome, TransactionEnd, refuses_publisher
from publisher.partitioning import partition_for
from publisher.reconciler import Reconciler, ReconcileReport
from publisher.sink import (
    OutgoingRecord,
    ProducerUnavailable,
    SendReport,
    SendWindow,
    hand_over_closed,
    held_back,
    key_identity,
    transaction_failed,
)
from publisher.store import Batch, ClaimedMessage, PublisherStore, Recovered, Settlement
from publisher.waker import Waker

CONFIG = PublisherConfig(database_url="postgresql://x", kafka_bootstrap="h:1")

#: A record the producer did not take, for a reason that is not an outage:
#: it counts as a failure toward --max-attempts.
_NOT_TAKEN = kafka_errors.IllegalStateError("the producer refused the record")


class FakeStore(PublisherStore):
    """A PublisherStore that never connects: claims come from a list, settles are recorded."""

    def __init__(self, events: list[str], batches: Sequence[Batch | None] = ()) -> None:
        super().__init__("postgresql://unused", uuid.uuid4())
        self.events = events
        self.batches = list(batches)
        self.settled: list[list[Settlement]] = []
        #: Ids that the settle statement "did not change" (a stale fence).
        self.stale_ids: set[uuid.UUID] = set()
        self.registered: list[tuple[str, int]] = []
        #: Whether anything is left to do, and in how many seconds (None: nothing).
        self.work: bool = False
        self.next_due: float | None = None
        #: The stale_holds argument of each work_left.
        self.asked_stale_holds: list[bool] = []
        #: Message ids that recovery took away before sending began.
        self.lost_before_sending: set[uuid.UUID] = set()
        #: What the next recovery pass moves.
        self.recovered: list[Recovered] = []
        #: The transactional.id each mark_sending recorded.
        self.transactional_ids: list[str | None] = []
        #: The write deadline (seconds after the mark) each mark_sending was given.
        self.write_deadlines: list[float] = []
        #: What the next marks raise, in turn (None: that mark succeeds).
        self.mark_errors: list[Exception | None] = []

    @property
    def conn(self) -> Any:
        """A unit test never reaches the database."""
        raise AssertionError("the fake store has no database connection")

    def close(self) -> None:
        """Record the close."""
        self.events.append("store.close")

    def register(self, version: str, pid: int, lease_seconds: float) -> None:
        """Record the registration."""
        self.events.append("register")
        self.registered.append((version, pid))

    def heartbeat(
        self,
        lease_seconds: float,
        *,
        renew: bool,
        batches: Collection[int] | None = None,
        kafka_reached: bool | None = None,
    ) -> int:
        """Record the heartbeat."""
        self.events.append("heartbeat")
        return 0

    def mark_stopped(self) -> None:
        """Record the clean stop."""
        self.events.append("mark_stopped")

    def claim(
        self, limit: int, lease_seconds: float, *, horizon: int | None = None
    ) -> Batch | None:
        """Hand out the next prepared batch, then None."""
        self.events.append("claim")
        return self.batches.pop(0) if self.batches else None

    def settle(self, batch: Batch, settlements: Sequence[Settlement]) -> set[uuid.UUID]:
        """Record the settlements; report every id changed except the stale ones."""
        self.events.append("settle")
        self.settled.append(list(settlements))
        return {s.message_id for s in settlements} - self.stale_ids

    def settled_by(self, batch: Batch, ids: Collection[uuid.UUID]) -> set[uuid.UUID]:
        """The ids of ``ids`` an earlier settle of the batch recorded (and not as stale)."""
        self.events.append("settled_by")
        recorded = {s.message_id for settled in self.settled for s in settled}
        return (recorded - self.stale_ids) & set(ids)

    def mark_sending(
        self,
        batch: Batch,
        partition_counts: Mapping[str, int],
        write_deadline_seconds: float,
        transactional_id: str | None = None,
    ) -> set[uuid.UUID]:
        """Record the mark; every message is still held except those declared lost.
        The first of ``mark_errors`` left, if any, says whether it raises instead."""
        self.events.append("mark_sending")
        error = self.mark_errors.pop(0) if self.mark_errors else None
        if error is not None:
            raise error
        self.transactional_ids.append(transactional_id)
        self.write_deadlines.append(write_deadline_seconds)
        return {m.id for m in batch.messages} - self.lost_before_sending

    def recover_expired_leases(self, limit: int = 1000) -> list[Recovered]:
        """What ``recovered`` holds (nothing, unless a test put something there), once."""
        self.events.append("recover")
        moved, self.recovered = self.recovered, []
        return moved

    def work_left(self, *, stale_holds: bool = False) -> bool:
        """The prepared answer."""
        self.events.append("work_left")
        self.asked_stale_holds.append(stale_holds)
        return self.work

    def seconds_until_due(self) -> float | None:
        """The prepared answer (None: nothing due)."""
        self.events.append("seconds_until_due")
        return self.next_due


class FakeSink:
    """A Sink that records what it is asked to send and answers from a table."""

    def __init__(self, events: list[str], partitions: dict[str, int] | None = None) -> None:
        self.events = events
        #: Partition count per topic; a topic missing here cannot be described.
        self.partitions = partitions if partitions is not None else {"orders": 3}
        #: The report for a message id; any other record is confirmed at its partition.
        self.reports: dict[uuid.UUID, SendReport] = {}
        self.sent: list[OutgoingRecord] = []
        self.batches_sent = 0
        self._next_offset = 100
        #: The clock the hand-over window is read on, and each send's window.
        self.now: Callable[[], float] = time.monotonic
        self.windows: list[SendWindow | None] = []
        #: Records whose turn came after their window: never handed over.
        self.closed: set[uuid.UUID] = set()
        #: Raised by every topic lookup when set.
        self.lookup_error: BaseException | None = None

    def partition_count(self, topic: str) -> int:
        """The configured partition count, or the error Kafka gives for an unknown topic
        (or ``lookup_error``, when set: no broker answers)."""
        self.events.append(f"partition_count:{topic}")
        if self.lookup_error is not None:
            raise self.lookup_error
        if topic not in self.partitions:
            raise kafka_errors.UnknownTopicOrPartitionError(f"topic {topic!r} has no partitions")
        return self.partitions[topic]

    def send(
        self, records: Sequence[OutgoingRecord], *, window: SendWindow | None = None
    ) -> list[OutgoingRecord]:
        """Record the records handed over (none once the hand-over window closed)."""
        self.events.append("send")
        self.windows.append(window)
        if window is not None and self.now() > window.hand_over_until:
            self.closed.update(r.message_id for r in records)
            return list(records)
        self.batches_sent += 1
        self.sent.extend(records)
        return list(records)

    def complete(self, in_flight: Any) -> list[SendReport]:
        """Report on each record handed over, in order."""
        self.events.append("complete")
        result = []
        refused_keys = set()
        for r in in_flight:
            if r.message_id in self.closed:
                result.append(hand_over_closed())
                continue
            # As the real sinks do: after a refusal by send(), later records of
            # the key are not handed over.
            if key_identity(r) is not None and key_identity(r) in refused_keys:
                result.append(held_back())
                continue
            report = self.reports.get(r.message_id)
            if report is not None and not report.handed_to_producer:
                refused_keys.add(key_identity(r))
            if report is None:
                report = SendReport(r.partition, self._next_offset, None, handed_to_producer=True)
                self._next_offset += 1
            result.append(report)
        return result

    def discard_producer(self) -> None:
        """Record the discard."""
        self.events.append("discard_producer")
        self.in_transaction = False

    #: How the next transaction ends when committed (transactional tests set it).
    commit_ends = TransactionEnd.COMMITTED

    @property
    def transactional_id(self) -> str | None:
        """A session id once a transaction was begun."""
        return "outbox-test-1" if "begin" in self.events else None

    #: A transaction was begun and not ended (nor its session discarded).
    in_transaction = False

    def begin_transaction(self) -> None:
        """Record the begin; refuse it, as a producer does, while a transaction is open."""
        self.events.append("begin")
        if self.in_transaction:
            raise kafka_errors.KafkaError(
                "Invalid transition from IN_TRANSACTION to IN_TRANSACTION"
            )
        self.in_transaction = True

    def end_transaction(self, *, commit: bool) -> TransactionEnd:
        """Record the commit or abort; a commit ends as ``commit_ends`` says."""
        self.events.append("commit" if commit else "abort")
        self.in_transaction = False
        return self.commit_ends if commit else TransactionEnd.ABORTED

    def close(self) -> None:
        """Record the close."""
        self.events.append("sink.close")


def _message(
    topic: str = "orders",
    *,
    key: bytes | None = b"customer-7",
    headers: list[tuple[str, bytes]] | None = None,
    fence: int = 1,
    attempt: int = 1,
) -> ClaimedMessage:
    """A claimed message whose earlier attempts all ended "not written"."""
    return ClaimedMessage(
        id=new_message_id(),
        topic=topic,
        key=key,
        value=b'{"id":1}',
        headers=headers if headers is not None else [],
        fence=fence,
        attempt=attempt,
        failures=attempt - 1,
    )


def _batch(*messages: ClaimedMessage) -> Batch:
    return Batch(id=7, messages=list(messages), claimed_at=datetime(2025, 1, 1, tzinfo=UTC))


def _publisher(
    store: FakeStore, sink: FakeSink, config: PublisherConfig = CONFIG, **kwargs: Any
) -> Publisher:
    clock: Callable[[], float] = kwargs.pop("clock", lambda: 1_000.0)
    return Publisher(config, store, sink, Waker(None), clock=clock, **kwargs)


def _setup(
    *messages: ClaimedMessage, partitions: dict[str, int] | None = None
) -> tuple[list[str], FakeStore, FakeSink, Publisher]:
    events: list[str] = []
    store = FakeStore(events, [_batch(*messages)])
    sink = FakeSink(events, partitions)
    return events, store, sink, _publisher(store, sink)


def test_run_once_settles_every_outcome_in_batch_order() -> None:
    """Confirmed, refused, uncertain and too-large records settle once, in order, as designed."""
    ok, refused, unknown, too_large = (_message(attempt=2, key=f"k{i}".encode()) for i in range(4))
    _, store, sink, publisher = _setup(ok, refused, unknown, too_large)
    sink.reports = {
        refused.id: SendReport(None, None, _NOT_TAKEN, handed_to_producer=False),
        unknown.id: SendReport(
            None, None, kafka_errors.KafkaTimeoutError("Expiring 1 record(s)"), True
        ),
        too_large.id: SendReport(None, None, kafka_errors.MessageSizeTooLargeError(), True),
    }

    assert publisher.run_once() == 4

    assert len(store.settled) == 1
    settled = store.settled[0]
    assert [s.message_id for s in settled] == [ok.id, refused.id, unknown.id, too_large.id]
    assert [s.state for s in settled] == [
        State.DELIVERED,
        State.PENDING,
        State.UNCERTAIN,
        State.QUARANTINED,
    ]
    assert [s.attempt_outcome for s in settled] == ["delivered", "failed", "uncertain", "failed"]
    assert [s.send_began for s in settled] == [True, False, True, True]
    assert all(s.fence == 1 for s in settled)

    delivered, pending, uncertain, quarantined = settled
    expected_partition = partition_for(ok.key, ok.id, 3)
    assert (delivered.partition, delivered.offset, delivered.error) == (
        expected_partition,
        100,
        None,
    )
    # Backoff of attempt 2: full jitter in (0, base * 2].
    assert 0 < pending.retry_after <= CONFIG.retry_base_seconds * 2
    assert pending.error is not None
    assert pending.error.startswith("IllegalStateError: ")
    assert uncertain.retry_after == 0.0
    assert uncertain.offset is None
    assert uncertain.partition == partition_for(unknown.key, unknown.id, 3)
    assert quarantined.error is not None
    assert quarantined.error.startswith("MessageSizeTooLargeError")

    t = publisher.totals
    assert (t.batches, t.delivered, t.retried, t.uncertain, t.quarantined, t.stale) == (
        1,
        1,
        1,
        1,
        1,
        0,
    )


@pytest.mark.parametrize(
    ("report", "discarded"),
    [
        (SendReport(None, None, kafka_errors.KafkaTimeoutError("Expiring"), True), True),
        (SendReport(None, None, kafka_errors.RequestTimedOutError(), True), True),
        (SendReport(None, None, kafka_errors.NotEnoughReplicasAfterAppendError(), True), True),
        (SendReport(None, None, kafka_errors.KafkaTimeoutError("metadata"), False), False),
        # A record the broker refused leaves kafka-python's idempotent producer
        # in a fatal state, so that producer is dropped too.
        (SendReport(None, None, kafka_errors.MessageSizeTooLargeError(), True), True),
        (None, False),
    ],
    ids=["expired", "request-timeout", "not-enough-replicas", "refused", "too-large", "all-ok"],
)
def test_producer_is_discarded_before_settling_only_after_an_uncertain_outcome(
    report: SendReport | None, discarded: bool
) -> None:
    """discard_producer runs before settle after an uncertain outcome or a broker refusal only."""
    first, second = _message(), _message()
    events, _, sink, publisher = _setup(first, second)
    if report is not None:
        sink.reports[second.id] = report

    publisher.run_once()

    assert ("discard_producer" in events) is discarded
    if discarded:
        assert events.count("discard_producer") == 1
        assert events.index("send") < events.index("discard_producer")
        assert events.index("discard_producer") < events.index("settle")


def test_records_carry_the_outbox_id_header_after_the_users_and_the_chosen_partition() -> None:
    """Each record has the user's headers then ('outbox-id', id), and partition_for's partition."""
    keyed = _message(key=b"customer-7", headers=[("trace", b"t1"), ("content-type", b"x")])
    unkeyed = _message(key=None, headers=[])
    repeated = _message(key=b"key-3", headers=[("tag", b"a"), ("tag", b"b")])
    _, _, sink, publisher = _setup(keyed, unkeyed, repeated, partitions={"orders": 7})

    publisher.run_once()

    assert [r.message_id for r in sink.sent] == [keyed.id, unkeyed.id, repeated.id]
    for message, record in zip([keyed, unkeyed, repeated], sink.sent, strict=True):
        assert record.headers == [*message.headers, ("outbox-id", str(message.id).encode())]
        assert record.partition == partition_for(message.key, message.id, 7)
        assert (record.topic, record.key, record.value) == (
            message.topic,
            message.key,
            message.value,
        )
    assert sink.sent[0].partition == 6  # "customer-7" over 7 partitions, as the Java client


def test_a_topic_that_cannot_be_described_is_not_sent_but_others_are() -> None:
    """Messages of a topic that cannot be described go back to pending unsent; others are sent."""
    a = _message("orders")
    lost1 = _message("missing")
    b = _message("orders")
    lost2 = _message("missing")
    _, store, sink, publisher = _setup(a, lost1, b, lost2, partitions={"orders": 3})

    publisher.run_once()

    assert [r.message_id for r in sink.sent] == [a.id, b.id]
    settled = {s.message_id: s for s in store.settled[0]}
    assert [s.message_id for s in store.settled[0]] == [a.id, lost1.id, b.id, lost2.id]
    for lost in (lost1, lost2):
        s = settled[lost.id]
        assert (s.state, s.attempt_outcome, s.send_began, s.partition) == (
            State.PENDING,
            "failed",
            False,
            None,
        )
        assert s.retry_after > 0
        assert s.counts_as_failure is True  # its first: its key stays held while it waits
        assert s.error is not None
        assert "UnknownTopicOrPartitionError" in s.error
    assert settled[a.id].state is State.DELIVERED
    assert settled[b.id].state is State.DELIVERED
    assert publisher.totals.retried == 2


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (kafka_errors.KafkaTimeoutError("Unable to bootstrap from 127.0.0.1:1"), "Unable to"),
        (kafka_errors.TransactionalIdAuthorizationFailedError(), "grant the publisher's"),
    ],
    ids=["no-broker", "transactional-id-refused"],
)
def test_with_no_broker_to_answer_one_topic_lookup_stands_for_the_batch(
    error: Exception, said: str
) -> None:
    """The first lookup finds no broker, or a broker that refuses the publisher itself:
    the batch's other topics are not looked up (each would meet the same), and every
    message goes back to pending as in any outage."""
    messages = [_message(topic) for topic in ("orders", "payments", "audit")]
    events, store, sink, publisher = _setup(*messages, partitions={"orders": 3})
    sink.lookup_error = error

    publisher.run_once()

    assert [e for e in events if e.startswith("partition_count")] == ["partition_count:audit"]
    assert sink.sent == []
    for s in store.settled[0]:
        assert (s.state, s.send_began) == (State.PENDING, False)
        assert s.error is not None
        assert said in s.error
    assert set(publisher._failure_class.values()) == {OUTAGE}


def test_a_batch_whose_only_topic_cannot_be_described_sends_nothing() -> None:
    """When no record of the batch can be sent, the sink is not asked to send an empty batch."""
    lost = _message("missing")
    events, store, _, publisher = _setup(lost, partitions={})

    publisher.run_once()

    assert "send" not in events
    assert [s.state for s in store.settled[0]] == [State.PENDING]


def test_a_stop_requested_before_the_claim_releases_the_batch_unsent() -> None:
    """After request_stop, a claimed batch is released as pending, abandoned, never sent."""
    messages = [_message(), _message(key=None)]
    events, store, sink, publisher = _setup(*messages)

    publisher.request_stop()
    assert publisher.run_once() == 2

    assert sink.sent == []
    assert "send" not in events
    assert len(store.settled) == 1
    for message, s in zip(messages, store.settled[0], strict=True):
        assert s.message_id == message.id
        assert s.fence == message.fence
        assert (s.state, s.attempt_outcome, s.send_began) == (State.PENDING, "abandoned", False)
    assert publisher.totals.released == 2


def test_run_once_without_work_claims_and_does_nothing_else() -> None:
    """When the claim finds nothing, run_once returns 0 without sending or settling."""
    events: list[str] = []
    store, sink = FakeStore(events, []), FakeSink(events)

    assert _publisher(store, sink).run_once() == 0
    assert events == ["claim"]


class AbsentAtStartStore(FakeStore):
    """A database that does not answer the first ``refusals`` registrations."""

    def __init__(self, events: list[str], refusals: int) -> None:
        super().__init__(events, [])
        self.refusals = refusals

    def register(self, version: str, pid: int, lease_seconds: float) -> None:
        if self.refusals:
            self.refusals -= 1
            self.events.append("register refused")
            raise psycopg.OperationalError("connection refused")
        super().register(version, pid, lease_seconds)


def test_a_database_away_at_start_is_waited_for_then_the_publisher_runs() -> None:
    """The first registrations fail (the database restarts): the publisher waits and tries
    again, as it does at any other time, instead of exiting with a traceback."""
    events: list[str] = []
    store = AbsentAtStartStore(events, refusals=2)
    config = replace(CONFIG, exit_when_idle=True, poll_interval=0.01)
    publisher = _publisher(store, FakeSink(events), config)

    publisher.run()

    assert [e for e in events if e.startswith("register")] == [
        "register refused",
        "register refused",
        "register",
    ]
    assert "claim" in events
    assert publisher.health.database.ok is True


def test_a_stop_while_the_database_is_away_at_start_still_shuts_down_cleanly() -> None:
    """Asked to stop before the database ever answered: the run ends, and the sink is closed
    (its threads would otherwise outlive the publisher)."""
    events: list[str] = []
    store = AbsentAtStartStore(events, refusals=10**6)
    publisher = _publisher(store, FakeSink(events), replace(CONFIG, poll_interval=0.01))
    stopper = threading.Timer(0.2, publisher.request_stop)
    stopper.start()

    publisher.run()

    stopper.join()
    assert "register" not in events
    assert events.count("sink.close") == 1
    assert events[-1] == "store.close"


def test_run_exits_when_idle_after_registering_and_records_the_stop() -> None:
    """With exit_when_idle and nothing pending, run registers, returns, marks stopped and closes."""
    events: list[str] = []
    store, sink = FakeStore(events, []), FakeSink(events)
    publisher = _publisher(
        store, sink, replace(CONFIG, exit_when_idle=True), version="1.2.3", pid=4321
    )

    totals = publisher.run()

    assert store.registered == [("1.2.3", 4321)]
    assert events[0] == "register"
    assert "claim" in events
    assert "work_left" in events
    assert events.count("sink.close") == 1
    assert events.count("mark_stopped") == 1
    assert events.index("mark_stopped") > events.index("work_left")
    assert events[-1] == "store.close"
    assert totals.batches == 0
    # Before exiting it asks about held messages whose stuck message moved on, too.
    assert store.asked_stale_holds == [True]


def test_recovery_logs_each_moved_message_with_its_claim_and_counts_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A recovered message's line names its attempt, fence, batch and the expired owner."""
    events: list[str] = []
    store, sink = FakeStore(events, []), FakeSink(events)
    publisher = _publisher(store, sink)
    gone, owner = uuid.uuid4(), uuid.uuid4()
    store.recovered = [
        Recovered(gone, State.UNCERTAIN, 3, 9, 41, owner),
        Recovered(uuid.uuid4(), State.PENDING, 1, 2, 40, owner),
    ]

    with caplog.at_level(logging.WARNING, logger="publisher.loop"):
        publisher.maintain(force=True)

    [line, _] = [r for r in caplog.records if "expired" in r.getMessage()]
    assert line.getMessage() == (
        f"message {gone} attempt 3 fence 9: lease of publisher {owner} expired, moved to uncertain"
    )
    fields = {name: getattr(line, name) for name in ("message_id", "attempt", "fence", "batch_id")}
    assert fields == {"message_id": str(gone), "attempt": 3, "fence": 9, "batch_id": 41}
    assert publisher.totals.recovered == 2
    assert publisher.metrics.uncertain_found.labels("recovery")._value.get() == 1


def test_records_whose_turn_comes_after_the_hand_over_window_go_back_unsent() -> None:
    """After the window, nothing more of the batch is handed over; it settles pending, unsent."""
    first = replace(_message(key=b"a"), send_alone=True)
    second = replace(_message(key=b"b"), send_alone=True)
    third = _message(key=b"c")
    _events, store, sink, publisher = _setup(first, second, third)
    readings = iter([0.0, 1e9, 1e9])  # open for the first send, closed for the next ones
    sink.now = lambda: next(readings)
    before, before_wall = time.monotonic(), time.time()

    publisher.run_once()

    # The window runs max_block from just before the mark, and the write
    # deadline covers it: window + a blocked hand-over + delivery + request;
    # the producer is told the same deadline, on both clocks.
    [window, *_] = sink.windows
    assert window is not None
    assert before + 10.0 <= window.hand_over_until <= time.monotonic() + 10.0
    assert store.write_deadlines == [10.0 + 10.0 + 30.0 + 10.0]
    assert before + 60.0 <= window.write_until <= time.monotonic() + 60.0
    assert before_wall + 60.0 <= window.write_until_wall <= time.time() + 60.0
    assert sink.sent == [sink.sent[0]]
    assert sink.sent[0].message_id == first.id
    [settled] = store.settled
    by_id = {s.message_id: s for s in settled}
    assert by_id[first.id].state is State.DELIVERED
    for m in (second, third):
        s = by_id[m.id]
        assert (s.state, s.attempt_outcome) == (State.PENDING, "abandoned")
        assert s.error == HAND_OVER_CLOSED
        assert (s.send_began, s.counts_as_failure) == (False, False)
    assert by_id[second.id].send_alone is True
    assert publisher.totals.released == 2


def test_a_reconcile_pass_turns_the_loop_as_it_goes() -> None:
    """The publisher wires its reconciler's progress to its health: no stall during a pass."""
    events: list[str] = []
    store, sink = FakeStore(events, []), FakeSink(events)
    now = [1_000.0]
    reconciler = Reconciler(store, None, "test")  # type: ignore[arg-type]
    publisher = _publisher(store, sink, clock=lambda: now[0], reconciler=reconciler)
    publisher.health.loop_started()
    now[0] += CONFIG.stall_seconds + 1
    assert publisher.health.loop_stuck()
    assert not publisher._progressing()  # the heartbeat would no longer renew its leases
    reconciler.progress()
    assert not publisher.health.loop_stuck()
    assert publisher._progressing()  # a batch claimed ahead keeps its lease through the pass


class PagedReconciler(Reconciler):
    """Passes as scripted: how many each decides, and whether a page follows."""

    def __init__(self, store: PublisherStore, pages: list[tuple[int, bool]]) -> None:
        super().__init__(store, None, "test")  # type: ignore[arg-type]
        self.pages = pages
        self.passes = 0
        self._more = False

    def run_once(self) -> ReconcileReport:
        decided, self._more = self.pages[self.passes]
        self.passes += 1
        return ReconcileReport(delivered=[uuid.uuid4() for _ in range(decided)])

    @property
    def pages_left(self) -> bool:
        return self._more


def test_a_backlog_of_uncertain_messages_is_reconciled_page_after_page() -> None:
    """After a pass that decided something with pages left, the next page comes at the next
    turn, not an interval later; a pass that decided nothing waits the interval."""
    events: list[str] = []
    store = FakeStore(events, [])
    reconciler = PagedReconciler(store, [(3, True), (0, True), (2, False)])
    publisher = _publisher(store, FakeSink(events), clock=lambda: 1_000.0, reconciler=reconciler)

    for _ in range(3):
        publisher.maintain()

    assert reconciler.passes == 2


def test_the_heartbeat_stops_once_the_loop_is_stuck() -> None:
    """The publisher tells its heartbeat the loop is alive from its health's stall check."""
    events: list[str] = []
    now = [1_000.0]
    store, sink = FakeStore(events, []), FakeSink(events)
    publisher = _publisher(store, sink, clock=lambda: now[0], heartbeat_store=FakeStore(events, []))
    assert publisher.heartbeat is not None
    publisher.health.loop_started()
    assert publisher.heartbeat._loop_alive()
    now[0] += CONFIG.stall_seconds + 1
    assert not publisher.heartbeat._loop_alive()
    assert publisher.heartbeat.beat() == 0  # no beat while stuck
    assert "heartbeat" not in events


def test_a_running_publisher_does_not_ask_about_stale_holds_when_idle() -> None:
    """Only exiting needs held messages whose stuck message moved on counted (one probe per
    held key); a publisher that keeps running claims them after its next hold pass."""
    events: list[str] = []
    store = FakeStore(events, [])
    publisher = _publisher(store, FakeSink(events), replace(CONFIG, poll_interval=0.01))
    stopper = threading.Timer(0.2, publisher.request_stop)
    stopper.start()

    publisher.run()

    stopper.join()
    assert store.asked_stale_holds
    assert not any(store.asked_stale_holds)


def test_run_delivers_then_exits_when_idle() -> None:
    """run keeps claiming while batches come and exits once the store is idle."""
    events: list[str] = []
    store = FakeStore(events, [_batch(_message()), _batch(_message(), _message())])
    sink = FakeSink(events)
    publisher = _publisher(store, sink, replace(CONFIG, exit_when_idle=True))

    totals = publisher.run()

    assert (totals.batches, totals.delivered) == (2, 3)
    assert events.count("claim") == 3
    assert len(sink.sent) == 3
    assert publisher.health.threads == [publisher.waker]  # watched by readiness


def test_a_settlement_the_store_did_not_apply_counts_as_stale() -> None:
    """An id missing from settle's result is counted in totals.stale, not as delivered."""
    kept, lost = _message(), _message()
    _, store, _, publisher = _setup(kept, lost)
    store.stale_ids = {lost.id}

    publisher.run_once()

    assert (publisher.totals.stale, publisher.totals.delivered) == (1, 1)


def test_a_batch_none_of_whose_messages_is_held_any_more_is_still_closed() -> None:
    """Every message was decided (or recovered) before sending began: nothing is sent, and the
    batch is settled with no outcome, which closes it: open, it would hold its keys back."""
    message = _message()
    _, store, sink, publisher = _setup(message)
    store.lost_before_sending = {message.id}

    publisher.run_once()

    assert sink.sent == []
    assert store.settled == [[]]
    assert publisher.totals.stale == 1


def test_a_message_refused_on_a_very_late_attempt_is_still_settled() -> None:
    """A message refused on its 1,100th attempt is settled pending with a capped delay."""
    late = _message(attempt=1_100)
    events: list[str] = []
    store = FakeStore(events, [_batch(late)])
    sink = FakeSink(events)
    publisher = _publisher(store, sink, replace(CONFIG, max_attempts=10_000))
    sink.reports[late.id] = SendReport(None, None, _NOT_TAKEN, handed_to_producer=False)

    publisher.run_once()

    (settlement,) = store.settled[0]
    assert settlement.state is State.PENDING
    assert 0 <= settlement.retry_after <= CONFIG.retry_cap_seconds


@pytest.mark.parametrize(("attempt", "state"), [(4, State.PENDING), (5, State.QUARANTINED)])
def test_a_message_not_written_at_max_attempts_is_quarantined(attempt: int, state: State) -> None:
    """Past max_attempts, a not-written message is quarantined with the count and last error."""
    message = _message(attempt=attempt)
    events: list[str] = []
    store = FakeStore(events, [_batch(message)])
    sink = FakeSink(events)
    publisher = _publisher(store, sink, replace(CONFIG, max_attempts=5))
    sink.reports[message.id] = SendReport(None, None, _NOT_TAKEN, handed_to_producer=False)

    publisher.run_once()

    (settlement,) = store.settled[0]
    assert settlement.state is state
    if state is State.QUARANTINED:
        assert settlement.error is not None
        assert settlement.error.startswith("gave up after 5 attempts; last: IllegalStateError")
        assert settlement.retry_after == 0


@pytest.mark.parametrize(
    ("failures", "send_alone", "state"),
    [(4, True, State.DELIVERED), (5, True, State.QUARANTINED), (5, False, State.DELIVERED)],
)
def test_a_suspect_message_whose_failures_reached_max_attempts_is_quarantined_unsent(
    failures: int, send_alone: bool, state: State
) -> None:
    """A suspect message claimed at --max-attempts failures (its claims alone ended in
    recovery) is quarantined without being sent; below the limit, or not suspect, it is sent."""
    message = replace(_message(), failures=failures, send_alone=send_alone)
    events: list[str] = []
    store = FakeStore(events, [_batch(message)])
    sink = FakeSink(events)
    publisher = _publisher(store, sink, replace(CONFIG, max_attempts=5))

    assert publisher.run_once() == 1

    (settlement,) = store.settled[0]
    assert settlement.state is state
    if state is State.QUARANTINED:
        assert "send" not in events
        assert (settlement.attempt_outcome, settlement.send_began) == ("failed", False)
        assert settlement.send_alone
        assert not settlement.counts_as_failure
        assert settlement.error is not None
        assert "ended its publisher's claims: 5 failures (--max-attempts 5)" in settlement.error
        assert publisher.totals.quarantined == 1
    else:
        assert [r.message_id for r in sink.sent] == [message.id]
        assert not settlement.send_alone  # settled normally: no longer suspect


def test_an_uncertain_outcome_in_a_lone_send_discards_the_producer_before_the_next_send() -> None:
    """A record sent alone that ends uncertain: its producer is dropped before the rest is sent."""
    lone = replace(_message(key=b"a"), send_alone=True)
    rest = _message(key=b"b")
    events, store, sink, publisher = _setup(lone, rest)
    sink.reports[lone.id] = SendReport(None, None, kafka_errors.KafkaTimeoutError("Expiring"), True)

    publisher.run_once()

    assert [e for e in events if e in {"send", "discard_producer", "settle"}] == [
        "send",
        "discard_producer",
        "send",
        "settle",
    ]
    assert [s.state for s in store.settled[0]] == [State.UNCERTAIN, State.DELIVERED]


def test_a_record_refused_by_send_holds_back_later_records_of_its_key() -> None:
    """The next record of a refused key is not sent and settles unsent; other keys go on."""
    first, second = (_message(key=b"k") for _ in range(2))
    other = _message(key=b"j")
    _, store, sink, publisher = _setup(first, second, other)
    sink.reports = {
        first.id: SendReport(
            None, None, kafka_errors.KafkaTimeoutError("max_block_ms"), handed_to_producer=False
        )
    }

    publisher.run_once()

    [settled] = store.settled
    by_id = {s.message_id: s for s in settled}
    assert (by_id[first.id].state, by_id[first.id].attempt_outcome) == (State.PENDING, "failed")
    assert (by_id[second.id].state, by_id[second.id].attempt_outcome) == (
        State.PENDING,
        "abandoned",
    )
    assert by_id[second.id].counts_as_failure is False
    assert by_id[other.id].state is State.DELIVERED
    assert publisher.health.kafka.ok is True  # the broker answered the other key


def test_a_short_claim_ahead_pauses_claiming_ahead_for_one_batch() -> None:
    """Full claim-ahead: the next goes on; short: none during its send; then again."""
    config = replace(CONFIG, batch_size=2)
    events: list[str] = []
    store = FakeStore(events, [_batch(_message(key=b"a"), _message(key=b"b"))])
    ahead_events: list[str] = []
    ahead = FakeStore(
        ahead_events,
        [
            _batch(_message(key=b"c"), _message(key=b"d")),  # full
            _batch(_message(key=b"e")),  # short
            None,  # would be claimed ahead if not paused
        ],
    )
    sink = FakeSink(events)
    publisher = _publisher(store, sink, config, claim_ahead_store=ahead)
    try:
        publisher.run_once()  # claims a, b; claims c, d ahead
        publisher.run_once()  # takes c, d (full); claims e ahead
        publisher.run_once()  # takes e (short): nothing claimed ahead during its send
        assert ahead_events.count("claim") == 2
        assert len(ahead.batches) == 1
        publisher.run_once()  # an ordinary claim (none left); the pause is over
    finally:
        publisher._release_claimed_ahead()
    assert [len(s) for s in store.settled + ahead.settled] == [2, 2, 1]


def test_the_loop_holds_a_batch_from_its_claim_to_its_settle() -> None:
    """While a batch is sent, it and the batch claimed ahead are held; once settled, not."""
    first, ahead = _message(key=b"a"), _message(key=b"b")
    events: list[str] = []
    store = FakeStore(events, [replace(_batch(first), id=1)])
    ahead_store = FakeStore([], [replace(_batch(ahead), id=2), None])
    sink = FakeSink(events)
    publisher = _publisher(store, sink, claim_ahead_store=ahead_store)
    seen: list[list[int]] = []
    original = sink.send

    def send(
        records: Sequence[OutgoingRecord], *, window: SendWindow | None = None
    ) -> list[OutgoingRecord]:
        if publisher._ahead is not None:
            publisher._ahead.result()  # let the claim-ahead come back first
        seen.append(sorted(publisher.held_batches()))
        return original(records, window=window)

    sink.send = send  # type: ignore[method-assign]
    try:
        publisher.run_once()
        assert publisher.held_batches() == [2]  # claimed ahead, not sent yet
        publisher.run_once()
    finally:
        publisher._release_claimed_ahead()
    assert seen == [[1, 2], [2]]
    assert publisher.held_batches() == []


# --- transactional delivery ---------------------------------------------------

TRANSACTIONAL = replace(CONFIG, delivery="transactional")


def _transactional(*messages: ClaimedMessage) -> tuple[list[str], FakeStore, FakeSink, Publisher]:
    events: list[str] = []
    store = FakeStore(events, [_batch(*messages)])
    sink = FakeSink(events)
    return events, store, sink, _publisher(store, sink, TRANSACTIONAL)


def test_a_transactional_batch_is_delivered_only_once_its_transaction_committed() -> None:
    """Begin before the mark (which records the session), send, commit, then settle delivered."""
    first, second = _message(key=b"a"), _message(key=b"b")
    events, store, _sink, publisher = _transactional(first, second)

    publisher.run_once()

    assert [e for e in events if e in ("begin", "mark_sending", "send", "commit", "settle")] == [
        "begin",
        "mark_sending",
        "send",
        "commit",
        "settle",
    ]
    assert store.transactional_ids == ["outbox-test-1"]
    [settled] = store.settled
    assert [s.state for s in settled] == [State.DELIVERED, State.DELIVERED]


def test_a_record_that_failed_aborts_its_transaction_and_sends_the_rest_again() -> None:
    """One record unanswered: abort; it is not written (a failure), the confirmed one unsent."""
    failed, confirmed = _message(key=b"a"), _message(key=b"b")
    events, store, sink, publisher = _transactional(failed, confirmed)
    sink.reports = {
        failed.id: SendReport(None, None, kafka_errors.KafkaTimeoutError("Expiring"), True)
    }

    publisher.run_once()

    assert "abort" in events
    assert "commit" not in events
    # Its request unanswered may still arrive: this session sends nothing more.
    assert events.index("discard_producer") > events.index("abort")
    by_id = {s.message_id: s for s in store.settled[0]}
    assert by_id[failed.id].state is State.PENDING
    assert by_id[failed.id].counts_as_failure
    assert by_id[confirmed.id].state is State.PENDING
    assert by_id[confirmed.id].attempt_outcome == "abandoned"
    assert not by_id[confirmed.id].counts_as_failure
    assert by_id[confirmed.id].send_began
    assert "its transaction was aborted" in (by_id[confirmed.id].error or "")


@pytest.mark.parametrize(
    "report",
    [
        SendReport(None, None, kafka_errors.MessageSizeTooLargeError("too large"), True),
        SendReport(None, None, kafka_errors.KafkaTimeoutError("metadata"), False),
    ],
    ids=["refused", "never-handed-over"],
)
def test_an_abort_with_nothing_on_its_way_keeps_the_session(report: SendReport) -> None:
    """A record refused, or never handed to the producer, sent nothing that could arrive
    late: the aborted transaction's session goes on."""
    failed, confirmed = _message(key=b"a"), _message(key=b"b")
    events, _, sink, publisher = _transactional(failed, confirmed)
    sink.reports = {failed.id: report}

    publisher.run_once()

    assert "abort" in events
    assert "discard_producer" not in events


def test_commit_to_ack_counts_a_transactional_record_once_its_transaction_committed() -> None:
    """A record confirmed in a transaction that is then aborted is not delivered: it is not
    observed; in a committed transaction each record is observed once."""
    made = datetime.now(UTC)
    failed, confirmed = (replace(_message(key=k), created_at=made) for k in (b"a", b"b"))
    _, _, sink, publisher = _transactional(failed, confirmed)
    sink.reports = {
        failed.id: SendReport(None, None, kafka_errors.KafkaTimeoutError("Expiring"), True)
    }
    publisher.run_once()
    count = publisher.metrics.registry.get_sample_value("outbox_commit_to_ack_seconds_count")
    assert count == 0

    again = replace(_message(key=b"c"), created_at=made)
    _, _, _, committing = _transactional(again)
    committing.run_once()
    count = committing.metrics.registry.get_sample_value("outbox_commit_to_ack_seconds_count")
    assert count == 1


def test_a_transaction_that_cannot_begin_charges_no_message_a_failure() -> None:
    """The session cannot begin (here, no right to its transactional.id): nothing was sent,
    so no message is charged, not even one at its last attempt; the loop backs off as in an
    outage, and readiness says Kafka."""
    last = _message(key=b"a", attempt=CONFIG.max_attempts)
    _, store, sink, publisher = _transactional(last)

    def refuse() -> None:
        raise kafka_errors.TransactionalIdAuthorizationFailedError("no WRITE on the id")

    sink.begin_transaction = refuse  # type: ignore[method-assign]

    publisher.run_once()

    [[settled]] = store.settled
    assert (settled.state, settled.counts_as_failure) == (State.PENDING, False)
    assert "the Kafka transaction could not begin" in (settled.error or "")
    assert publisher._outages == 1
    assert publisher.health.kafka.ok is False


def test_records_refused_after_their_transaction_failed_are_not_charged_a_failure() -> None:
    """The broker refused one record; the producer then refused the others: only it is judged."""
    refused, bystander = _message(key=b"a"), _message(key=b"b")
    events, store, sink, publisher = _transactional(refused, bystander)
    sink.reports = {
        refused.id: SendReport(None, None, kafka_errors.InvalidRecordError("needs a key"), True),
        bystander.id: transaction_failed(),
    }

    publisher.run_once()

    assert "abort" in events
    by_id = {s.message_id: s for s in store.settled[0]}
    assert by_id[refused.id].state is State.QUARANTINED
    assert by_id[bystander.id].state is State.PENDING
    assert by_id[bystander.id].attempt_outcome == "abandoned"
    assert not by_id[bystander.id].counts_as_failure
    assert by_id[bystander.id].error == "not sent: an earlier record of its transaction failed"


def test_a_commit_whose_answer_was_lost_leaves_every_record_uncertain() -> None:
    """Commit unanswered: the confirmed records may or may not be committed, so uncertain."""
    first, second = _message(key=b"a"), _message(key=b"b")
    _events, store, sink, publisher = _transactional(first, second)
    sink.commit_ends = TransactionEnd.UNKNOWN

    publisher.run_once()

    assert [s.state for s in store.settled[0]] == [State.UNCERTAIN, State.UNCERTAIN]


def test_a_fenced_session_records_nothing_of_its_batch() -> None:
    """Fenced at the commit (a successor took the transactional.id over): no settle at all."""
    message = _message()
    events, store, sink, publisher = _transactional(message)
    sink.commit_ends = TransactionEnd.FENCED

    publisher.run_once()

    assert store.settled == []
    assert "settle" not in events
    assert publisher.totals.stale == 1


def test_a_record_refused_as_fenced_ends_the_batch_unrecorded() -> None:
    """A produce answered ProducerFenced: the session is dropped, nothing committed or settled."""
    message = _message()
    events, store, sink, publisher = _transactional(message)
    sink.reports = {message.id: SendReport(None, None, kafka_errors.ProducerFencedError(), True)}

    publisher.run_once()

    assert "discard_producer" in events
    assert "commit" not in events
    assert store.settled == []


def _numbered(number: int, *messages: ClaimedMessage) -> Batch:
    return replace(_batch(*messages), id=number)


def _backlog(
    batches: Sequence[Batch | None], *, transaction_records: int = 6
) -> tuple[list[str], FakeStore, FakeSink, Publisher]:
    """A transactional publisher (batches of 2) whose first batch is claimed on its
    connection and the next ones ahead, on another, while each is sent."""
    config = replace(TRANSACTIONAL, batch_size=2, transaction_records=transaction_records)
    events: list[str] = []
    store = FakeStore(events, [_numbered(1, _message(key=b"a"), _message(key=b"b"))])
    ahead = FakeStore([], batches)
    sink = FakeSink(events)
    return events, store, sink, _publisher(store, sink, config, claim_ahead_store=ahead)


def test_under_backlog_full_batches_join_one_transaction_up_to_its_size() -> None:
    """Each batch came back full: the next joins the transaction (marked under the same
    session) until transaction_records; one commit, then each batch settles delivered."""
    events, store, _sink, publisher = _backlog(
        [
            _numbered(2, _message(key=b"c"), _message(key=b"d")),
            _numbered(3, _message(key=b"e"), _message(key=b"f")),
            _numbered(4, _message(key=b"g"), _message(key=b"h")),  # beyond 6 records
        ]
    )
    try:
        assert publisher.run_once() == 6
        assert publisher._ahead is not None
        publisher._ahead.result()
        assert publisher.held_batches() == [4]  # claimed ahead for the next turn
    finally:
        publisher._release_claimed_ahead()

    assert events.count("begin") == 1
    assert events.count("commit") == 1
    assert events.index("commit") < events.index("settle")
    assert store.transactional_ids == ["outbox-test-1"] * 3
    delivered, released = store.settled[:3], store.settled[3]
    assert [[s.state for s in settled] for settled in delivered] == [[State.DELIVERED] * 2] * 3
    assert [s.attempt_outcome for s in released] == ["abandoned"] * 2  # released on stop


def test_a_short_batch_claimed_ahead_ends_the_transaction_and_goes_next_on_its_own() -> None:
    """No backlog after all: commit what is in hand; the short batch is the next turn's."""
    events, store, _sink, publisher = _backlog([_numbered(2, _message(key=b"c")), None])
    try:
        assert publisher.run_once() == 2
        assert events.count("commit") == 1
        assert publisher.held_batches() == [2]  # claimed ahead, not sent yet
        assert publisher.run_once() == 1  # a transaction of its own
    finally:
        publisher._release_claimed_ahead()
    assert events.count("commit") == 2
    assert [len(settled) for settled in store.settled] == [2, 1]


def test_a_record_that_failed_in_a_joined_batch_aborts_every_batch_of_the_transaction() -> None:
    """Abort: the confirmed records of the earlier batch go back unsent too, none counted."""
    failed, later = _message(key=b"c"), _message(key=b"d")
    events, store, sink, publisher = _backlog([_numbered(2, failed, later), None])
    sink.reports = {
        failed.id: SendReport(None, None, kafka_errors.KafkaTimeoutError("Expiring"), True)
    }
    try:
        publisher.run_once()
    finally:
        publisher._release_claimed_ahead()

    assert "abort" in events
    assert "commit" not in events
    first, joined = store.settled
    assert [(s.state, s.attempt_outcome, s.counts_as_failure) for s in first] == [
        (State.PENDING, "abandoned", False)
    ] * 2
    by_id = {s.message_id: s for s in joined}
    assert by_id[failed.id].counts_as_failure
    assert by_id[later.id].state is State.PENDING  # not sent into a doomed transaction
    assert not by_id[later.id].counts_as_failure


def test_an_idempotent_publisher_settles_each_batch_on_its_own() -> None:
    """Joining is for transactions only: in the default mode, one batch per turn."""
    config = replace(CONFIG, batch_size=2)
    events: list[str] = []
    store = FakeStore(events, [_numbered(1, _message(key=b"a"), _message(key=b"b"))])
    ahead = FakeStore([], [_numbered(2, _message(key=b"c"), _message(key=b"d")), None])
    publisher = _publisher(store, FakeSink(events), config, claim_ahead_store=ahead)
    try:
        assert publisher.run_once() == 2
        assert len(store.settled) == 1
    finally:
        publisher._release_claimed_ahead()


def test_a_transaction_whose_batch_was_recovered_before_sending_is_ended_empty() -> None:
    """Frozen between its claim and its mark, past its lease: the batch is gone, nothing is
    sent, and the transaction begun for it is aborted, so the next batch can begin one."""
    lost, later = _message(key=b"a"), _message(key=b"b")
    events: list[str] = []
    store = FakeStore(events, [_numbered(1, lost), _numbered(2, later)])
    store.lost_before_sending = {lost.id}
    sink = FakeSink(events)
    publisher = _publisher(store, sink, TRANSACTIONAL)

    publisher.run_once()
    publisher.run_once()

    ends = [e for e in events if e in ("begin", "send", "commit", "abort")]
    assert ends == ["begin", "abort", "begin", "send", "commit"]
    assert publisher.totals.stale == 1
    # The lost batch is settled with nothing to record (its close changes nothing once
    # recovery closed it); the next one delivers.
    assert [[s.state for s in settled] for settled in store.settled] == [[], [State.DELIVERED]]


def test_a_transaction_whose_mark_failed_is_aborted_so_the_next_batch_can_begin_one() -> None:
    """The database went away between the begin and the mark: the error reaches the run
    loop, and the transaction is aborted on the way, so the next batch begins its own."""
    first, later = _message(key=b"a"), _message(key=b"b")
    events: list[str] = []
    store = FakeStore(events, [_numbered(1, first), _numbered(2, later)])
    store.mark_errors = [psycopg.OperationalError("server closed the connection unexpectedly")]
    sink = FakeSink(events)
    publisher = _publisher(store, sink, TRANSACTIONAL)

    with pytest.raises(psycopg.OperationalError):
        publisher.run_once()
    assert publisher.held_batches() == []  # batch 1 is left to recovery
    publisher.run_once()

    ends = [e for e in events if e in ("begin", "mark_sending", "send", "commit", "abort")]
    assert ends == ["begin", "mark_sending", "abort", "begin", "mark_sending", "send", "commit"]
    assert [[s.message_id for s in settled] for settled in store.settled] == [[later.id]]


def test_a_joining_batch_whose_mark_failed_aborts_what_the_transaction_carried() -> None:
    """Batch 1 was sent in the transaction when batch 2's mark failed: the transaction is
    aborted (batch 1's records are never committed) and neither batch is settled: both
    stay open for recovery, which finds batch 1's records absent."""
    events, store, sink, publisher = _backlog(
        [_numbered(2, _message(key=b"c"), _message(key=b"d")), None]
    )
    store.mark_errors = [None, psycopg.OperationalError("terminating connection")]
    try:
        with pytest.raises(psycopg.OperationalError):
            publisher.run_once()
    finally:
        publisher._release_claimed_ahead()

    assert [e for e in events if e in ("begin", "send", "commit", "abort", "discard_producer")] == [
        "begin",
        "send",
        "abort",
        "discard_producer",  # its marks are left open: recovery will fence its session
    ]
    assert not sink.in_transaction
    assert store.settled == []
    assert publisher.held_batches() == []


def test_a_committed_transaction_whose_settle_failed_for_a_lease_leaves_its_session() -> None:
    """The database stayed away past the lease after the commit: the batch stays open for
    recovery, whose reconciler fences the session it names, so the next transaction begins
    in a new session instead of being fenced along with it."""
    events: list[str] = []
    store = FakeStore(events, [_batch(_message())])
    sink = FakeSink(events)

    def settle_fails(batch: Batch, settlements: Sequence[Settlement]) -> set[uuid.UUID]:
        events.append("settle")
        raise psycopg.OperationalError("the database system is shutting down")

    store.settle = settle_fails  # type: ignore[method-assign]
    ticks = itertools.count(0.0, CONFIG.lease_seconds)  # each look at the clock: a lease later
    publisher = _publisher(store, sink, TRANSACTIONAL, clock=lambda: next(ticks))

    with pytest.raises(psycopg.OperationalError):
        publisher.run_once()

    assert [e for e in events if e in ("commit", "settle", "discard_producer")] == [
        "commit",
        "settle",
        "discard_producer",
    ]


def test_nothing_to_write_is_said_only_when_nothing_will_need_the_publisher() -> None:
    """/readyz reports failing writes only while there is something to write: a claim that
    finds a batch says there is; an idle turn says there is not only once nothing will
    need the publisher (a message waiting out its backoff after a failed write still
    wants a write)."""
    events: list[str] = []
    store = FakeStore(events, [_batch(_message())])
    publisher = _publisher(store, FakeSink(events))
    publisher.health.writes_wanted = False
    publisher.run_once()
    assert publisher.health.writes_wanted
    store.work, store.next_due = True, 30.0  # waiting out a backoff
    assert publisher.run_once() == 0
    publisher._idle_wait()
    assert publisher.health.writes_wanted
    store.next_due = None
    publisher._idle_wait()
    assert not publisher.health.writes_wanted


def test_a_transactional_batch_recovered_while_sent_leaves_its_session() -> None:
    """Its settle changed nothing (recovery took the batch while it was sent): the reconciler
    fences the session the mark recorded before it decides those messages, so the next
    transaction begins in a new session instead of being fenced with it; a batch settled
    whole keeps the session."""
    taken, settled = _message(key=b"a"), _message(key=b"b")
    events: list[str] = []
    store = FakeStore(events, [_batch(taken), replace(_batch(settled), id=8)])
    store.stale_ids = {taken.id}
    publisher = _publisher(store, FakeSink(events), TRANSACTIONAL)

    publisher.run_once()
    assert [e for e in events if e in ("commit", "settle", "discard_producer")] == [
        "commit",
        "settle",
        "discard_producer",
    ]
    events.clear()
    publisher.run_once()
    assert "discard_producer" not in events
    assert "settle" in events


def test_a_settle_whose_answer_was_lost_is_not_counted_as_a_lease_lost() -> None:
    """The first try committed but its answer was lost with the connection; tried again, it
    finds the batch closed: what the first recorded is delivered, not a lease lost, and a
    transactional publisher keeps its session."""
    message = _message()
    events: list[str] = []
    store = FakeStore(events, [_batch(message)])
    record = store.settle

    def settle(batch: Batch, settlements: Sequence[Settlement]) -> set[uuid.UUID]:
        if len(store.settled) == 0:
            record(batch, settlements)  # committed...
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        record(batch, settlements)
        return set()  # ...and the retry finds the batch closed

    store.settle = settle  # type: ignore[method-assign]
    publisher = _publisher(store, FakeSink(events), TRANSACTIONAL)

    publisher.run_once()

    assert "settled_by" in events
    assert publisher.totals.delivered == 1
    assert publisher.totals.stale == 0
    assert "discard_producer" not in events


def test_a_transaction_that_cannot_be_aborted_after_an_error_loses_its_session() -> None:
    """The abort itself fails (the broker went too): the session is discarded, so the next
    batch begins in a fresh one."""
    first, later = _message(key=b"a"), _message(key=b"b")
    events: list[str] = []
    store = FakeStore(events, [_numbered(1, first), _numbered(2, later)])
    store.mark_errors = [psycopg.OperationalError("server closed the connection unexpectedly")]
    sink = FakeSink(events)

    def abort_fails(*, commit: bool) -> TransactionEnd:
        events.append("abort")
        raise kafka_errors.KafkaConnectionError("no broker")

    sink.end_transaction = abort_fails  # type: ignore[method-assign]
    publisher = _publisher(store, sink, TRANSACTIONAL)

    with pytest.raises(psycopg.OperationalError):
        publisher.run_once()

    assert events[-2:] == ["abort", "discard_producer"]
    assert not sink.in_transaction


def test_a_content_refusal_several_records_got_pins_it_on_none_of_them() -> None:
    """kafka-python may abort every batch it holds, of any topic, with the error of one
    refused record: records of two topics refused alike are uncertain, sent alone next."""
    big, bystander = _message("orders", key=b"a"), _message("payments", key=b"b")
    _, store, sink, publisher = _setup(big, bystander, partitions={"orders": 3, "payments": 3})
    refusal = SendReport(None, None, kafka_errors.MessageSizeTooLargeError(), True)
    sink.reports = {big.id: refusal, bystander.id: refusal}

    publisher.run_once()

    [settled] = store.settled
    assert [(s.state, s.send_alone, s.counts_as_failure) for s in settled] == [
        (State.UNCERTAIN, True, True)
    ] * 2
    assert all("not attributable" in (s.error or "") for s in settled)


def test_two_records_sent_alone_and_refused_alike_are_each_refused_for_themselves() -> None:
    """Two suspects, each sent alone (its own producer, its own send), both too large: each
    refusal is its own, so each is quarantined, not taken for a refusal they shared."""
    first = replace(_message(key=b"a", attempt=50), send_alone=True)
    second = replace(_message(key=b"b", attempt=50), send_alone=True)
    _, store, sink, publisher = _setup(first, second)
    refusal = SendReport(None, None, kafka_errors.MessageSizeTooLargeError(), True)
    sink.reports = {first.id: refusal, second.id: refusal}

    publisher.run_once()

    [settled] = store.settled
    assert [s.state for s in settled] == [State.QUARANTINED, State.QUARANTINED]
    assert not any("not attributable" in (s.error or "") for s in settled)


def _settle_forward(message: ClaimedMessage, settlement: Settlement) -> ClaimedMessage:
    """The message as the next claim returns it, after ``settlement`` was recorded."""
    return replace(
        message,
        fence=message.fence + 1,
        attempt=message.attempt + 1,
        failures=message.failures + settlement.counts_as_failure,
        send_alone=settlement.send_alone,
    )


@pytest.mark.parametrize(
    "outage",
    [
        kafka_errors.KafkaTimeoutError("Failed to update metadata after 10.0 secs."),
        kafka_errors.KafkaConnectionError("connection refused"),
        kafka_errors.NotLeaderForPartitionError(),
        kafka_errors.LeaderNotAvailableError(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_long_broker_outage_never_quarantines_but_a_content_refusal_still_does(
    outage: BaseException,
) -> None:
    """Hundreds of outage outcomes leave a message pending with no failure; a refusal counts."""
    config = replace(CONFIG, max_attempts=3)
    message = _message(attempt=1)
    events: list[str] = []
    store = FakeStore(events)
    sink = FakeSink(events)
    publisher = _publisher(store, sink, config)
    for _ in range(200):
        store.batches.append(_batch(message))
        sink.reports[message.id] = SendReport(None, None, outage, handed_to_producer=False)
        publisher.run_once()
        (settlement,) = store.settled[-1]
        assert settlement.state is State.PENDING
        assert 0 <= settlement.retry_after <= config.retry_cap_seconds
        message = _settle_forward(message, settlement)
    # One failure at most, so that the key stays held while the message waits.
    assert message.failures == 1
    assert publisher._outages == 200

    # A refusal that may be the message's own counts, and exhausts the attempts.
    states = []
    for _ in range(2):
        store.batches.append(_batch(message))
        sink.reports[message.id] = SendReport(None, None, _NOT_TAKEN, handed_to_producer=False)
        publisher.run_once()
        (settlement,) = store.settled[-1]
        states.append(settlement.state)
        message = _settle_forward(message, settlement)
    assert states == [State.PENDING, State.QUARANTINED]

    # A content refusal by the broker quarantines at once, outages or not.
    refused = _message(attempt=500)
    store.batches.append(_batch(refused))
    sink.reports[refused.id] = SendReport(
        None, None, kafka_errors.MessageSizeTooLargeError(), handed_to_producer=True
    )
    publisher.run_once()
    (settlement,) = store.settled[-1]
    assert settlement.state is State.QUARANTINED


def test_the_loop_backs_off_after_outages_and_resets_once_something_is_delivered() -> None:
    """The pause after outage batches grows with them, and a delivery ends it."""
    message = _message()
    events: list[str] = []
    store = FakeStore(events, [_batch(message), _batch(message)])
    sink = FakeSink(events)
    publisher = _publisher(store, sink)
    sink.reports[message.id] = SendReport(
        None, None, kafka_errors.KafkaConnectionError("refused"), handed_to_producer=False
    )
    publisher.run_once()
    publisher.run_once()
    assert publisher._outages == 2

    del sink.reports[message.id]
    store.batches.append(_batch(message))
    publisher.run_once()
    assert publisher._outages == 0
    assert [s.state for s in store.settled[-1]] == [State.DELIVERED]


class RecordingWaker(Waker):
    """A waker that records the loop's announcements and waits; a wait stops the loop."""

    def __init__(self, events: list[str]) -> None:
        super().__init__(None)
        self.events = events
        self.on_wait: Callable[[], None] = lambda: None

    def fall_asleep(self) -> bool:
        """Announced at the first call, already announced at the next."""
        self.events.append("fall_asleep")
        newly, self.announced = not self.announced, True
        return newly

    def awake(self) -> None:
        """Record the end of the announcement."""
        self.events.append("awake")
        self.announced = False

    def wait(self, timeout: float) -> bool:
        """Record the wait and end the run."""
        self.events.append("wait")
        self.on_wait()
        return False


def test_the_loop_claims_once_more_after_announcing_its_sleep_and_ends_it_when_busy() -> None:
    """A claim that found work ends the sleep's announcement; one that found nothing
    announces it, then claims once more before waiting (a commit that did not notify is
    visible by then), and waits only when announced already."""
    events: list[str] = []
    store = FakeStore(events, [_batch(_message())])
    waker = RecordingWaker(events)
    publisher = Publisher(CONFIG, store, FakeSink(events), waker, clock=lambda: 1_000.0)
    waker.on_wait = publisher.request_stop

    publisher.run()

    loop = [e for e in events if e in ("claim", "fall_asleep", "awake", "wait")]
    assert loop == ["claim", "awake", "claim", "fall_asleep", "claim", "fall_asleep", "wait"]


def test_a_producer_that_cannot_be_opened_again_mid_batch_sends_the_rest_back_unsent() -> None:
    """The lone record ends uncertain and its producer is discarded; opening the next one
    fails (no broker answers). The loop does not die: the rest of the batch was never
    handed over, and settles pending, unsent, with no failure counted."""
    lone = replace(_message(key=b"a"), send_alone=True)
    rest = _message(key=b"b")
    _, store, sink, publisher = _setup(lone, rest)
    sink.reports[lone.id] = SendReport(None, None, kafka_errors.KafkaTimeoutError("Expiring"), True)
    sends = 0
    real_send = sink.send

    def send_once(records: Sequence[OutgoingRecord], **kw: Any) -> list[OutgoingRecord]:
        nonlocal sends
        sends += 1
        if sends > 1:
            raise ProducerUnavailable("no producer could be opened: KafkaTimeoutError")
        return real_send(records, **kw)

    sink.send = send_once  # type: ignore[method-assign]

    publisher.run_once()

    [settled] = store.settled
    assert [(s.state, s.attempt_outcome) for s in settled] == [
        (State.UNCERTAIN, AttemptOutcome.UNCERTAIN),
        (State.PENDING, AttemptOutcome.ABANDONED),
    ]
    assert settled[1].error == "not sent: no producer could be opened: KafkaTimeoutError"
    assert publisher.health.kafka.error_type == "ProducerUnavailable"


def test_a_refused_transactional_id_keeps_readyz_at_kafka_refused_until_a_session_opens() -> None:
    """Every batch's topic lookup succeeds (from a cache, or a broker that answers anyone)
    and its transaction cannot begin (no right to the TransactionalId): readiness stays
    kafka_refused through the next batch's lookup; a session that opens lifts it."""
    events: list[str] = []
    store = FakeStore(events, [_batch(_message()), _batch(_message()), _batch(_message())])
    sink = FakeSink(events)
    publisher = _publisher(store, sink, TRANSACTIONAL)
    refusals = [kafka_errors.TransactionalIdAuthorizationFailedError()] * 2
    seen: list[str] = []
    begin = sink.begin_transaction

    def begin_or_refuse() -> None:
        seen.append(publisher.health.readiness().checks["kafka"])
        if refusals:
            raise refusals.pop()
        begin()

    sink.begin_transaction = begin_or_refuse  # type: ignore[method-assign]
    for _ in range(3):
        publisher.run_once()
    # The first batch met the refusal; the lookups of the next two did not lift it.
    assert seen[1:] == ["kafka_refused", "kafka_refused"]
    assert publisher.health.readiness().checks["kafka"] == "ok"  # the third's session opened
    assert [s.state for s in store.settled[2]] == [State.DELIVERED]


def test_a_producer_that_could_not_be_opened_for_a_refusal_is_a_refusal() -> None:
    """A sink's error raised from the broker's refusal of the publisher (its cause) counts
    as that refusal: the loop marks readiness kafka_refused through it too."""
    wrapped = ProducerUnavailable("the producer could not be opened")
    wrapped.__cause__ = kafka_errors.ClusterAuthorizationFailedError()
    assert refuses_publisher(wrapped)
    assert not refuses_publisher(ProducerUnavailable("no broker"))
