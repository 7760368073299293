"""Deciding uncertain messages from what Kafka holds.

A message is uncertain when its record may or may not have been written. Once
the producer that sent it can no longer write (its lease is gone and the
delivery timeout has passed since sending began), the reconciler reads the
message's partition from the highest offset confirmed before its attempt to
the partition's end, looking for the message id in the ``outbox-id`` header:

* found: ``delivered`` at the offset found;
* not found, once a grace period after the write deadline has passed too
  (``absence_grace``, the broker's ``replica.lag.time.max.ms``: a record the
  leader wrote but its followers had not copied yet sits above the high
  watermark, invisible to the scan, until they copy it or drop out):
  ``pending``, with the scanned range recorded as the proof, so it is sent
  again; before that, it is left for a later pass;
* the evidence is gone or cannot be trusted: it stays ``uncertain``, is
  marked escalated with the reason, and an operator decides. That is when
  the topic or partition no longer exists; when offsets to read were deleted
  by retention, before or during the scan; when the partition now ends below
  the offset confirmed before the attempt (the log was truncated, or the
  topic deleted and created again); and when the record is missing from a
  compacted topic, which removes records from the middle of its log.

A message sent in a Kafka transaction (``--delivery transactional``) is
decided without waiting for a write deadline or a grace: first the
transactional.id its batch was sent under is fenced (``publisher.fencing``),
so that session's open transaction is aborted or its commit completed and it
can write nothing more; then the partition is read read_committed, once no
transaction is open below the end offset seen after the fence. Found:
``delivered``; absent: never committed, ``pending``. A session that cannot be
fenced now (the broker is away) leaves its messages uncertain for a later pass.

Every decision is written to ``outbox.decisions`` with its evidence.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from outbox.states import State
from publisher.fencing import Fencer
from publisher.logs import MessageLog
from publisher.partitioning import partition_for
from publisher.scanner import EvidenceLost, LogScanner, Scan, ScanIncomplete
from publisher.store import Decision, PublisherStore, UncertainMessage

log = logging.getLogger(__name__)


@dataclass
class ReconcileReport:
    """What one reconciliation pass decided."""

    delivered: list[uuid.UUID] = field(default_factory=list)
    pending: list[uuid.UUID] = field(default_factory=list)
    escalated: list[uuid.UUID] = field(default_factory=list)
    #: Left uncertain for a later pass (a scan that did not finish in time).
    deferred: list[uuid.UUID] = field(default_factory=list)

    @property
    def decided(self) -> int:
        """How many messages left the undecided uncertain state."""
        return len(self.delivered) + len(self.pending) + len(self.escalated)


def _scan_start(message: UncertainMessage, topic: str, partition: int) -> int:
    """First offset the message's record can be at: above what was confirmed before."""
    offsets = (message.confirmed_offsets or {}).get(topic, {})
    confirmed = offsets.get(str(partition))
    return int(confirmed) + 1 if confirmed is not None else 0


#: Kafka's default ``replica.lag.time.max.ms``, in seconds.
DEFAULT_ABSENCE_GRACE = 30.0


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
        #: Called after each partition is decided: a long pass is not a stuck loop.
        self.progress: Callable[[], None] = lambda: None
        #: Partitions already reported to hold foreign ``outbox-id`` headers.
        self._foreign_seen: set[tuple[str, int]] = set()

    def run_once(self) -> ReconcileReport:
        """Decide every due uncertain message (up to ``limit``) and record the decisions."""
        report = ReconcileReport()
        due = self.store.uncertain_due(self.limit, self.absence_grace)
        due = self._fence(due, report)
        if not due:
            return report
        decisions: list[Decision] = []
        by_topic: dict[str, list[UncertainMessage]] = defaultdict(list)
        for message in due:
            by_topic[message.topic].append(message)
        for topic, messages in by_topic.items():
            decisions.extend(self._decide_topic(topic, messages, report))
        changed = self.store.decide(decisions, self.decided_by)
        for d in decisions:
            mlog = MessageLog(log, d.message_id, fence=d.fence)
            if d.message_id not in changed:
                mlog.warning("changed before the decision was stored")
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
        self, topic: str, messages: Sequence[UncertainMessage], report: ReconcileReport
    ) -> list[Decision]:
        count = self.scanner.partition_count(topic)
        if count is None:
            return [
                self._escalate(m, f"topic {topic!r} no longer exists", topic=topic)
                for m in messages
            ]
        decisions: list[Decision] = []
        by_partition: dict[int, list[UncertainMessage]] = defaultdict(list)
        for m in messages:
            partition = m.partition
            if partition is None:
                # Chosen before sending from the key (or id) and the partition
                # count of that moment; a legacy row without it uses today's.
                counts = m.partition_counts or {}
                partition = partition_for(m.key, m.id, int(counts.get(topic, count)))
            if partition >= count:
                decisions.append(
                    self._escalate(
                        m, f"partition {partition} of {topic!r} no longer exists", topic=topic
                    )
                )
            else:
                by_partition[partition].append(m)
        policy: list[set[str] | None] = []  # asked once per topic, only when a record is missing

        def cleanup_policy() -> set[str] | None:
            if not policy:
                policy.append(self.scanner.cleanup_policy(topic))
            return policy[0]

        for partition, group in by_partition.items():
            # Records of fenced sessions are read committed; the others as written.
            for committed in (False, True):
                part = [m for m in group if (m.transactional_id is not None) is committed]
                if part:
                    decisions.extend(
                        self._decide_partition(
                            topic, partition, part, report, cleanup_policy, committed=committed
                        )
                    )
            self.progress()
        return decisions

    def _fence(
        self, due: Sequence[UncertainMessage], report: ReconcileReport
    ) -> list[UncertainMessage]:
        """Fence the sessions the due messages were sent under; defer those it could not."""
        unfenced: set[str] = set()
        for transactional_id in sorted({m.transactional_id for m in due if m.transactional_id}):
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
            else:
                log.info("fenced producer session %s before deciding its batch", transactional_id)
                self._fenced.add(transactional_id)
        report.deferred.extend(m.id for m in due if m.transactional_id in unfenced)
        return [m for m in due if m.transactional_id not in unfenced]

    def _stable_below(self, topic: str, partition: int, end: int) -> bool:
        """Whether no transaction is open below ``end``, so read_committed reads up to it.

        The fenced sessions wrote below ``end`` (read after the fence): their
        records are committed or aborted now. But read_committed reads only
        below the last stable offset, which another publisher's open
        transaction holds down until it ends.
        """
        _, stable = self.scanner.offset_range(topic, partition, committed=True)
        if stable < end:
            log.info(
                "%s[%d]: a transaction is open below offset %d (stable up to %d); deciding later",
                topic,
                partition,
                end,
                stable,
            )
        return stable >= end

    def _decide_partition(  # noqa: PLR0912 - one decision table, read top to bottom
        self,
        topic: str,
        partition: int,
        messages: Sequence[UncertainMessage],
        report: ReconcileReport,
        cleanup_policy: Callable[[], set[str] | None],
        *,
        committed: bool = False,
    ) -> list[Decision]:
        log_start, end = self.scanner.offset_range(topic, partition)
        if committed and not self._stable_below(topic, partition, end):
            report.deferred.extend(m.id for m in messages)
            return []
        starts = {m.id: _scan_start(m, topic, partition) for m in messages}
        decisions: list[Decision] = []
        # The partition ends below an offset confirmed before the attempt: the
        # log it was confirmed in is not this one (truncated, or the topic was
        # deleted and created again), and the range to read means nothing.
        for m in [m for m in messages if starts[m.id] > end]:
            if not m.absence_due:
                report.deferred.append(m.id)  # its record may yet appear: wait out the grace
                continue
            decisions.append(
                self._escalate(
                    m,
                    f"{topic}[{partition}] ends at offset {end}, below offset "
                    f"{starts[m.id] - 1} confirmed before its attempt: the log was truncated, "
                    "or the topic deleted and created again",
                    topic=topic,
                    partition=partition,
                    evidence={
                        "topic": topic,
                        "partition": partition,
                        "confirmed_before": starts[m.id] - 1,
                        "log_start": log_start,
                        "log_end": end,
                    },
                )
            )
        messages = [m for m in messages if starts[m.id] <= end]
        if not messages:
            return decisions
        scan_from = max(min(starts[m.id] for m in messages), log_start)
        lost: EvidenceLost | None = None
        try:
            scan = self.scanner.find(
                topic,
                partition,
                scan_from,
                end,
                [str(m.id) for m in messages],
                keys={m.key for m in messages if m.key is not None},
                committed=committed,
            )
        except ScanIncomplete as exc:
            log.warning("reconciliation deferred: %s", exc)
            report.deferred.extend(m.id for m in messages)
            return decisions
        except EvidenceLost as exc:
            # Retention deleted part of the range while it was read: what the
            # scan found still counts; a record it did not find proves nothing.
            scan, lost = exc.scan, exc
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
        for m in messages:
            evidence: dict[str, object] = {
                "topic": topic,
                "partition": partition,
                "scan_from": max(starts[m.id], log_start),
                "scan_to": end,
                "log_start": log_start,
            }
            # Only offsets above what was confirmed before this message's
            # attempt can hold its record; the shared scan may start lower
            # for another message of the same partition.
            offsets = [o for o in scan.found.get(str(m.id), []) if o >= starts[m.id]]
            if offsets:
                reason = f"found in {topic}[{partition}] at offset {offsets[0]}"
                if len(offsets) > 1:
                    reason += f" (and again at {', '.join(map(str, offsets[1:]))})"
                decisions.append(
                    Decision(
                        m.id,
                        m.fence,
                        State.DELIVERED,
                        reason,
                        partition,
                        offsets[0],
                        {**evidence, "found_offsets": offsets},
                    )
                )
                continue
            if not m.absence_due or (lost is not None and starts[m.id] >= lost.log_start):
                # Not found yet: within the grace its record may still become
                # visible; and a range retention cut into while it was read,
                # but which is still there from this message's start, is read
                # again next pass.
                report.deferred.append(m.id)
                continue
            where = f"{topic}[{partition}] offsets [{starts[m.id]}, {end})"
            gone = (
                self._evidence_gone(where, (starts[m.id], log_start, end), lost)
                or self._compacted_away(m, where, scan, cleanup_policy)
                or self._overtaken(m, scan)
            )
            if gone is not None:
                decisions.append(
                    self._escalate(m, gone, topic=topic, partition=partition, evidence=evidence)
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
                        evidence,
                    )
                )
        return decisions

    @staticmethod
    def _evidence_gone(
        where: str, offsets: tuple[int, int, int], lost: EvidenceLost | None
    ) -> str | None:
        """Why offsets where its record could be are gone, if they are.

        ``offsets`` are where its record could start, the log start and the end.
        """
        start, log_start, end = offsets
        if lost is not None:
            return f"not found in {where}, and {lost}"
        if start < log_start:
            return (
                f"not found in offsets [{log_start}, {end}), and offsets [{start}, {log_start}) "
                "where it could be were deleted (retention or compaction)"
            )
        return None

    @staticmethod
    def _compacted_away(
        message: UncertainMessage,
        where: str,
        scan: Scan,
        cleanup_policy: Callable[[], set[str] | None],
    ) -> str | None:
        """Why compaction may have removed its record, if it may have.

        Compaction removes a record only once a later record has the same key:
        with none of its key in the range read, its record cannot have been
        compacted away, and its absence is proof.
        """
        if message.key is not None and not scan.key_records.get(message.key):
            return None
        policy = cleanup_policy()
        if policy is None:
            why = "the topic's cleanup.policy could not be read, so it may be compacted"
        elif "compact" in policy:
            why = "the topic is compacted"
        else:
            return None
        return (
            f"not found in {where}, but {why} and later records of its key are there: its "
            "record may have been written and compacted away"
        )

    def _overtaken(self, message: UncertainMessage, scan: Scan) -> str | None:
        """Why sending an absent message now would break its key's order, if it would.

        A later message of its key written to the partition since (sent in the
        same batch and confirmed, while this one's record was lost) has
        already taken its place: sending it now puts it after that one.
        """
        if message.key is None:
            return None
        # Message ids only (the scan skips other values); ids of no message
        # of this outbox are not later ones of its key.
        ids = [uuid.UUID(text) for text in scan.by_key.get(message.key, set()) - {str(message.id)}]
        later = self.store.later_of_key(message.id, ids)
        if not later:
            return None
        return (
            f"proven absent, but {len(later)} later message(s) of its key are already in "
            f"Kafka after it was sent (first: {min(later)}): sending it now would break its "
            "key's order"
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
