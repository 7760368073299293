"""Deciding uncertain messages from what Kafka holds.

A message is uncertain when its record may or may not have been written. Once
the producer that sent it can no longer write (its lease is gone and the
delivery timeout has passed since sending began), the reconciler reads the
message's partition from the highest offset confirmed before its attempt to
its bound, looking for the message id in the ``outbox-id`` header. The bound
is the partition's end the first time it is observed once that producer can
write nothing more (see ``Reconciler._range_of``): fixed, however fast other
producers append; and a pass that runs out of time leaves the next one to go
on where it stopped (``_Range``), so every range is read to its end.

* found: ``delivered`` at the offset found;
* not found, once a grace period after the write deadline has passed too
  (``absence_grace``, 1.5 times the brokers' ``replica.lag.time.max.ms`` and
  more: a record the leader wrote but its followers had not copied yet sits
  above the high watermark, invisible to the scan, until they copy it or the
  leader drops them from the ISR, which it does only up to 1.5 times that
  after they fell behind, and once the controller agrees):
  ``pending``, with the scanned range recorded as the proof, so it is sent
  again; before that, it is left for a later pass;
* the evidence is gone or cannot be trusted: it stays ``uncertain``, is
  marked escalated with the reason, and an operator decides. That is when
  the topic or partition no longer exists; when offsets to read were deleted
  by retention, before or during the scan; when the partition now ends below
  the offset confirmed before the attempt (the log was truncated, or the
  topic deleted and created again); and when the record is missing from a
  compacted topic, which removes records from the middle of its log, where
  a later record of its key may have removed it: one in the range read, or
  a tombstone removed since (``Reconciler._compacted_away``). A message
  proven absent while later messages of its key are in Kafka is escalated
  too (``OVERTAKEN_NOTE``): nothing is gone, but only a person may send it
  after them, or drop it.

A message sent in a Kafka transaction (``--delivery transactional``) is
decided without waiting for a write deadline or a grace: first the
transactional.id its batch was sent under is fenced (``publisher.fencing``),
so that session's open transaction is aborted or its commit completed and it
can write nothing more; then the partition is read up to the end offset seen
after the fence. Found: ``delivered``; absent: never committed, ``pending``. A
session that cannot be fenced now (the broker is away, or refuses the
publisher that transactional.id) leaves its messages uncertain for a later
pass; when the broker refused, their ``last_error`` says why until the fence
succeeds.

Every range is read read_committed, in both delivery modes: a record of an
aborted transaction was never delivered to the consumers that matter, so it is
no evidence. One can carry the message's own id when an earlier attempt was
sent in a transaction that aborted and the delivery mode changed since; or
another transactional producer's records share the topic. Such a read reaches
only up to the last stable offset: a transaction still open lower down (another
publisher's) holds the rest of the range for a later pass.

Every decision is written to ``outbox.decisions`` with its evidence.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kafka import errors as kafka_errors
from kafka.errors import KafkaError

from outbox.states import OVERTAKEN_NOTE, WAITING_NOTE, State
from publisher.config import DEFAULT_ABSENCE_GRACE, LEAST_HELD_BACK_NOTE_SECONDS
from publisher.fencing import Fencer
from publisher.logs import MessageLog
from publisher.outcomes import is_unreachable
from publisher.partitioning import partition_for
from publisher.scanner import Cleanup, EvidenceLost, LogScanner, Scan, ScanIncomplete
from publisher.store import Decision, PublisherStore, UncertainMessage

log = logging.getLogger(__name__)

#: Seconds a decision keeps clear of the moment a compacted topic may have
#: removed a tombstone written after the attempt began (see
#: ``Reconciler._compacted_away``): the attempt's age is measured on the
#: database's clock (and the pass's time on the reconciler's), the tombstone's
#: retention on the broker's, and clocks differ or are stepped.
TOMBSTONE_MARGIN = 300.0


@dataclass
class ReconcileReport:
    """What one reconciliation pass decided."""

    delivered: list[uuid.UUID] = field(default_factory=list)
    pending: list[uuid.UUID] = field(default_factory=list)
    escalated: list[uuid.UUID] = field(default_factory=list)
    #: Left uncertain for a later pass (a scan that did not finish in time, a range
    #: not readable now, a session that could not be fenced).
    deferred: list[uuid.UUID] = field(default_factory=list)
    #: Why some of the deferred wait, as their ``last_error`` says it, with how many
    #: messages each (a session Kafka would not let be fenced, a transaction that
    #: holds a partition's reads back).
    waiting: dict[str, int] = field(default_factory=dict)

    @property
    def decided(self) -> int:
        """How many messages left the undecided uncertain state."""
        return len(self.delivered) + len(self.pending) + len(self.escalated)


def _scan_start(message: UncertainMessage, topic: str, partition: int) -> int:
    """First offset the message's record can be at: above what was confirmed before."""
    offsets = (message.confirmed_offsets or {}).get(topic, {})
    confirmed = offsets.get(str(partition))
    return int(confirmed) + 1 if confirmed is not None else 0


@dataclass
class _Range:
    """One uncertain message's range of its partition, as read so far, across passes.

    The range runs from ``start`` (above the offset confirmed before its
    attempt) to ``bound`` once that is known; before, to the end of the moment.
    ``[start, position)`` has been read (or found deleted: ``deleted``), and
    what was found there is kept, so a pass goes on where the last one stopped.
    Kept in memory only: a reconciler that restarts reads the range again from
    its start, with a bound observed again, later and so larger, but as safe.
    """

    start: int
    #: The first offset not read yet.
    position: int
    #: The partition's end offset the first time it was observed once the
    #: message's producer could write nothing more (see ``Reconciler``): its
    #: record, if any, is below it, so the range never reaches past it.
    bound: int | None = None
    #: Offsets of the range where its record was found.
    found: list[int] = field(default_factory=list)
    #: Records of its key read in the range (see ``Scan.key_records``).
    key_records: int = 0
    #: Message ids of the records of its key read in the range.
    key_ids: set[str] = field(default_factory=set)
    #: Offsets of its range deleted before they could be read, if any.
    deleted: tuple[int, int] | None = None
    #: Set once the range was read without finding it, on a topic that may be
    #: compacted: the end observed after that read, up to which records of its
    #: key are looked for too (one of them may have compacted its record away).
    sweep_to: int | None = None
    #: Passes that read part of the range.
    passes: int = 0

    @property
    def target(self) -> int | None:
        """Where the range ends now, if it is fixed yet."""
        return self.sweep_to if self.sweep_to is not None else self.bound

    def take(self, scan: Scan, read_to: int, *, message_id: str, key: bytes | None) -> None:
        """Add what a scan read up to ``read_to`` found of this message and its key."""
        self.passes += 1
        for offset in scan.found.get(message_id, []):
            # The shared scan may start lower, for another message of the partition.
            if offset >= self.start and offset not in self.found:
                self.found.append(offset)
        self.found.sort()
        if key is not None:
            self.key_records += scan.key_records.get(key, 0)
            self.key_ids |= scan.by_key.get(key, set())
        self.position = max(self.position, read_to)


@dataclass
class _Seen:
    """Due messages, by (id, fence), their sessions and the partitions read, seen over a
    cycle of pages."""

    messages: set[tuple[uuid.UUID, int]] = field(default_factory=set)
    sessions: set[str] = field(default_factory=set)
    partitions: set[tuple[str, int]] = field(default_factory=set)

    def add(self, due: Sequence[UncertainMessage]) -> None:
        self.messages.update((m.id, m.fence) for m in due)
        self.sessions.update(m.transactional_id for m in due if m.transactional_id)


class _Unread:
    """The topics and partitions of one pass that Kafka would not let be read.

    One that fails (a record the client cannot decode, a topic the scanner may
    not read, a partition offline) defers its own messages only: the pass
    decides and stores the others. When every one failed, the pass fails with
    the first error, as Kafka being away does.
    """

    def __init__(self, messages: int) -> None:
        self.messages = messages
        self.deferred = 0
        self.failures: list[KafkaError] = []

    @contextmanager
    def group(
        self, where: str, messages: Sequence[UncertainMessage], report: ReconcileReport
    ) -> Iterator[None]:
        try:
            yield
        except KafkaError as exc:
            self.failures.append(exc)
            self.deferred += len(messages)
            log.warning(
                "reconciliation of %s goes on next pass (%d message(s) wait): %s",
                where,
                len(messages),
                exc,
            )
            report.deferred.extend(m.id for m in messages)

    def raise_if_all_failed(self) -> None:
        if self.failures and self.deferred >= self.messages:
            raise self.failures[0]


def fence_refused_note(transactional_id: str, error: BaseException) -> str:
    """What an uncertain message says (its ``last_error``) while Kafka will not let the
    session it was sent under be fenced: the kind of error, and what to do about it.

    Only the error's class: its text can change from pass to pass (a broker's
    address, a timeout), and each change would write every waiting message
    again. The publisher's log has the whole error.
    """
    cause = type(error).__name__
    if isinstance(error, kafka_errors.TransactionalIdAuthorizationFailedError):
        action = (
            f"grant the publisher's Kafka principal Write and Describe on TransactionalId "
            f"{transactional_id} (the prefix outbox-, see docs/security.md); "
            "reconciliation goes on at the next pass after that"
        )
    else:
        action = "each reconciliation pass tries again"
    return (
        f"{WAITING_NOTE}the producer session {transactional_id} that sent it could "
        f"not be fenced ({cause}); {action}"
    )


def held_back_note(topic: str, partition: int, stable: int) -> str:
    """What an uncertain message says (its ``last_error``) while a transaction left open
    in its partition keeps read_committed reads below the offset its record may be at.

    Only the offset, which stays the same while that transaction is open: a
    note that changed from pass to pass would write every waiting message again.
    """
    return (
        f"{WAITING_NOTE}a transaction open in {topic}[{partition}] since offset {stable} "
        "(its last stable offset) holds back read_committed reads, and its record may lie "
        "past it: it is decided once that transaction ends. Kafka aborts a transaction "
        "its producer leaves open after that producer's transaction.timeout.ms; one that "
        "stays open (hanging) is listed by kafka-transactions.sh find-hanging and ended "
        "by kafka-transactions.sh abort"
    )


class Reconciler:
    """Decides uncertain messages; ``run_once`` is one pass over those that are due."""

    def __init__(
        self,
        store: PublisherStore,
        scanner: LogScanner,
        decided_by: str,
        *,
        limit: int = 1000,
        absence_grace: float = DEFAULT_ABSENCE_GRACE,
        fencer: Fencer | None = None,
        held_back_note_after: float = LEAST_HELD_BACK_NOTE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.scanner = scanner
        #: Fences transactional.ids before their batches are decided; without
        #: one, messages sent in a transaction are left for a reconciler that has it.
        self.fencer = fencer
        #: Sessions fenced by this reconciler: fenced once, they stay fenced.
        self._fenced: set[str] = set()
        self.decided_by = decided_by
        self.limit = limit
        self.absence_grace = absence_grace
        #: Called after each poll of a scan and each partition decided: a long pass is not a
        #: stuck loop.
        self.progress: Callable[[], None] = lambda: None
        #: Partitions already reported to hold foreign ``outbox-id`` headers.
        self._foreign_seen: set[tuple[str, int]] = set()
        self._clock = clock
        #: How long one open transaction may hold a partition's reads back before
        #: the messages it keeps undecided say so (``held_back_note``).
        self.held_back_note_after = held_back_note_after
        #: Partitions whose reads a transaction holds back: its last stable
        #: offset, and when this reconciler first saw it hold them there.
        self._held_back: dict[tuple[str, int], tuple[int, float]] = {}
        #: Each undecided message's range as read so far, by (id, fence): a
        #: later attempt of the message (a higher fence) has a range of its own.
        self._ranges: dict[tuple[uuid.UUID, int], _Range] = {}
        #: Where the next pass's page begins: after this ``seq`` (0: the start).
        self._after = 0
        #: The due messages and sessions seen since the first page was last read.
        self._seen = _Seen()
        #: Whether the last pass read the first page (the first pass, or one that
        #: started over after the last page).
        self.read_first_page = False
        #: When the current pass read its messages (``UncertainMessage.sent_ago``).
        self._pass_began = clock()

    @property
    def pages_left(self) -> bool:
        """Whether the last pass's page was full: the next pass goes on after it."""
        return self._after != 0

    def _forget_all_but(self, seen: _Seen) -> None:
        self._ranges = {k: r for k, r in self._ranges.items() if k in seen.messages}
        self._fenced &= seen.sessions

    def _forget_partitions_but(self, seen: _Seen) -> None:
        """What is kept per partition, for those a cycle read only (at the next one's start)."""
        self._held_back = {k: v for k, v in self._held_back.items() if k in seen.partitions}

    def run_cycle(self) -> Iterator[ReconcileReport]:
        """Passes, one per page, until every page was read once (``outbox-publisher
        reconcile``). A full last page is followed by a pass that starts over at the
        first page: that one ends the cycle too, and what still waits there waits
        for the next cycle."""
        passes = 0
        while True:
            report = self.run_once()
            passes += 1
            yield report
            if not self.pages_left or (passes > 1 and self.read_first_page):
                return

    def run_once(self) -> ReconcileReport:
        """Decide the next page of due uncertain messages (up to ``limit``) and record the
        decisions.

        Pages follow each other in key order from pass to pass, and the pass
        after the last page starts over: a page whose messages all wait (a
        session that cannot be fenced yet, a range read over many passes)
        does not keep the messages after it waiting.
        """
        report = ReconcileReport()
        self._pass_began = self._clock()
        after = self._after
        due = self.store.uncertain_due(self.limit, self.absence_grace, after=after)
        if not due and after:
            after = 0  # the last page was full, and nothing came after it: start over
            due = self.store.uncertain_due(self.limit, self.absence_grace)
        self._after = due[-1].seq if len(due) >= self.limit else 0
        self.read_first_page = after == 0
        if after == 0:
            # A cycle over the pages begins: what the last one did not see is no
            # longer due (decided elsewhere, escalated): its range and its
            # session's fence are forgotten, so neither grows for ever.
            self._forget_all_but(self._seen)
            self._forget_partitions_but(self._seen)
            self._seen = _Seen()
        self._seen.add(due)
        if after == 0 and len(due) < self.limit:
            # Every due message is in this page: the cycle is this page.
            self._forget_all_but(self._seen)
        due = self._fence(due, report)
        if not due:
            return report
        decisions: list[Decision] = []
        by_topic: dict[str, list[UncertainMessage]] = defaultdict(list)
        for message in due:
            by_topic[message.topic].append(message)
        unread = _Unread(len(due))
        for topic, messages in by_topic.items():
            with unread.group(f"topic {topic!r}", messages, report):
                decisions.extend(self._decide_topic(topic, messages, report, unread))
        unread.raise_if_all_failed()
        for d in decisions:
            self._ranges.pop((d.message_id, d.fence), None)
        changed = self.store.decide(decisions, self.decided_by)
        for d in decisions:
            mlog = MessageLog(log, d.message_id, fence=d.fence)
            if d.message_id not in changed:
                mlog.warning(
                    "not decided: it changed, or an operator's decision on it was not "
                    "committed yet, when this one was stored; a later pass decides it if it "
                    "is still uncertain"
                )
                continue
            bucket = {
                State.DELIVERED: report.delivered,
                State.PENDING: report.pending,
                State.UNCERTAIN: report.escalated,
            }[d.to_state]
            bucket.append(d.message_id)
            mlog.log(
                logging.ERROR if d.to_state is State.UNCERTAIN else logging.INFO,
                "reconciled -> %s: %s",
                "escalated" if d.to_state is State.UNCERTAIN else d.to_state.value,
                d.reason,
            )
        return report

    def _decide_topic(
        self,
        topic: str,
        messages: Sequence[UncertainMessage],
        report: ReconcileReport,
        unread: _Unread,
    ) -> list[Decision]:
        count = self.scanner.partition_count(topic)
        decisions: list[Decision] = []
        if count is None:
            # Missing from the metadata: deleted, or not to be seen by the scanner
            # (its ACLs), or not yet there on the broker asked. Like any evidence
            # gone, this is an operator's only after the grace.
            for m in messages:
                if m.absence_due:
                    reason = (
                        f"topic {topic!r} no longer exists, or the scanner may not see it "
                        "(check the topic, and the publisher's DESCRIBE and READ rights on it)"
                    )
                    decisions.append(self._escalate(m, reason, topic=topic))
                else:
                    report.deferred.append(m.id)
            return decisions
        by_partition: dict[int, list[UncertainMessage]] = defaultdict(list)
        for m in messages:
            partition = m.partition
            if partition is None:
                # Chosen before sending from the key (or id) and the partition
                # count of that moment; a legacy row without it uses today's.
                counts = m.partition_counts or {}
                partition = partition_for(m.key, m.id, int(counts.get(topic, count)))
            if partition >= count and not m.absence_due:
                report.deferred.append(m.id)
            elif partition >= count:
                decisions.append(
                    self._escalate(
                        m, f"partition {partition} of {topic!r} no longer exists", topic=topic
                    )
                )
            else:
                by_partition[partition].append(m)
        described: list[Cleanup | None] = []  # asked once per topic, only when a record is missing

        def cleanup() -> Cleanup | None:
            if not described:
                described.append(self.scanner.cleanup(topic))
            return described[0]

        for partition, group in by_partition.items():
            with unread.group(f"{topic}[{partition}]", group, report):
                decisions.extend(self._decide_partition(topic, partition, group, report, cleanup))
            self.progress()
        return decisions

    def _fence(
        self, due: Sequence[UncertainMessage], report: ReconcileReport
    ) -> list[UncertainMessage]:
        """Fence the sessions the due messages were sent under; defer those it could not.

        The messages of a session whose fence the broker refused or failed say
        why in their ``last_error`` (``fence_refused_note``), so that an
        operator sees what keeps them uncertain without the publisher's logs;
        once fenced, they say their last attempt's error again. Kafka out of
        reach is no news about a session (the status view and the publisher's
        health say it): no note, and when no due message is left, the pass
        fails with that error, as a pass whose every read failed does.
        """
        unfenced: set[str] = set()
        notes: dict[str, str | None] = {}  # by session: its note, or None to clear one
        unreachable: BaseException | None = None
        sessions = sorted({m.transactional_id for m in due if m.transactional_id})
        for index, transactional_id in enumerate(sessions):
            if transactional_id in self._fenced:
                continue
            if self.fencer is None:
                log.warning("cannot fence %s (no fencer): its messages wait", transactional_id)
                unfenced.add(transactional_id)
                continue
            try:
                self.fencer.fence(transactional_id)
            except Exception as exc:  # noqa: BLE001 - retried next pass; nothing is decided
                log.warning("could not fence %s, its messages wait: %s", transactional_id, exc)
                unfenced.add(transactional_id)
                if is_unreachable(exc):
                    # No broker answered: each other session would wait out the
                    # same timeouts, holding the loop. They wait for a later pass.
                    unreachable = exc
                    unfenced.update(s for s in sessions[index + 1 :] if s not in self._fenced)
                    break
                notes[transactional_id] = fence_refused_note(transactional_id, exc)
            else:
                log.info("fenced producer session %s before deciding its batch", transactional_id)
                self._fenced.add(transactional_id)
                notes[transactional_id] = None
            finally:
                self.progress()  # a fence may take seconds: a long pass is not a stuck loop
        for session, note in notes.items():
            of_session = [m for m in due if m.transactional_id == session]
            self.store.note_waiting(of_session, note)
            if note is not None:
                report.waiting[note] = len(of_session)
        report.deferred.extend(m.id for m in due if m.transactional_id in unfenced)
        left = [m for m in due if m.transactional_id not in unfenced]
        if not left and isinstance(unreachable, KafkaError):
            raise unreachable
        return left

    def _range_of(self, message: UncertainMessage, topic: str, partition: int, end: int) -> _Range:
        """The message's range as read so far, its bound taken now if it is due.

        The bound. A record of the message can only have been written by the
        producer session its attempt sent it with, and that session can write
        nothing more: in idempotent delivery, once its write deadline has
        passed (the publisher drops what it still holds at the deadline, at the
        last step before the socket) and the absence grace after it (a record
        the leader wrote before the deadline but had not replicated yet sits
        above the end offset, the high watermark, until the followers copy it
        or drop out of the in-sync replicas); in transactional delivery, once
        its session was fenced (this pass or an earlier one of this
        reconciler), which aborted or completed its transaction. Whatever it
        wrote is then below the end offset observed from that moment on, and
        stays below it: the first such end is the bound, and offsets past it,
        however many other producers append there, hold only others' records.
        The end is read from the broker after the deadline and the grace, or
        the fence, have passed; never derived from record timestamps
        (``offsets_for_times``), which other producers set as they like and
        which could put the bound below the record, proving a present record
        absent.
        """
        key = (message.id, message.fence)
        found = self._ranges.get(key)
        if found is None:
            start = _scan_start(message, topic, partition)
            found = self._ranges[key] = _Range(start, start)
        if message.absence_due and found.bound is None and found.start <= end:
            found.bound = end
        return found

    @staticmethod
    def _truncated(
        message: UncertainMessage, r: _Range, topic: str, partition: int, offsets: tuple[int, int]
    ) -> Decision | None:
        """Escalation if the partition now ends below offsets its range knew, else ``None``.

        Below the offset confirmed before its attempt, below its bound, or
        below offsets already read: the log those were in is not this one
        (truncated, or the topic was deleted and created again), and the range
        to read means nothing.
        """
        log_start, end = offsets
        if r.start > end:
            return Reconciler._escalate(
                message,
                f"{topic}[{partition}] ends at offset {end}, below offset "
                f"{r.start - 1} confirmed before its attempt: the log was truncated, "
                "or the topic deleted and created again",
                topic=topic,
                partition=partition,
                evidence={
                    "topic": topic,
                    "partition": partition,
                    "confirmed_before": r.start - 1,
                    "log_start": log_start,
                    "log_end": end,
                },
            )
        reached = max(r.position, r.bound or 0)
        if reached > end:
            return Reconciler._escalate(
                message,
                f"{topic}[{partition}] ends at offset {end}, below offset {reached} it "
                "reached when its range was read earlier: the log was truncated, or the "
                "topic deleted and created again",
                topic=topic,
                partition=partition,
                evidence={
                    "topic": topic,
                    "partition": partition,
                    "reached": reached,
                    "log_start": log_start,
                    "log_end": end,
                },
            )
        return None

    def _decide_partition(  # noqa: PLR0912, PLR0915 - one decision table, read top to bottom
        self,
        topic: str,
        partition: int,
        messages: Sequence[UncertainMessage],
        report: ReconcileReport,
        cleanup: Callable[[], Cleanup | None],
    ) -> list[Decision]:
        log_start, end = self.scanner.offset_range(topic, partition)
        decisions: list[Decision] = []
        ranges: dict[uuid.UUID, _Range] = {}
        for m in messages:
            r = self._range_of(m, topic, partition, end)
            truncated = self._truncated(m, r, topic, partition, (log_start, end))
            if truncated is None:
                ranges[m.id] = r
            elif not m.absence_due:
                report.deferred.append(m.id)  # its record may yet appear: wait out the grace
            else:
                decisions.append(truncated)
        messages = [m for m in messages if m.id in ranges]

        def target(m: UncertainMessage) -> int:
            # Before its bound is known (within the grace), the end of the moment.
            fixed = ranges[m.id].target
            return end if fixed is None else fixed

        if not messages:
            return decisions
        for m in messages:
            r = ranges[m.id]
            if r.position < log_start and r.position < target(m):
                # Deleted before this reconciler read them: a record missing
                # from the rest of the range is not proven absent.
                r.deleted = r.deleted or (r.position, log_start)
                r.position = log_start
        # One read of the partition for every message whose range is not read
        # to its end yet, from where the least read one stopped.
        unread = [m for m in messages if ranges[m.id].position < target(m)]
        lost: EvidenceLost | None = None
        #: Where an open transaction stops this pass's read, if it does; and whether
        #: one has held the partition's reads there long enough to say so.
        blocked_at: int | None = None
        held_long = False
        self._seen.partitions.add((topic, partition))
        # Only a partition read this pass has its held-back notes looked at.
        read_now = bool(unread)
        if unread:
            scan_from = min(ranges[m.id].position for m in unread)
            wanted = max(target(m) for m in unread)
            stable = self._last_stable(topic, partition, wanted)
            scan_to = min(stable, wanted)
            # Below the end read at the start of the pass, the last stable offset is
            # the first record of a transaction still open.
            held_since = self._held_back_at(topic, partition, stable if stable < end else None)
            if scan_to < wanted:
                blocked_at = scan_to
                held_long = held_since == scan_to
            if scan_to <= scan_from:
                unread = []  # nothing more is stable yet: a later pass reads on
        if unread:
            read_to = scan_to
            try:
                scan = self.scanner.find(
                    topic,
                    partition,
                    scan_from,
                    scan_to,
                    [str(m.id) for m in unread],
                    keys={m.key for m in unread if m.key is not None},
                    progress=self.progress,
                )
            except ScanIncomplete as exc:
                # What it read counts: the next pass goes on from there, so a
                # range longer than one pass can read is read over several.
                log.warning("reconciliation goes on next pass: %s", exc)
                scan, read_to = exc.scan, exc.position
            except EvidenceLost as exc:
                # Retention deleted part of the range while it was read: what
                # was read up to the cut counts (a range that ends there was
                # read whole and is decided as usual); past it, a record not
                # found proves nothing.
                scan, lost, read_to = exc.scan, exc, exc.position
            self._warn_foreign(topic, partition, scan)
            for m in unread:
                ranges[m.id].take(scan, read_to, message_id=str(m.id), key=m.key)
        grown: list[int] = []  # the end observed after this pass's read, once asked
        held: list[UncertainMessage] = []  # undecided, held back long by a transaction
        short: list[UncertainMessage] = []  # undecided, held back, not long yet
        read_on: list[UncertainMessage] = []  # undecided, their reads not held back

        def end_after_read() -> int:
            if not grown:
                grown.append(self.scanner.offset_range(topic, partition)[1])
            return grown[0]

        for m in messages:
            r = ranges[m.id]
            to = target(m)
            evidence: dict[str, object] = {
                "topic": topic,
                "partition": partition,
                "scan_from": max(r.start, log_start),
                "scan_to": to,
                "log_start": log_start,
                "passes": r.passes,
            }
            if r.found:
                reason = f"found in {topic}[{partition}] at offset {r.found[0]}"
                if len(r.found) > 1:
                    reason += f" (and again at {', '.join(map(str, r.found[1:]))})"
                decisions.append(
                    Decision(
                        m.id,
                        m.fence,
                        State.DELIVERED,
                        reason,
                        partition,
                        r.found[0],
                        {**evidence, "found_offsets": list(r.found)},
                    )
                )
                continue
            where = f"{topic}[{partition}] offsets [{r.start}, {to})"
            if lost is not None and m in unread and r.position < to:
                if m.absence_due and r.position < lost.log_start:
                    decisions.append(
                        self._escalate(
                            m,
                            f"not found in {where}, and {lost}",
                            topic=topic,
                            partition=partition,
                            evidence=evidence,
                        )
                    )
                else:
                    # Its range is still there from where it stopped: read again next pass.
                    report.deferred.append(m.id)
                continue
            if r.position < to or not m.absence_due:
                # Not read to its end yet (the next pass goes on), or within
                # the grace, when its record may still become visible.
                report.deferred.append(m.id)
                if blocked_at is None or not blocked_at <= r.position < to:
                    read_on.append(m)
                else:
                    (held if held_long else short).append(m)
                continue
            if (
                r.sweep_to is None
                and m.key is not None
                and not r.key_records
                and end_after_read() > r.position
                and self._may_compact(cleanup())
            ):
                # A record of its key written past what was read could have
                # compacted its record away before the read reached it. Any
                # such record was in the log before that read, so below the
                # end observed after it: the range of its key runs to there.
                r.sweep_to = end_after_read()
                report.deferred.append(m.id)
                read_on.append(m)
                continue
            gone = self._evidence_gone(where, r.deleted) or self._compacted_away(
                m, where, r.key_records, cleanup
            )
            overtaken = None if gone is not None else self._overtaken(m, r.key_ids)
            if gone is not None:
                decisions.append(
                    self._escalate(m, gone, topic=topic, partition=partition, evidence=evidence)
                )
            elif overtaken is not None:
                # Nothing is gone: its record was never written. Only a person may
                # put it after them (or drop it).
                reason, later = overtaken
                decisions.append(
                    Decision(
                        m.id,
                        m.fence,
                        State.UNCERTAIN,
                        f"{reason} (in {where})",
                        partition,
                        None,
                        # The first few, and how many: a hot key can have thousands.
                        {**evidence, "later_of_key": later[:10], "later_of_key_count": len(later)},
                    )
                )
            else:
                decisions.append(
                    Decision(
                        m.id,
                        m.fence,
                        State.PENDING,
                        f"proven absent: no record with its id in {where}",
                        partition,
                        None,
                        {**evidence, **self._compaction_evidence(m, cleanup())},
                    )
                )
        if read_now:
            self._note_held_back(
                held_back_note(topic, partition, blocked_at) if blocked_at is not None else None,
                held=held, short=short, read_on=read_on, report=report,
            )  # fmt: skip
        return decisions

    def _held_back_at(self, topic: str, partition: int, stable: int | None) -> int | None:
        """The offset an open transaction has held ``partition``'s last stable offset at
        for ``held_back_note_after`` seconds or more, as seen by this reconciler; else None.

        ``stable`` is that offset now, None if no transaction is open. A
        transaction that ends lets the last stable offset move on: another
        offset is another transaction, timed from now.
        """
        where = (topic, partition)
        if stable is None:
            self._held_back.pop(where, None)
            return None
        since = self._held_back.get(where)
        if since is None or since[0] != stable:
            since = self._held_back[where] = (stable, self._clock())
        return stable if self._clock() - since[1] >= self.held_back_note_after else None

    def _note_held_back(
        self,
        note: str | None,
        *,
        held: Sequence[UncertainMessage],
        short: Sequence[UncertainMessage],
        read_on: Sequence[UncertainMessage],
        report: ReconcileReport,
    ) -> None:
        """Say on the messages a transaction has held back long why they wait (``note``,
        naming where it holds the reads); take a held-back note off those whose reads
        went on, and off those held back for less long unless it says the same (another
        reconciler, a publisher that ran longer, timed it). Notes any reconciler wrote
        before go too: what is read each pass is asked each pass, and a row whose note
        is right is not written."""
        if note is not None and held:
            self.store.note_waiting(held, note)
            report.waiting[note] = report.waiting.get(note, 0) + len(held)
        if read_on:
            self.store.note_waiting(read_on, None)
        if short:
            self.store.note_waiting(short, None, keep=note)

    def _last_stable(self, topic: str, partition: int, to: int) -> int:
        """The partition's last stable offset: ``[.., to)`` can be read now up to it.

        Scans read read_committed, so that a record of an aborted transaction
        (an earlier attempt sent in a transaction before the delivery mode
        changed, or another producer's) never counts as delivered. Below the
        last stable offset every transaction has ended, committed or aborted;
        a transaction still open (another publisher's, or another producer's
        on a shared topic) holds it down until it ends. What lies below is read
        now, and the rest of the range by a later pass.
        """
        _, stable = self.scanner.offset_range(topic, partition, committed=True)
        if stable < to:
            log.info(
                "%s[%d]: a transaction is open below offset %d (stable up to %d); "
                "the rest of the range is read later",
                topic,
                partition,
                to,
                stable,
            )
        return stable

    def _warn_foreign(self, topic: str, partition: int, scan: Scan) -> None:
        """Report another producer's ``outbox-id`` headers, once per partition."""
        if scan.foreign_ids and (topic, partition) not in self._foreign_seen:
            # Once per partition: another producer's records recur at every pass.
            self._foreign_seen.add((topic, partition))
            log.warning(
                "%s[%d]: skipped %d record(s) whose outbox-id header holds no message id: "
                "another producer writes that header to this topic",
                topic,
                partition,
                scan.foreign_ids,
            )

    @staticmethod
    def _evidence_gone(where: str, deleted: tuple[int, int] | None) -> str | None:
        """Why offsets where its record could be are gone, if they are."""
        if deleted is None:
            return None
        first, start = deleted
        return (
            f"not found in {where} from offset {start}, and offsets [{first}, {start}) where "
            "it could be were deleted (retention or compaction)"
        )

    @staticmethod
    def _may_compact(cleanup: Cleanup | None) -> bool:
        """Whether a topic so described may be compacted (not described: it may)."""
        return cleanup is None or cleanup.compacts

    def _compacted_away(
        self,
        message: UncertainMessage,
        where: str,
        key_records: int,
        cleanup: Callable[[], Cleanup | None],
    ) -> str | None:
        """Why compaction may have removed its record, if it may have.

        Compaction removes a record once a later record has the same key, and
        a record with no key at all. With later records of its key in the
        range read, one of them may have removed it. With none there, only a
        later record of its key removed since could have: a tombstone (a key
        and no value), which compaction removes too, ``delete.retention.ms``
        after it first cleans the segment that holds it. That is after the
        tombstone was written, so after the attempt began sending: until that
        long has passed since then (``TOMBSTONE_MARGIN`` less), any such
        tombstone is still in the log, and absence is proof.
        """
        described = cleanup()
        if not self._may_compact(described):
            return None
        why = (
            "the topic's cleanup.policy could not be read, so it may be compacted"
            if described is None
            else "the topic is compacted"
        )
        if message.key is None:
            return (
                f"not found in {where}, but {why}: compaction removes records without a key "
                "(a broker refuses them on a compacted topic, so one was written before the "
                "topic was), and its record may have been written and compacted away"
            )
        if key_records:
            return (
                f"not found in {where}, but {why} and later records of its key are there: its "
                "record may have been written and compacted away"
            )
        kept = described.tombstones_kept if described is not None else None
        age = self._sent_ago(message)
        if kept is not None and age is not None and age + TOMBSTONE_MARGIN < kept:
            return None
        if kept is None:
            since = "its delete.retention.ms could not be read"
        elif age is None:
            since = "when its attempt began sending is not recorded"
        else:
            since = (
                f"its attempt began sending {age:.0f}s ago, and tombstones are kept "
                f"{kept:.0f}s (delete.retention.ms)"
            )
        return (
            f"not found in {where} and no record of its key there, but {why} and {since}: "
            "a later record of its key, a tombstone since removed, may have compacted its "
            "record away"
        )

    def _sent_ago(self, message: UncertainMessage) -> float | None:
        """Seconds since its attempt began sending, now (None: not recorded)."""
        if message.sent_ago is None:
            return None
        return message.sent_ago + (self._clock() - self._pass_began)

    def _compaction_evidence(
        self, message: UncertainMessage, described: Cleanup | None
    ) -> dict[str, object]:
        """What a proof of absence took from the topic's cleanup settings: its policy,
        and on a compacted topic how long tombstones are kept and the attempt's age."""
        if described is None:
            return {}
        evidence: dict[str, object] = {"cleanup_policy": sorted(described.policy)}
        if described.compacts:
            age = self._sent_ago(message)
            evidence["tombstones_kept_seconds"] = described.tombstones_kept
            evidence["sent_seconds_ago"] = None if age is None else round(age, 3)
        return evidence

    def _overtaken(
        self, message: UncertainMessage, key_ids: set[str]
    ) -> tuple[str, list[str]] | None:
        """Why sending an absent message now would break its key's order, if it would, and
        the later messages of its key in Kafka.

        A later message of its key written to the partition since (sent in the
        same batch and confirmed, while this one's record was lost) has
        already taken its place: sending it now puts it after that one.
        """
        if message.key is None:
            return None
        # Message ids only (the scan skips other values); ids of no message
        # of this outbox are not later ones of its key.
        ids = [uuid.UUID(text) for text in key_ids - {str(message.id)}]
        later = self.store.later_of_key(message.id, ids)
        if not later:
            return None
        return (
            f"{OVERTAKEN_NOTE}{len(later)} (first: {min(later)}), written after it was sent: "
            "sending it now would put it after them; decide with outbox resolve --pending "
            "--out-of-order (sent after them) or --discard (never sent), not --delivered",
            sorted(str(i) for i in later),
        )

    @staticmethod
    def _escalate(
        message: UncertainMessage,
        reason: str,
        *,
        topic: str,
        partition: int | None = None,
        evidence: dict[str, object] | None = None,
    ) -> Decision:
        return Decision(
            message.id,
            message.fence,
            State.UNCERTAIN,
            f"evidence unavailable: {reason}; decide with outbox resolve",
            partition,
            None,
            evidence or {"topic": topic, "partition": partition},
        )
