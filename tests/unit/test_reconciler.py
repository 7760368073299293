"""The reconciler's decision rules, on a scripted log (the real broker is in the integration tests).

A record not found proves absence only once the grace after its write
deadline has passed, only where the range it could be in was read, and only
where neither compaction nor a later message of its key can explain it.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from typing import Any

from publisher.reconciler import Reconciler
from publisher.scanner import EvidenceLost, Scan
from publisher.store import Decision, PublisherStore, UncertainMessage

TOPIC = "orders"


class FakeStore(PublisherStore):
    """Serves prepared uncertain messages; applies every decision it is given."""

    def __init__(self, due: list[UncertainMessage]) -> None:
        super().__init__("postgresql://unused", uuid.uuid4())
        self.due = due
        self.later: set[uuid.UUID] = set()

    def uncertain_due(self, limit: int = 1000, grace: float = 0.0) -> list[UncertainMessage]:
        """The prepared messages."""
        return self.due

    def later_of_key(self, message_id: uuid.UUID, ids: Collection[uuid.UUID]) -> set[uuid.UUID]:
        """Those of ``ids`` declared later messages of the key."""
        return set(ids) & self.later

    def decide(self, decisions: Sequence[Decision], decided_by: str) -> set[uuid.UUID]:
        """Every decision applies."""
        return {d.message_id for d in decisions}


class FakeScanner:
    """A one-partition log: its offsets, what a scan finds, and the topic's cleanup policy."""

    def __init__(
        self,
        scan: Scan,
        *,
        log: tuple[int, int] = (0, 10),
        policy: set[str] | None = None,
        lost_from: int | None = None,
    ) -> None:
        self.scan = scan
        self.log = log
        self.policy = policy
        #: Retention cuts the log to this start while the scan reads it.
        self.lost_from = lost_from
        self.policy_asked = 0

    def partition_count(self, topic: str) -> int | None:
        """One partition."""
        return 1

    def offset_range(self, topic: str, partition: int) -> tuple[int, int]:
        """The scripted log start and end."""
        return self.log

    def find(self, *args: Any, **kwargs: Any) -> Scan:
        """The scripted scan, or the evidence lost under it."""
        if self.lost_from is not None:
            raise EvidenceLost("offsets were deleted", self.scan, self.lost_from)
        return self.scan

    def cleanup_policy(self, topic: str) -> set[str] | None:
        """The scripted policy."""
        self.policy_asked += 1
        return self.policy

    def close(self) -> None:
        """Nothing to close."""


def _uncertain(
    *, key: bytes | None = b"k", confirmed: int | None = None, absence_due: bool = True
) -> UncertainMessage:
    offsets = {TOPIC: {"0": confirmed}} if confirmed is not None else {}
    return UncertainMessage(uuid.uuid4(), TOPIC, key, 1, 0, {TOPIC: 1}, offsets, 7, absence_due)


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
    """A policy the broker would not describe is assumed compacted; delete is not."""
    message = _uncertain()
    unknown = FakeScanner(Scan(key_records={b"k": 1}), policy=None)
    assert _decide(unknown, message) == {message.id: "escalated"}
    plain = FakeScanner(Scan(key_records={b"k": 1}), policy={"delete"})
    assert _decide(plain, message) == {message.id: "pending"}
    # With no record of its key in the range, the policy is not even asked.
    quiet = FakeScanner(Scan(), policy=None)
    assert _decide(quiet, message) == {message.id: "pending"}
    assert quiet.policy_asked == 0


def test_a_later_message_of_its_key_in_the_log_escalates_and_a_foreign_header_is_ignored() -> None:
    """Resending would put it after a later message of its key; a header that is not an
    outbox id (another producer's) changes nothing."""
    message = _uncertain()
    later = uuid.uuid4()
    scanner = FakeScanner(Scan(by_key={b"k": {str(later), "not-an-id"}}), policy={"delete"})

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
