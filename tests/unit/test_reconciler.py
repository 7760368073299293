"""The reconciler's decision rules, on a scripted log (the real broker is in the integration tests).

A record not found proves absence only once the grace after its write
deadline has passed, only where the range it could be in was read, and only
where neither compaction nor a later message of its key can explain it.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import pytest
from kafka import errors as kafka_errors

from outbox.states import WAITING_NOTE, State
from publisher.reconciler import TOMBSTONE_MARGIN, Reconciler, held_back_note
from publisher.scanner import Cleanup, EvidenceLost, Scan, ScanIncomplete
from publisher.store import Decision, PublisherStore, UncertainMessage

TOPIC = "orders"
#: A topic whose records only retention removes.
DELETE: set[str] = {"delete"}
#: Kafka's default delete.retention.ms, in seconds: how long a tombstone is kept.
DAY = 86_400.0


class FakeStore(PublisherStore):
    """Serves prepared uncertain messages; applies every decision it is given."""

    def __init__(self, due: list[UncertainMessage]) -> None:
        super().__init__("postgresql://unused", uuid.uuid4())
        self.due = due
        self.later: set[uuid.UUID] = set()
        #: Every decision applied, in order.
        self.decisions: list[Decision] = []
        #: The last note written on each message (``note_waiting``).
        self.notes: dict[uuid.UUID, str] = {}

    def uncertain_due(
        self, limit: int = 1000, grace: float = 0.0, *, after: int = 0
    ) -> list[UncertainMessage]:
        """The prepared messages still undecided, a page of them in ``seq`` order."""
        decided = {d.message_id for d in self.decisions}
        due = sorted((m for m in self.due if m.id not in decided), key=lambda m: m.seq)
        return [m for m in due if m.seq > after][:limit]

    def later_of_key(self, message_id: uuid.UUID, ids: Collection[uuid.UUID]) -> set[uuid.UUID]:
        """Those of ``ids`` declared later messages of the key."""
        return set(ids) & self.later

    def decide(self, decisions: Sequence[Decision], decided_by: str) -> set[uuid.UUID]:
        """Every decision applies."""
        self.decisions.extend(decisions)
        return {d.message_id for d in decisions}

    def note_waiting(
        self, messages: Sequence[UncertainMessage], note: str | None, *, keep: str | None = None
    ) -> int:
        """Every note is kept, by message; ``None`` removes a message's note (unless it
        is ``keep``)."""
        changed = 0
        for m in messages:
            if note is None and m.id in self.notes and self.notes[m.id] != keep:
                del self.notes[m.id]
                changed += 1
            elif note is not None and self.notes.get(m.id) != note:
                self.notes[m.id] = note
                changed += 1
        return changed


#: A scripted record: its offset, key and headers, as kafka-python reads them.
Record = tuple[int, bytes | None, list[tuple[str, bytes | None]]]


class FakeScanner:
    """A one-partition log: its offsets, what a scan finds, and the topic's cleanup policy.

    What a scan finds is either given as it is (``scan``) or read from
    scripted ``records``, each counted as the real scanner counts it.
    """

    def __init__(
        self,
        scan: Scan | None = None,
        *,
        records: Sequence[Record] = (),
        log: tuple[int, int] = (0, 10),
        policy: set[str] | None = DELETE,
        tombstones_kept: float | None = DAY,
        lost_from: int | None = None,
        stable: int | None = None,
    ) -> None:
        self.scan = scan
        #: The last stable offset (read_committed's end); the log's end if None.
        self.stable = stable
        #: Each scan's range, ``(start, end)``.
        self.scans: list[tuple[int, int]] = []
        self.records = records
        self.log = log
        self.policy = policy
        self.tombstones_kept = tombstones_kept
        #: Retention cuts the log to this start while the scan reads it.
        self.lost_from = lost_from
        self.policy_asked = 0

    def partition_count(self, topic: str) -> int | None:
        """One partition."""
        return 1

    def offset_range(
        self, topic: str, partition: int, *, committed: bool = False
    ) -> tuple[int, int]:
        """The scripted log start and end (the stable end, with ``committed``)."""
        if committed and self.stable is not None:
            return self.log[0], self.stable
        return self.log

    def find(
        self,
        topic: str,
        partition: int,
        start: int,
        end: int,
        ids: Collection[str],
        *,
        keys: Collection[bytes] = (),
        progress: Callable[[], None] = lambda: None,
    ) -> Scan:
        """The scripted scan (or the scripted records' of ``[start, end)``), or the
        evidence lost under it."""
        assert end <= (self.log[1] if self.stable is None else self.stable), "past the stable end"
        self.scans.append((start, end))
        scan = self.scan
        if scan is None:
            scan = Scan()
            wanted = {i.encode() for i in ids}
            for offset, key, headers in self.records:
                if start <= offset < end:
                    scan.add(offset, key, headers, wanted, set(keys))
        if self.lost_from is not None:
            # Cut at the range's start: nothing of it was read.
            raise EvidenceLost("offsets were deleted", scan, self.lost_from, start)
        return scan

    def cleanup(self, topic: str) -> Cleanup | None:
        """The scripted policy and tombstone retention (None: not described)."""
        self.policy_asked += 1
        if self.policy is None:
            return None
        return Cleanup(frozenset(self.policy), self.tombstones_kept)

    def close(self) -> None:
        """Nothing to close."""


def _uncertain(
    *,
    key: bytes | None = b"k",
    confirmed: int | None = None,
    absence_due: bool = True,
    sent_ago: float | None = 600.0,
) -> UncertainMessage:
    offsets = {TOPIC: {"0": confirmed}} if confirmed is not None else {}
    return UncertainMessage(
        uuid.uuid4(), TOPIC, key, 1, 0, {TOPIC: 1}, offsets, 7, absence_due, sent_ago=sent_ago
    )


def _decide(
    scanner: FakeScanner, *messages: UncertainMessage, later: Collection[uuid.UUID] = ()
) -> dict[uuid.UUID, str]:
    store = FakeStore(list(messages))
    store.later = set(later)
    report = Reconciler(store, scanner, "test").run_once()
    verdicts = dict.fromkeys(report.delivered, "delivered")
    verdicts |= dict.fromkeys(report.pending, "pending")
    verdicts |= dict.fromkeys(report.escalated, "escalated")
    verdicts |= dict.fromkeys(report.deferred, "deferred")
    return verdicts


def test_absent_within_the_grace_waits_even_where_it_would_escalate() -> None:
    """Within the grace nothing absent is decided: not pending, and not escalated either."""
    compacted = FakeScanner(Scan(key_records={b"k": 2}), policy={"compact"})
    early = _uncertain(absence_due=False)
    truncated = _uncertain(confirmed=50, absence_due=False)

    verdicts = _decide(compacted, early, truncated)

    assert verdicts == {early.id: "deferred", truncated.id: "deferred"}


def test_a_range_cut_by_retention_mid_scan_escalates_only_where_it_was_cut() -> None:
    """Deleted up to 4 while read: a message whose range starts below 4 lost its evidence;
    one whose range starts at 4 or above is read again next pass; a found one is delivered."""
    found = _uncertain(key=b"f")
    scanner = FakeScanner(Scan(found={str(found.id): [6]}), policy={"delete"}, lost_from=4)
    below = _uncertain(key=b"a")  # no confirmed offset: its range starts at 0
    above = _uncertain(key=b"b", confirmed=4)  # its range starts at 5

    verdicts = _decide(scanner, below, above, found)

    assert verdicts == {
        below.id: "escalated",
        above.id: "deferred",
        found.id: "delivered",
    }


def test_compaction_explains_an_absence_only_with_later_records_of_its_key() -> None:
    """On a compacted topic, absence with no record of its key in the range is proof."""
    lonely = _uncertain(key=b"lonely")
    crowded = _uncertain(key=b"crowded")
    scanner = FakeScanner(Scan(key_records={b"crowded": 1}), policy={"compact", "delete"})

    verdicts = _decide(scanner, lonely, crowded)

    assert verdicts == {lonely.id: "pending", crowded.id: "escalated"}


def test_an_unreadable_cleanup_policy_counts_as_compacted_and_a_delete_one_does_not() -> None:
    """A topic the broker would not describe is assumed compacted, and as it may keep
    tombstones for no time at all, no absence there is proof; delete is not compacted."""
    message = _uncertain()
    unknown = FakeScanner(Scan(key_records={b"k": 1}), policy=None)
    assert _decide(unknown, message) == {message.id: "escalated"}
    plain = FakeScanner(Scan(key_records={b"k": 1}), policy={"delete"})
    assert _decide(plain, message) == {message.id: "pending"}
    quiet = FakeScanner(Scan(), policy=None)
    assert _decide(quiet, message) == {message.id: "escalated"}
    assert quiet.policy_asked == 1


def _reason(scanner: FakeScanner, message: UncertainMessage) -> tuple[str, str]:
    """The one message's verdict and the reason its decision gives."""
    store = FakeStore([message])
    report = Reconciler(store, scanner, "test").run_once()
    [decision] = store.decisions
    verdict = "pending" if report.pending else "escalated" if report.escalated else "delivered"
    return verdict, decision.reason


def test_on_a_compacted_topic_absence_is_proof_only_while_a_tombstone_would_still_be_there() -> (
    None
):
    """With no record of its key in the range, only a later one removed since could have
    compacted its record away: a tombstone, kept delete.retention.ms. Its absence is proof
    while that has not passed since its attempt began sending, and not after."""
    compacted = FakeScanner(Scan(), policy={"compact"}, tombstones_kept=DAY)
    assert _reason(compacted, _uncertain(sent_ago=600.0))[0] == "pending"
    verdict, reason = _reason(compacted, _uncertain(sent_ago=DAY))
    assert verdict == "escalated"
    assert "tombstones are kept 86400s (delete.retention.ms)" in reason
    assert "its attempt began sending 86400s ago" in reason
    # Short of the day by less than the margin: too close to trust.
    assert _reason(compacted, _uncertain(sent_ago=DAY - TOMBSTONE_MARGIN))[0] == "escalated"
    # Not recorded when it began, or how long tombstones are kept: no proof either.
    verdict, reason = _reason(compacted, _uncertain(sent_ago=None))
    assert (verdict, "when its attempt began sending is not recorded" in reason) == (
        "escalated",
        True,
    )
    unknown = FakeScanner(Scan(), policy={"compact"}, tombstones_kept=None)
    verdict, reason = _reason(unknown, _uncertain())
    assert (verdict, "its delete.retention.ms could not be read" in reason) == ("escalated", True)
    # A topic that is not compacted keeps no tombstones to lose.
    assert _reason(FakeScanner(Scan(), policy={"delete"}), _uncertain(sent_ago=None))[0] == (
        "pending"
    )


#: The evidence a proof of absence takes from the topic's cleanup settings.
SETTINGS = {"cleanup_policy", "tombstones_kept_seconds"}


def test_a_proof_of_absence_records_the_cleanup_settings_it_relied_on() -> None:
    """The decision's evidence says the topic's policy, and on a compacted topic how long
    tombstones are kept and how long ago the attempt began sending."""
    for policy, expected in (
        ({"compact"}, {"cleanup_policy": ["compact"], "tombstones_kept_seconds": DAY}),
        ({"delete"}, {"cleanup_policy": ["delete"]}),
    ):
        store = FakeStore([_uncertain(sent_ago=600.0)])
        Reconciler(store, FakeScanner(Scan(), policy=policy), "test").run_once()
        [decision] = store.decisions
        assert decision.to_state is State.PENDING
        evidence = dict(decision.evidence)
        if "compact" in policy:
            assert 600.0 <= evidence.pop("sent_seconds_ago") < 601.0
        assert {k: v for k, v in evidence.items() if k in SETTINGS} == expected


class SlowScanner(FakeScanner):
    """A scan that takes ``seconds`` on the reconciler's clock."""

    def __init__(self, now: list[float], seconds: float) -> None:
        super().__init__(Scan(), policy={"compact"}, tombstones_kept=DAY)
        self.now = now
        self.seconds = seconds

    def find(
        self,
        topic: str,
        partition: int,
        start: int,
        end: int,
        ids: Collection[str],
        *,
        keys: Collection[bytes] = (),
        progress: Callable[[], None] = lambda: None,
    ) -> Scan:
        """The empty scan, once the time has passed."""
        self.now[0] += self.seconds
        return super().find(topic, partition, start, end, ids, keys=keys)


@pytest.mark.parametrize(("seconds", "verdict"), [(0.0, "pending"), (20.0, "escalated")])
def test_the_time_a_pass_takes_counts_in_how_long_ago_the_attempt_began(
    seconds: float, verdict: str
) -> None:
    """The age read with the message grows while the pass reads: a decision taken once a
    tombstone may be gone is not proof, however young the message was when read."""
    now = [0.0]
    message = _uncertain(sent_ago=DAY - TOMBSTONE_MARGIN - 10)
    store = FakeStore([message])
    reconciler = Reconciler(store, SlowScanner(now, seconds), "test", clock=lambda: now[0])

    report = reconciler.run_once()

    assert ("pending" if report.pending else "escalated" if report.escalated else "") == verdict


def test_a_message_without_a_key_missing_from_a_compacted_topic_escalates() -> None:
    """Compaction removes records that have no key: absence proves nothing there."""
    verdict, reason = _reason(FakeScanner(Scan(), policy={"compact"}), _uncertain(key=None))
    assert verdict == "escalated"
    assert "compaction removes records without a key" in reason


def test_a_later_message_of_its_key_in_the_log_escalates_and_a_foreign_header_is_ignored() -> None:
    """Resending would put it after a later message of its key; a header that is not an
    outbox id (another producer's) changes nothing."""
    message = _uncertain()
    later = uuid.uuid4()
    scanner = FakeScanner(
        records=[
            (1, b"k", [("outbox-id", str(later).encode())]),
            (2, b"k", [("outbox-id", b"not-an-id")]),
        ],
        policy={"delete"},
    )

    assert _decide(scanner, message, later={later}) == {message.id: "escalated"}
    assert _decide(scanner, message) == {message.id: "pending"}


def test_a_partition_that_ends_below_the_confirmed_offset_escalates_after_the_grace() -> None:
    """The log was truncated or the topic created again: the range means nothing."""
    message = _uncertain(confirmed=50)
    scanner = FakeScanner(Scan(), log=(0, 3), policy={"delete"})

    assert _decide(scanner, message) == {message.id: "escalated"}


def test_each_partition_decided_counts_as_progress() -> None:
    """A pass reports progress after every partition, so a long pass is not a stuck loop."""
    scanner = FakeScanner(Scan(), policy={"delete"})
    store = FakeStore([_uncertain()])
    reconciler = Reconciler(store, scanner, "test")
    turns: list[int] = []
    reconciler.progress = lambda: turns.append(1)

    reconciler.run_once()

    assert turns == [1]


#: ``outbox-id`` headers that hold no message id, as another producer may write them.
FOREIGN_ID_HEADERS: list[list[tuple[str, bytes | None]]] = [
    [("outbox-id", b"\xff\xfe\x80")],  # not UTF-8
    [("outbox-id", b"not-a-uuid")],
    [("outbox-id", b"")],
    [("outbox-id", None)],  # a header without a value
    [("outbox-id", str(uuid.uuid4()).upper().encode())],  # a UUID, not as the publisher writes it
    [("outbox-id", str(uuid.uuid4()).encode()), ("outbox-id", b"\x80")],  # repeated
]


def test_records_whose_outbox_id_holds_no_message_id_are_skipped() -> None:
    """Records of the messages' keys with an undecodable, empty, valueless or repeated
    outbox-id stop nothing: one message is found among them, the other proven absent."""
    found, absent = _uncertain(key=b"f"), _uncertain(key=b"a")
    foreign: list[Record] = [
        (offset, key, headers)
        for offset, (key, headers) in enumerate(
            (key, headers) for key in (b"f", b"a", None) for headers in FOREIGN_ID_HEADERS
        )
    ]
    own: Record = (len(foreign), b"f", [("outbox-id", str(found.id).encode())])
    scanner = FakeScanner(records=[*foreign, own], log=(0, len(foreign) + 1), policy={"delete"})
    store = FakeStore([found, absent])

    report = Reconciler(store, scanner, "test").run_once()

    assert (report.delivered, report.pending, report.escalated) == ([found.id], [absent.id], [])


def test_a_record_s_id_is_its_last_outbox_id_header() -> None:
    """As a consumer reads it: a record whose last outbox-id is the message's id is its
    record; one whose last outbox-id is another value is not."""
    message = _uncertain()
    own = str(message.id).encode()
    last = FakeScanner(records=[(3, b"k", [("outbox-id", b"\x80"), ("outbox-id", own)])])
    earlier = FakeScanner(
        records=[(3, b"k", [("outbox-id", own), ("outbox-id", b"\x80")])], policy={"delete"}
    )

    assert _decide(last, message) == {message.id: "delivered"}
    assert _decide(earlier, message) == {message.id: "pending"}


def test_foreign_id_headers_are_reported_once_per_partition(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another producer's outbox-id headers are logged as a warning at the first pass that
    reads them, not again at every pass."""
    message = _uncertain(absence_due=False)  # left for later passes
    scanner = FakeScanner(records=[(0, None, [("outbox-id", b"junk")])])
    reconciler = Reconciler(FakeStore([message]), scanner, "test")

    with caplog.at_level(logging.WARNING, logger="publisher.reconciler"):
        reconciler.run_once()
        reconciler.run_once()

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "orders[0]: skipped 1 record(s) whose outbox-id header holds no message id: "
        "another producer writes that header to this topic"
    ]


# --- messages sent in a Kafka transaction ----------------------------------------


class FakeFencer:
    """Records the transactional.ids it fences; fails those it is told to."""

    def __init__(
        self, *, failing: Collection[str] = (), error: kafka_errors.KafkaError | None = None
    ) -> None:
        self.fenced: list[str] = []
        self.failing = set(failing)
        self.error = error or kafka_errors.KafkaTimeoutError("the coordinator did not answer")

    def fence(self, transactional_id: str) -> None:
        """Fence, or fail as scripted."""
        if transactional_id in self.failing:
            raise self.error
        self.fenced.append(transactional_id)


def _sent_in_transaction(transactional_id: str = "outbox-p-1") -> UncertainMessage:
    return replace(_uncertain(confirmed=2), transactional_id=transactional_id)


def test_a_transactional_message_is_decided_after_its_session_is_fenced() -> None:
    """Fenced first, then read committed: absent means never committed, so pending."""
    message = _sent_in_transaction()
    scanner = FakeScanner(records=[])
    fencer = FakeFencer()
    report = Reconciler(FakeStore([message]), scanner, "test", fencer=fencer).run_once()
    assert fencer.fenced == ["outbox-p-1"]
    assert scanner.scans == [(3, 10)]
    assert report.pending == [message.id]


def test_a_transactional_message_found_committed_is_delivered() -> None:
    """Its record read committed after the fence: delivered at that offset."""
    message = _sent_in_transaction()
    scanner = FakeScanner(records=[(5, b"k", [("outbox-id", str(message.id).encode())])])
    report = Reconciler(FakeStore([message]), scanner, "test", fencer=FakeFencer()).run_once()
    assert report.delivered == [message.id]


def test_a_session_that_cannot_be_fenced_leaves_its_messages_undecided() -> None:
    """The fence fails (broker away): nothing is read or decided; the others go on."""
    stuck, other = _sent_in_transaction("outbox-a-1"), _uncertain(confirmed=2)
    scanner = FakeScanner(records=[])
    fencer = FakeFencer(failing={"outbox-a-1"})
    report = Reconciler(FakeStore([stuck, other]), scanner, "test", fencer=fencer).run_once()
    assert report.deferred == [stuck.id]
    assert report.pending == [other.id]
    assert scanner.scans == [(3, 10)]  # only the idempotent message's range


def test_the_messages_of_a_session_that_cannot_be_fenced_say_why_they_wait() -> None:
    """The broker answers the fence with an error: each message of that session gets a
    note naming the session and the kind of error; a message decided in the same pass
    gets none. Once the fence succeeds, the note is taken back."""
    stuck = [replace(_sent_in_transaction("outbox-a-1"), seq=seq) for seq in (1, 2)]
    other = replace(_uncertain(confirmed=2), seq=3)
    store = FakeStore([*stuck, other])
    fencer = FakeFencer(
        failing={"outbox-a-1"}, error=kafka_errors.CoordinatorNotAvailableError("loading")
    )
    scanner = FakeScanner(records=[], stable=6)  # the fenced messages stay undecided
    reconciler = Reconciler(store, scanner, "test", fencer=fencer)
    report = reconciler.run_once()
    assert set(store.notes) == {m.id for m in stuck}
    note = store.notes[stuck[0].id]
    assert report.waiting == {note: 2}
    assert note == (
        "reconciliation waits: the producer session outbox-a-1 that sent it could not be "
        "fenced (CoordinatorNotAvailableError); each reconciliation pass tries again"
    )

    fencer.failing.clear()
    again = reconciler.run_once()
    assert fencer.fenced == ["outbox-a-1"]
    assert {m.id for m in stuck} <= set(again.deferred)  # read up to the stable end only
    assert again.waiting == {}
    assert store.notes == {}


def test_a_session_out_of_reach_gets_no_note_and_fails_a_pass_left_with_nothing() -> None:
    """Kafka out of reach says nothing about the session: no note. When that leaves the
    pass nothing to decide, the pass fails with the error (the loop counts Kafka as
    unavailable); with other messages left, it goes on with them."""
    stuck = _sent_in_transaction("outbox-a-1")
    store = FakeStore([stuck])
    fencer = FakeFencer(failing={"outbox-a-1"})  # KafkaTimeoutError
    with pytest.raises(kafka_errors.KafkaTimeoutError):
        Reconciler(store, FakeScanner(records=[]), "test", fencer=fencer).run_once()
    assert store.notes == {}

    other = replace(_uncertain(confirmed=2), seq=3)
    store = FakeStore([stuck, other])
    report = Reconciler(store, FakeScanner(records=[]), "test", fencer=fencer).run_once()
    assert (report.deferred, report.pending, report.waiting) == ([stuck.id], [other.id], {})
    assert store.notes == {}


def test_a_fence_the_broker_refuses_says_which_right_to_grant() -> None:
    """No TransactionalId ACL: the note says what to grant, on which id."""
    message = _sent_in_transaction("outbox-b-7")
    store = FakeStore([message])
    fencer = FakeFencer(
        failing={"outbox-b-7"}, error=kafka_errors.TransactionalIdAuthorizationFailedError()
    )
    report = Reconciler(store, FakeScanner(records=[]), "test", fencer=fencer).run_once()
    assert report.deferred == [message.id]
    note = store.notes[message.id]
    assert "(TransactionalIdAuthorizationFailedError); grant the publisher's Kafka " in note
    assert "Write and Describe on TransactionalId outbox-b-7 (the prefix outbox-" in note


def test_without_a_fencer_a_transactional_message_waits() -> None:
    """No fencer: its session may still write, so its absence proves nothing yet."""
    message = _sent_in_transaction()
    report = Reconciler(FakeStore([message]), FakeScanner(records=[]), "test").run_once()
    assert report.deferred == [message.id]
    assert report.decided == 0


@pytest.mark.parametrize("transactional", [True, False], ids=["transactional", "idempotent"])
def test_an_open_transaction_below_the_end_defers_the_decision(*, transactional: bool) -> None:
    """Another transaction still open below the end: read_committed cannot see past it yet.
    What is stable is read now, and the rest once the transaction has ended."""
    message = _sent_in_transaction() if transactional else _uncertain(confirmed=2)
    scanner = FakeScanner(records=[], log=(0, 10), stable=6)
    reconciler = Reconciler(FakeStore([message]), scanner, "test", fencer=FakeFencer())
    first = reconciler.run_once()
    assert first.deferred == [message.id]
    assert scanner.scans == [(3, 6)]
    scanner.stable = 10  # the other transaction has ended
    assert reconciler.run_once().pending == [message.id]
    assert scanner.scans == [(3, 6), (6, 10)]


#: How long a transaction holds the reads back before its messages say so, in these tests.
HELD_LONG = 75.0


def test_a_transaction_that_holds_the_reads_back_long_is_named_on_its_messages() -> None:
    """A transaction open for longer than a publisher's own (another producer's, left
    hanging) keeps read_committed reads below it: its messages say so in their last_error
    once it has held them for ``held_back_note_after``; the note goes when the reads go
    on, and one naming an offset the reads are no longer held at goes at once."""
    message = _uncertain(confirmed=2)
    other = replace(_uncertain(confirmed=7), seq=2)  # its whole range lies past it
    now = [0.0]
    scanner = FakeScanner(records=[], log=(0, 10), stable=6)
    store = FakeStore([message, other])
    reconciler = Reconciler(
        store, scanner, "test", held_back_note_after=HELD_LONG, clock=lambda: now[0]
    )

    first = reconciler.run_once()
    assert set(first.deferred) == {message.id, other.id}
    assert (first.waiting, store.notes) == ({}, {})  # a transaction may be short
    now[0] = HELD_LONG - 1
    assert reconciler.run_once().waiting == {}
    now[0] = HELD_LONG
    held = reconciler.run_once()
    note = held_back_note(TOPIC, 0, 6)
    assert note.startswith(WAITING_NOTE)
    assert "orders[0] since offset 6" in note
    assert held.waiting == {note: 2}
    assert store.notes == {message.id: note, other.id: note}

    scanner.stable = 8  # that transaction ended; another holds the reads at 8, for now
    assert reconciler.run_once().waiting == {}
    assert store.notes == {}  # "since offset 6" is no longer so
    now[0] += HELD_LONG
    assert reconciler.run_once().waiting == {held_back_note(TOPIC, 0, 8): 2}
    scanner.stable = None  # it ended too
    assert set(reconciler.run_once().pending) == {message.id, other.id}
    assert scanner.scans == [(3, 6), (6, 8), (8, 10)]


def test_a_note_another_reconciler_wrote_stays_while_it_still_holds() -> None:
    """A reconciler that has not timed the transaction yet (`outbox-publisher reconcile`,
    a publisher just started) leaves a note that names where the reads are held, and
    takes off one that names another offset."""
    message = _uncertain(confirmed=2)
    stale = replace(_uncertain(confirmed=2), seq=2)
    scanner = FakeScanner(records=[], log=(0, 10), stable=6)
    store = FakeStore([message, stale])
    store.notes = {message.id: held_back_note(TOPIC, 0, 6), stale.id: held_back_note(TOPIC, 0, 3)}
    reconciler = Reconciler(store, scanner, "test", held_back_note_after=HELD_LONG)
    assert set(reconciler.run_once().deferred) == {message.id, stale.id}
    assert store.notes == {message.id: held_back_note(TOPIC, 0, 6)}
    scanner.stable = None  # decided now: the decision's reason replaces the note
    assert set(reconciler.run_once().pending) == {message.id, stale.id}


def test_the_clock_of_a_held_partition_goes_on_over_passes_that_need_nothing_past_it() -> None:
    """A pass whose ranges end below the held offset (another page) does not restart the
    transaction's clock: held back long is measured from when it was first seen."""
    message = _uncertain(confirmed=2)
    now = [0.0]
    scanner = FakeScanner(records=[], log=(0, 10), stable=6)
    store = FakeStore([message])
    reconciler = Reconciler(
        store, scanner, "test", held_back_note_after=HELD_LONG, clock=lambda: now[0]
    )
    reconciler.run_once()
    scanner.log = (0, 12)  # the log grew past the bound: the transaction is still open at 6
    now[0] = HELD_LONG
    assert reconciler.run_once().waiting == {held_back_note(TOPIC, 0, 6): 1}


def test_a_session_is_fenced_once() -> None:
    """Two passes over messages of one session fence it once."""
    fencer = FakeFencer()
    scanner = FakeScanner(records=[], stable=6)  # kept undecided, so it comes back
    message = _sent_in_transaction()
    reconciler = Reconciler(FakeStore([message]), scanner, "test", fencer=fencer)
    reconciler.run_once()
    reconciler.run_once()
    assert fencer.fenced == ["outbox-p-1"]


def test_a_page_of_messages_that_wait_does_not_keep_the_next_page_waiting() -> None:
    """A full page of messages whose session cannot be fenced: the next pass goes on after
    it, and decides the message there; the pass after that starts over."""
    stuck = [replace(_sent_in_transaction("outbox-a-1"), seq=seq) for seq in (1, 2)]
    other = replace(_uncertain(confirmed=2), seq=3)
    scanner = FakeScanner(records=[])
    # The broker answers, with an error: a page whose messages all wait, not Kafka away.
    fencer = FakeFencer(failing={"outbox-a-1"}, error=kafka_errors.CoordinatorNotAvailableError())
    store = FakeStore([*stuck, other])
    reconciler = Reconciler(store, scanner, "test", fencer=fencer, limit=2)

    first = reconciler.run_once()
    assert first.deferred == [m.id for m in stuck]
    assert reconciler.pages_left
    second = reconciler.run_once()
    assert (second.pending, second.deferred) == ([other.id], [])
    assert not reconciler.pages_left
    third = reconciler.run_once()
    assert third.deferred == [m.id for m in stuck]
    assert [d.message_id for d in store.decisions] == [other.id]


# --- a busy partition: the end moves on while the range is read ----------------


class BusyPartition:
    """A one-partition log another producer appends to at every look at its end, read
    at most ``per_pass`` offsets per scan, as a scan that runs out of time reads.

    The other producer's records have the key ``b"other"``, except those at
    ``keyed_at``, which have the message's key ``b"k"``.
    """

    def __init__(
        self,
        records: dict[int, Record],
        *,
        end: int,
        growth: int,
        per_pass: int,
        policy: set[str] = DELETE,
        keyed_at: Collection[int] = (),
    ) -> None:
        self.records = {offset: (key, headers) for offset, key, headers in records.values()}
        self.end = end
        self.growth = growth
        self.per_pass = per_pass
        self.policy = policy
        self.keyed_at = set(keyed_at)
        #: Each scan's range as asked: (start, end).
        self.scans: list[tuple[int, int]] = []

    def partition_count(self, topic: str) -> int | None:
        """One partition."""
        return 1

    def offset_range(
        self, topic: str, partition: int, *, committed: bool = False
    ) -> tuple[int, int]:
        """The log end, after the other producer appended ``growth`` more records (at
        each look at the high watermark; its records are in no transaction, so the last
        stable offset is the end as it stands)."""
        if committed:
            return 0, self.end
        for offset in range(self.end, self.end + self.growth):
            self.records[offset] = (b"k" if offset in self.keyed_at else b"other", [])
        self.end += self.growth
        return 0, self.end

    def find(
        self,
        topic: str,
        partition: int,
        start: int,
        end: int,
        ids: Collection[str],
        *,
        keys: Collection[bytes] = (),
        progress: Callable[[], None] = lambda: None,
    ) -> Scan:
        """Read ``[start, end)``, or its first ``per_pass`` offsets and stop there."""
        self.scans.append((start, end))
        stop = min(end, start + self.per_pass)
        scan = Scan()
        wanted = {i.encode() for i in ids}
        for offset in range(start, stop):
            if offset in self.records:
                key, headers = self.records[offset]
                scan.add(offset, key, headers, wanted, set(keys))
        if stop < end:
            raise ScanIncomplete(f"read up to {stop} of [{start}, {end})", scan, stop)
        return scan

    def cleanup(self, topic: str) -> Cleanup | None:
        """The scripted policy, tombstones kept a day."""
        return Cleanup(frozenset(self.policy), DAY)

    def close(self) -> None:
        """Nothing to close."""


def _passes_until_decided(
    reconciler: Reconciler, store: FakeStore, *, most: int = 20
) -> tuple[int, Decision]:
    """Run passes until one decides the store's one message; how many it took, and what."""
    for turn in range(1, most + 1):
        if reconciler.run_once().decided:
            [decision] = store.decisions
            return turn, decision
    pytest.fail(f"still undecided after {most} passes")


@pytest.mark.parametrize("transactional", [False, True], ids=["idempotent", "transactional"])
@pytest.mark.parametrize("present", [True, False], ids=["found", "proven-absent"])
def test_a_range_longer_than_a_pass_on_a_busy_partition_is_decided_in_bounded_passes(
    *, present: bool, transactional: bool
) -> None:
    """The end grows by 25 at every look and a pass reads 30 offsets: the range stops at
    the end first seen once its producer could write nothing more (100), and each pass
    goes on where the last stopped, so the message is decided within four passes (its
    record at 70 is found in the third)."""
    message = _uncertain(confirmed=0)  # its range starts at 1
    if transactional:
        message = replace(message, transactional_id="outbox-p-1")
    own: dict[int, Record] = {}
    if present:
        own[70] = (70, b"k", [("outbox-id", str(message.id).encode())])
    log = BusyPartition(own, end=75, growth=25, per_pass=30)
    store = FakeStore([message])
    fencer = FakeFencer() if transactional else None

    passes, decision = _passes_until_decided(Reconciler(store, log, "test", fencer=fencer), store)

    assert passes == (3 if present else 4)
    assert log.scans == [(1, 100), (31, 100), (61, 100), (91, 100)][:passes]
    if present:
        assert (decision.to_state, decision.offset) == (State.DELIVERED, 70)
    else:
        assert decision.to_state is State.PENDING
        assert "offsets [1, 100)" in decision.reason
    assert (decision.evidence["scan_to"], decision.evidence["passes"]) == (100, passes)


def test_within_the_grace_the_range_follows_the_end_and_is_bounded_once_due() -> None:
    """Before the grace has passed the end of the moment is read (a record found counts),
    and what was read is not read again once the range gets its bound."""
    early = _uncertain(confirmed=0, absence_due=False)
    log = BusyPartition({}, end=0, growth=10, per_pass=1000)
    store = FakeStore([early])
    reconciler = Reconciler(store, log, "test")

    assert reconciler.run_once().deferred == [early.id]
    store.due = [replace(early, absence_due=True)]
    passes, decision = _passes_until_decided(reconciler, store)

    assert passes == 1
    assert log.scans == [(1, 10), (10, 20)]
    assert decision.to_state is State.PENDING
    assert decision.evidence["scan_to"] == 20


@pytest.mark.parametrize("keyed", [True, False], ids=["key-written-past-bound", "quiet-key"])
def test_on_a_busy_compacted_topic_records_of_its_key_past_the_bound_are_looked_for(
    *, keyed: bool
) -> None:
    """A record of its key written after the bound could have compacted its record away
    before the scan read it: its key is looked for up to the end seen after that read
    (a fixed offset too), and found there it escalates; not found, absence is proof."""
    message = _uncertain(confirmed=0)
    # The other producer writes the message's key at offset 110, past the bound (100).
    log = BusyPartition(
        {}, end=75, growth=25, per_pass=30, policy={"compact"}, keyed_at={110} if keyed else ()
    )
    store = FakeStore([message])

    passes, decision = _passes_until_decided(Reconciler(store, log, "test"), store)

    assert passes <= 8
    if keyed:
        assert decision.to_state is State.UNCERTAIN
        assert "the topic is compacted" in decision.reason
    else:
        assert decision.to_state is State.PENDING
    assert max(end for _, end in log.scans) < log.end  # never chasing the moving end


class TwoTopicScanner(FakeScanner):
    """A log per topic; reading ``broken`` fails as a record the client cannot decode does."""

    def __init__(self, broken: str, found: UncertainMessage) -> None:
        super().__init__(Scan(found={str(found.id): [3]}))
        self.broken = broken

    def find(
        self,
        topic: str,
        partition: int,
        start: int,
        end: int,
        ids: Collection[str],
        *,
        keys: Collection[bytes] = (),
        progress: Callable[[], None] = lambda: None,
    ) -> Scan:
        """Fails on the broken topic; the scripted scan elsewhere."""
        if topic == self.broken:
            raise kafka_errors.CorruptRecordError("a header name is not UTF-8")
        return super().find(topic, partition, start, end, ids, keys=keys)


def test_a_partition_that_cannot_be_read_defers_its_own_messages_only() -> None:
    """One topic's log cannot be read: its message waits for a later pass, and the other
    topic's message is decided and stored in the same pass."""
    found = _uncertain(key=b"a")
    stuck = replace(_uncertain(key=b"b"), topic="shared", seq=8)
    store = FakeStore([found, stuck])

    report = Reconciler(store, TwoTopicScanner("shared", found), "test").run_once()

    assert (report.delivered, report.deferred) == ([found.id], [stuck.id])
    assert [d.message_id for d in store.decisions] == [found.id]


def test_a_pass_in_which_nothing_could_be_read_fails_as_kafka_being_away_does() -> None:
    """Every due message's log failed: the pass raises the error (the loop then says Kafka
    is unavailable) and decides nothing."""
    stuck = replace(_uncertain(key=b"b"), topic="shared")
    store = FakeStore([stuck])

    with pytest.raises(kafka_errors.CorruptRecordError):
        Reconciler(store, TwoTopicScanner("shared", stuck), "test").run_once()
    assert store.decisions == []


@pytest.mark.parametrize("waiting", [2, 3, 4])
def test_a_cycle_reads_every_page_once_and_ends(waiting: int) -> None:
    """outbox-publisher reconcile's cycle ends after the last page, also when the messages
    that wait fill their pages exactly (the pass after a full last page starts over)."""
    early = [replace(_uncertain(absence_due=False), seq=seq) for seq in range(1, waiting + 1)]
    reconciler = Reconciler(FakeStore(early), FakeScanner(records=[]), "test", limit=2)

    reports = list(itertools.islice(reconciler.run_cycle(), 10))

    assert len(reports) == (waiting + 1) // 2 + (1 if waiting % 2 == 0 else 0)
    assert {i for r in reports for i in r.deferred} == {m.id for m in early}


class NoTopicScanner(FakeScanner):
    """The topic is not in the metadata (deleted, or hidden from the scanner by its ACLs)."""

    def partition_count(self, topic: str) -> int | None:
        """Unknown."""
        return None


def test_a_topic_missing_from_the_metadata_escalates_only_after_the_grace() -> None:
    """A topic the scanner cannot see is evidence gone, an operator's to decide only after
    the grace (a broker not up to date, or ACLs being fixed, may show it again); the reason
    names both causes."""
    early = _uncertain(absence_due=False)
    late = _uncertain(key=b"other")
    store = FakeStore([early, late])

    report = Reconciler(store, NoTopicScanner(), "test").run_once()

    assert (report.escalated, report.deferred) == ([late.id], [early.id])
    [decision] = store.decisions
    assert "no longer exists, or the scanner may not see it" in decision.reason


def test_when_no_broker_answers_a_fence_the_other_sessions_wait_for_a_later_pass() -> None:
    """A fence that found no broker: the other sessions would wait out the same timeouts
    one after another, holding the loop; they are not tried this pass, and every fence
    tried turns the loop's progress clock."""
    first = replace(_sent_in_transaction("outbox-a-1"), seq=1)
    second = replace(_sent_in_transaction("outbox-b-1"), seq=2)
    other = replace(_uncertain(confirmed=2), seq=3)  # so that the pass has one to decide
    fencer = FakeFencer(failing={"outbox-a-1"})
    reconciler = Reconciler(
        FakeStore([first, second, other]), FakeScanner(records=[]), "test", fencer=fencer
    )
    turns: list[None] = []
    reconciler.progress = lambda: turns.append(None)

    report = reconciler.run_once()

    assert report.deferred == [first.id, second.id]
    assert report.pending == [other.id]
    assert fencer.fenced == []
    assert len(turns) == 2  # the fence tried, and the partition decided


def test_what_a_cycle_of_pages_no_longer_sees_is_forgotten() -> None:
    """With pages always full, the ranges read so far were never pruned: a message decided
    elsewhere kept its range for ever. A cycle of pages that no longer sees a message
    forgets its range."""
    waiting = [
        replace(_uncertain(key=k, absence_due=False), seq=n)
        for n, k in enumerate([b"a", b"b", b"c"], start=1)
    ]
    store = FakeStore(waiting)
    reconciler = Reconciler(store, FakeScanner(records=[]), "test", limit=2)
    gone = (waiting[0].id, waiting[0].fence)

    for _ in range(2):  # the first cycle: both pages
        reconciler.run_once()
    assert gone in reconciler._ranges
    store.due = waiting[1:]  # decided by another publisher, or an operator
    for _ in range(2):  # the next cycle (one full page), then the start of the one after
        reconciler.run_once()

    assert gone not in reconciler._ranges
    assert (waiting[1].id, waiting[1].fence) in reconciler._ranges


class PollingScanner(FakeScanner):
    """A scan that polls three times, telling its progress after each poll."""

    def find(
        self,
        topic: str,
        partition: int,
        start: int,
        end: int,
        ids: Collection[str],
        *,
        keys: Collection[bytes] = (),
        progress: Callable[[], None] = lambda: None,
    ) -> Scan:
        """Three polls, then the scripted scan."""
        for _ in range(3):
            progress()
        return super().find(topic, partition, start, end, ids, keys=keys)


def test_a_long_scan_of_one_partition_turns_the_loops_progress_clock_as_it_reads() -> None:
    """A scan of one partition may read for a minute: each poll tells the loop it moves, not
    only the end of the partition (the loop would be taken for stuck and restarted)."""
    reconciler = Reconciler(FakeStore([_uncertain()]), PollingScanner(records=[]), "test")
    turns: list[None] = []
    reconciler.progress = lambda: turns.append(None)

    reconciler.run_once()

    assert len(turns) == 3 + 1  # each poll, then the partition decided


class CutMidScanScanner(FakeScanner):
    """Pass 1: the log ends at 5 and the scan stops at 2 (out of time). Pass 2: the log
    ends at 10, and retention deletes up to 8 when the scan has read up to 7."""

    def __init__(self) -> None:
        super().__init__(records=[], policy={"delete"})
        self.passes = 0

    def offset_range(
        self, topic: str, partition: int, *, committed: bool = False
    ) -> tuple[int, int]:
        """The log as it was when the pass began."""
        return (0, 5) if self.passes < 2 else (0, 10)

    def find(
        self,
        topic: str,
        partition: int,
        start: int,
        end: int,
        ids: Collection[str],
        *,
        keys: Collection[bytes] = (),
        progress: Callable[[], None] = lambda: None,
    ) -> Scan:
        """Out of time at 2, then cut at 7."""
        if self.passes == 1:
            raise ScanIncomplete("out of time", Scan(), 2)
        raise EvidenceLost("offsets 7 to 8 were deleted", Scan(), 8, 7)


def test_a_range_read_whole_before_retention_cut_the_scan_is_decided() -> None:
    """A scan shared by two messages is cut by retention at 7: the message whose range ended
    at 5 was read whole, and is decided (absent: pending), not escalated; the one whose
    range runs to 10 lost its evidence and is escalated."""
    early = replace(_uncertain(key=b"a"), seq=1)
    late = replace(_uncertain(key=b"b", absence_due=False), seq=2)
    store = FakeStore([early, late])
    scanner = CutMidScanScanner()
    reconciler = Reconciler(store, scanner, "test")

    scanner.passes = 1
    assert reconciler.run_once().deferred == [early.id, late.id]  # its bound is 5 now
    store.due = [early, replace(late, absence_due=True)]
    scanner.passes = 2
    report = reconciler.run_once()

    assert (report.pending, report.escalated) == ([early.id], [late.id])
