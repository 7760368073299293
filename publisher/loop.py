"""The publisher loop: claim a batch, send it, record what the broker said.

One iteration (``run_once``) is the whole state machine of a batch:

1. claim: one statement writes a batch row naming the next claimable
   messages, under a lease; while it is open they are in flight;
2. choose each record's partition and record, before anything is sent, that
   the batch begins sending (``mark_sending``); only a batch still held is
   sent (in transactional delivery, inside a Kafka transaction, which full
   batches claimed next may join under backlog);
3. send the batch and flush once (and commit, or abort, the transaction);
4. classify each record's outcome and settle the batch in one statement that
   closes it and writes each message row once: delivered, pending again (not
   written, with backoff), uncertain, or quarantined. Nothing changes if
   recovery closed the batch first.

``run`` repeats it; between batches it recovers expired leases and
reconciles uncertain messages at their intervals, and sleeps on NOTIFY or
the poll interval when there is nothing to do, until ``request_stop``.

As it goes, the loop counts what it does in ``metrics`` and tells ``health``
whether PostgreSQL and Kafka answered and that it is still moving.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

import psycopg
from kafka import errors as kafka_errors

from outbox.intent import ID_HEADER
from outbox.states import State
from publisher.config import PublisherConfig
from publisher.faults import Faults
from publisher.health import Health, KafkaProbe
from publisher.heartbeat import Heartbeat
from publisher.holds import HoldRunner
from publisher.lanes import LaneKeeper
from publisher.logs import MessageLog, Outage
from publisher.metrics import PublisherMetrics, StatusRead, StatusReader
from publisher.outcomes import (
    ATTEMPT_OUTCOME,
    FENCING_ERRORS,
    NEXT_STATE,
    AttemptOutcome,
    SendOutcome,
    TransactionEnd,
    after_transaction,
    answered_for_topic,
    classify,
    counts_as_failure,
    error_text,
    is_unreachable,
    may_land_after_abort,
    refuses_publisher,
    retry_delay,
)
from publisher.partitioning import partition_for
from publisher.reconciler import Reconciler, ReconcileReport
from publisher.retention import RetentionRunner
from publisher.sink import (
    HandOverClosed,
    NotHandedOver,
    OutgoingRecord,
    ProducerUnavailable,
    SendReport,
    SendWindow,
    Sink,
    TransactionFailed,
)
from publisher.store import Batch, ClaimedMessage, PublisherStore, Settlement
from publisher.tracing import BatchSpans, batch_spans
from publisher.waker import Waker

log = logging.getLogger(__name__)

#: What to check when the database has been away a while (``Outage``): it may
#: not end by itself.
DATABASE_HINT = (
    "Check that PostgreSQL runs and this host reaches it, and that the database URL's "
    "host, port, database name, user and password (or password file) are right"
)


@dataclass
class Totals:
    """Counts of what this publisher did, by outcome."""

    batches: int = 0
    delivered: int = 0
    retried: int = 0
    uncertain: int = 0
    quarantined: int = 0
    released: int = 0
    stale: int = 0
    recovered: int = 0
    reconciled: int = 0


class Publisher:
    """Delivers committed intents to Kafka until asked to stop."""

    def __init__(
        self,
        config: PublisherConfig,
        store: PublisherStore,
        sink: Sink,
        waker: Waker | None = None,
        *,
        reconciler: Reconciler | None = None,
        heartbeat_store: PublisherStore | None = None,
        faults: Faults | None = None,
        version: str = "dev",
        pid: int = 0,
        clock: Callable[[], float] = time.monotonic,
        status_reader: StatusRead | None = None,
        kafka_check: Callable[[], None] | None = None,
        kafka_probe_interval: float = 10.0,
        retention: RetentionRunner | None = None,
        holds: HoldRunner | None = None,
        claim_ahead_store: PublisherStore | None = None,
        spans: BatchSpans | None = None,
    ) -> None:
        self.config = config
        self.store = store
        #: Each batch in a Kafka transaction (``--delivery transactional``).
        self._transactional = config.delivery == "transactional"
        #: Runs retention (``outbox purge``) in the background, when configured.
        self.retention = retention
        #: Marks and releases held messages in the background (``publisher.holds``).
        self.holds = holds
        #: With a store of its own (its own connection), the next batch is
        #: claimed in a worker thread while this one is being sent.
        self._ahead_store = claim_ahead_store
        self._ahead: Future[Batch | None] | None = None
        #: Ids of the batches in hand (being sent, or claimed ahead).
        self._held: set[int] = set()
        self._held_lock = threading.Lock()
        #: Set when the last claim-ahead came back short: the next batch is
        #: claimed in full, after the current one settles.
        self._ahead_paused = False
        self._ahead_worker: ThreadPoolExecutor | None = None
        self.sink = sink
        self.waker = waker or Waker(None)
        self.reconciler = reconciler
        self.faults = faults or Faults()
        #: A span per batch sent, with OpenTelemetry (see ``publisher.tracing``).
        self.spans = spans if spans is not None else batch_spans()
        self.totals = Totals()
        #: Set when ``run`` ended because nothing was left to deliver (``exit_when_idle``).
        self.ended_idle = False
        #: Set once the publisher registered (the database answered) and began to claim.
        self.started = False
        self._version = version
        self._pid = pid
        self._clock = clock
        self._stopping = threading.Event()
        self._progress_at = clock()
        self._next_recovery = 0.0
        self._next_reconcile = 0.0
        #: A Kafka transaction was begun and not ended yet.
        self._transaction_open = False
        #: Failure class of each message of the batch in hand that was not delivered.
        self._failure_class: dict[uuid.UUID, str] = {}
        #: Batches in a row that the broker could not take (an outage) and that
        #: delivered nothing: the loop backs off by this count (``_outage_pause``).
        self._outages = 0
        #: The log lines of the database being away, at start and later.
        self.database_away = Outage(log, "database unavailable", hint=DATABASE_HINT, clock=clock)
        self.database_away_at_start = Outage(
            log, "database unavailable at start", hint=DATABASE_HINT, clock=clock
        )
        #: What ``/healthz`` and ``/readyz`` answer from.
        self.health = Health(
            stall_seconds=config.stall_seconds,
            # A settle may retry through a database outage for a whole lease.
            alive_seconds=config.stall_seconds + config.lease_seconds,
            # Writes to Kafka failing for a lease, as the heartbeat steps back on.
            lease_seconds=config.lease_seconds,
            clock=clock,
        )
        if reconciler is not None:
            # Each partition a pass decides counts as a turn: a long pass over
            # many partitions is not a stuck loop, and the leases it holds
            # meanwhile (a batch claimed ahead) are still renewed.
            reconciler.progress = self._progress
        #: Prometheus metrics of this publisher, on a registry of its own.
        self.metrics = PublisherMetrics(self.health)
        self.metrics.info.labels(str(self.publisher_id), version).set(1)
        self._status_reader = status_reader
        if status_reader is not None:
            self.metrics.watch_status(status_reader)
        self._kafka_probe = (
            KafkaProbe(self.health.kafka, kafka_check, interval=kafka_probe_interval)
            if kafka_check is not None
            else None
        )
        self.heartbeat = (
            Heartbeat(
                heartbeat_store,
                interval=config.heartbeat_interval,
                lease_seconds=config.lease_seconds,
                progressing=self._progressing,
                lanes=LaneKeeper(heartbeat_store, config.lease_seconds),
                database=self.health.database,
                held_batches=self.held_batches,
                loop_alive=lambda: not self.health.loop_stuck(),
                kafka=self.health.kafka,
            )
            if heartbeat_store is not None
            else None
        )

    @property
    def publisher_id(self) -> uuid.UUID:
        """This process's id in ``outbox.publishers``, and the owner of its batches and lanes."""
        return self.store.publisher_id

    def request_stop(self) -> None:
        """Stop claiming; the batch in hand is finished and settled first."""
        self._stopping.set()
        self.health.stopping = True
        self.waker.wake()

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested."""
        return self._stopping.is_set()

    def run(self) -> Totals:
        """Deliver until stopped (or idle, with ``exit_when_idle``); return the totals."""
        if self._kafka_probe is not None:
            self._kafka_probe.start()
        try:
            if not self._start():
                return self.totals
            while not self._stopping.is_set():
                self.health.loop_turned()
                try:
                    self.maintain()
                    if self.run_once():
                        self.waker.awake()  # busy: commits need not notify
                        self._database_answered(self.database_away)
                        self._outage_pause()
                        continue
                    wait = self._idle_wait()
                    self._database_answered(self.database_away)
                    if wait is not None and self.waker.fall_asleep():
                        continue  # announced asleep: claim once more, then wait
                except psycopg.OperationalError as exc:
                    self.database_away.failed(exc)
                    self.health.database.failed(exc)
                    self.store.close()
                    wait = self.config.poll_interval
                if wait is None:
                    log.info("nothing left to deliver; exiting (--exit-when-idle)")
                    self.ended_idle = True
                    break
                self.waker.wait(wait)
        finally:
            self._shut_down()
        t = self.totals
        log.info(
            "publisher %s stopped: %d delivered, %d to retry, %d uncertain, %d quarantined, "
            "%d released, %d stale in %d batches; %d recovered, %d reconciled",
            self.publisher_id,
            t.delivered,
            t.retried,
            t.uncertain,
            t.quarantined,
            t.released,
            t.stale,
            t.batches,
            t.recovered,
            t.reconciled,
        )
        return t

    def _start(self) -> bool:
        """Register and start the background threads; False if stopped before the database
        answered. A database that is away at start is waited for, as at any other time."""
        while True:
            try:
                self.store.register(self._version, self._pid, self.config.lease_seconds)
                break
            except psycopg.OperationalError as exc:
                self.database_away_at_start.failed(exc)
                self.health.database.failed(exc)
                self.store.close()
                if self._stopping.wait(self.config.poll_interval):
                    return False
        self._database_answered(self.database_away_at_start)
        self.health.registered = True
        self.started = True
        self.waker.start()
        self.health.threads.append(self.waker)
        if self.heartbeat is not None:
            try:
                self.heartbeat.beat()  # take a share of the lanes before the first claim
            except psycopg.OperationalError as exc:
                log.warning("first heartbeat failed (%s); the heartbeat retries", exc)
            self.heartbeat.start()
            self.health.threads.append(self.heartbeat)
        if self.retention is not None:
            self.retention.start()
            self.health.threads.append(self.retention)
        if self.holds is not None:
            # The first pass before the first claim, now that the lanes are taken.
            try:
                self.holds.run_once()
            except psycopg.Error as exc:
                log.warning("hold pass failed (%s); the next one comes in its interval", exc)
            self.holds.start()
            self.health.threads.append(self.holds)
        self.health.loop_started()
        log.info(
            "publisher %s started (batch %d, lease %gs, poll %gs)",
            self.publisher_id,
            self.config.batch_size,
            self.config.lease_seconds,
            self.config.poll_interval,
        )
        return True

    def _database_answered(self, outage: Outage) -> None:
        self.health.database.succeeded()
        outage.ended()

    def _shut_down(self) -> None:
        # Never registered (the database refused it: no schema, no publisher role):
        # there are no lanes to give back, no stop to record, and trying would
        # only add two warnings before the one line that names the problem.
        registered = self.health.registered
        self._release_claimed_ahead()
        self.health.loop_ended()
        if self.retention is not None:
            self.retention.stop()
        if self.holds is not None:
            self.holds.stop()
        self.health.registered = False
        self.waker.stop()
        if self._kafka_probe is not None:
            self._kafka_probe.stop()
        if self.heartbeat is not None:
            self.heartbeat.stop(give_lanes_back=registered)
        if isinstance(self._status_reader, StatusReader):
            self._status_reader.close()
        self.sink.close()
        if self.reconciler is not None:
            self.reconciler.scanner.close()
        if registered:
            try:
                self.store.mark_stopped()
            except psycopg.Error as exc:
                log.warning("could not record the stop: %s", exc)
        self.store.close()

    # --- one batch ----------------------------------------------------------

    def run_once(self) -> int:
        """Claim, send and settle one batch (in transactional delivery under backlog, the
        full batches that joined its transaction too); return how many messages it claimed.
        """
        started = self._clock()
        self._failure_class.clear()
        batch = self._take_claim()
        if batch is None:
            return 0
        self.health.writes_wanted = True
        self._hold(batch)
        in_hand = [batch]
        try:
            self._progress()
            self.faults.reached("after_claim")
            if self._stopping.is_set():
                self._settle(batch, [self._release(m) for m in batch.messages])
                return len(batch.messages)
            if any(self._ends_claims(m) for m in batch.messages):
                self._settle(batch, [self._give_up_unsent(m) for m in batch.messages])
                return len(batch.messages)
            try:
                for sent, settlements in self._send(batch, in_hand):
                    self._settle(sent, settlements)
                    self.spans.settled(sent, settlements)
            except BaseException:
                if self._transactional:
                    self._leave_session()
                raise
        finally:
            # Settled, or given up on (an error on the way): either way their
            # leases are no longer renewed; recovery takes what is left.
            for held in in_hand:
                self._let_go(held)
        self.metrics.batch_seconds.observe(max(self._clock() - started, 0.0))
        self.faults.reached("after_confirm")
        return sum(len(b.messages) for b in in_hand)

    def _outage_pause(self) -> None:
        """After a batch the broker could not take, wait before claiming again.

        Its messages are pending again, due at once and with no failure
        counted (``counts_as_failure``): the backoff of an outage is the
        loop's. Exponential with full jitter over the batches in a row that
        met it, capped by ``--retry-cap-seconds``; ended early by a stop.
        The loop keeps turning (for ``/healthz``) while it waits.
        """
        if not self._outages:
            return
        pause = retry_delay(
            self._outages,
            base_seconds=self.config.retry_base_seconds,
            cap_seconds=self.config.retry_cap_seconds,
        )
        log.info(
            "Kafka took nothing (unavailable, or refusing this publisher: the messages' "
            "last_error says which); next claim in %.1fs",
            pause,
        )
        resume_at = self._clock() + pause
        while not self._stopping.is_set() and (left := resume_at - self._clock()) > 0:
            self.health.loop_turned()
            self._stopping.wait(min(left, self.config.poll_interval))

    def held_batches(self) -> list[int]:
        """The batches this loop still works on: the heartbeat renews only their leases."""
        with self._held_lock:
            return list(self._held)

    def _hold(self, batch: Batch | None) -> Batch | None:
        if batch is not None:
            with self._held_lock:
                self._held.add(batch.id)
        return batch

    def _let_go(self, batch: Batch) -> None:
        with self._held_lock:
            self._held.discard(batch.id)
        self.spans.ended(batch)

    def _send(self, batch: Batch, in_hand: list[Batch]) -> list[tuple[Batch, list[Settlement]]]:
        """Send what this publisher still holds of the batch; each batch's settlements.

        In transactional delivery the batch is sent in a Kafka transaction,
        and under backlog the next claimed batches join it (``_joining``),
        each appended to ``in_hand`` as it does; the transaction is committed
        once, if every record of every batch was confirmed. A fenced
        transaction settles nothing.
        """
        try:
            parts = [self._hand_over(batch, begin=self._transactional)]
            while (joining := self._joining(parts)) is not None:
                in_hand.append(joining)
                parts.append(self._hand_over(joining, begin=False))
        except Exception:
            self._abandon_transaction(in_hand)
            raise
        # The broker answered every record; nothing is recorded (or, in a
        # transaction, committed) yet.
        self.faults.reached("after_ack")
        end = None
        if any(p.began for p in parts):
            end = self._end_transaction([p.batch for p in parts], parts)
            if end is TransactionEnd.FENCED:
                return []  # a zombie's word on the batches is not recorded
            self.faults.reached("after_commit")
        return [(p.batch, self._settlements(p, end)) for p in parts]

    def _hand_over(self, batch: Batch, *, begin: bool) -> _HandOver:
        """Mark the batch as sending and send what this publisher still holds of it.

        With ``begin``, a Kafka transaction is begun first (if anything is to
        be sent); a batch that joins an open transaction is sent into it.
        """
        self.spans.sending(batch)
        counts, refused = self._describe_topics(batch)
        sendable = [m for m in batch.messages if m.id not in refused]
        held = {m.id for m in batch.messages}
        # Counted from before the mark, so that it ends no later than the
        # write deadline the database computes from the mark's own time.
        window = SendWindow.from_now(
            self.config.hand_over_seconds, self.config.write_deadline_seconds
        )
        began = False
        if sendable and begin:
            try:
                # Opens the session (init_transactions) whose id the mark records.
                self.sink.begin_transaction()
            except Exception as exc:  # noqa: BLE001 - nothing was sent: each settles pending
                # Before any record: it says nothing of the messages (no broker, or
                # no right to the transactional.id), so none is charged a failure,
                # and the loop backs off as in an outage (/readyz says Kafka).
                self.health.kafka.failed(exc)
                log.warning("batch %s: the Kafka transaction could not begin: %s", batch.id, exc)
                reason = f"not sent: the Kafka transaction could not begin: {exc}"
                for m in batch.messages:
                    self._failure_class[m.id] = OUTAGE
                return _HandOver(
                    batch,
                    refused,
                    held,
                    [],
                    {},
                    {},
                    began=False,
                    settled=[_unsent(m, reason) for m in batch.messages],
                )
            began = self._transaction_open = True
            self.health.kafka.succeeded()  # its session is open: the broker lets it write
        if sendable:
            held = self.store.mark_sending(
                batch, counts, self.config.write_deadline_seconds, self.sink.transactional_id
            )
            self._progress()
            self._claim_ahead()
            self._count_lost_before_sending(batch, held)
            sendable = [m for m in sendable if m.id in held]
        records = [
            OutgoingRecord(
                m.id,
                m.topic,
                partition_for(m.key, m.id, counts[m.topic]),
                m.key,
                m.value,
                [*m.headers, (ID_HEADER, str(m.id).encode())],
            )
            for m in sendable
        ]
        alone = {m.id for m in sendable if m.send_alone}
        keys = {m.id: (m.topic, m.key) for m in sendable if m.key is not None}
        created = {m.id: m.created_at for m in sendable}
        sent, unsent, shared = self._send_in_order(records, alone, keys, created, window)
        return _HandOver(batch, refused, held, records, sent, unsent, began=began, shared=shared)

    def _joining(self, parts: list[_HandOver]) -> Batch | None:
        """The next claimed batch, if it is to join the open transaction; else None.

        Only under backlog (the last batch came back full, and so did the one
        claimed ahead of it), while every record so far was confirmed (else
        the transaction is aborted anyway), and up to ``transaction_records``
        records: a commit costs a fixed time, so a transaction must carry
        enough records, but a batch that waits for later ones to commit waits
        longer. At a low rate batches come back short and commit one by one.
        """
        if (
            not any(p.began for p in parts)
            or self._stopping.is_set()
            or len(parts[-1].batch.messages) < self.config.batch_size
            or sum(len(p.sent) for p in parts) + self.config.batch_size
            > self.config.transaction_records
            or any(not p.clean for p in parts)
            or self._ahead is None
        ):
            return None
        ahead, self._ahead = self._ahead, None
        try:
            batch = ahead.result()
        except psycopg.Error as exc:
            # Commit what is in hand; the next claim meets the database's
            # trouble again, in the loop, where it is handled.
            log.warning("claiming ahead failed: %s", exc)
            return None
        self._ahead_paused = batch is None or len(batch.messages) < self.config.batch_size
        if batch is not None and len(batch.messages) < self.config.batch_size:
            # No backlog after all: it waits for the next turn, on its own.
            self._ahead = _done(batch)
            return None
        return batch

    def _settlements(self, part: _HandOver, end: TransactionEnd | None) -> list[Settlement]:
        """One settlement per message of the part's batch still held, by its outcome."""
        if part.settled is not None:
            return part.settled
        suspects = part.shared
        to_send = {r.message_id for r in part.records}
        settlements = []
        for m in part.batch.messages:
            if m.id in part.refused and m.id in part.held:
                settlements.append(part.refused[m.id])
            elif m.id in to_send and m.id not in part.sent:
                settlements.append(_unsent(m, part.unsent.get(m.id, HELD_BACK)))
            elif m.id in part.sent:
                record, report = part.sent[m.id]
                settlements.append(
                    self._settlement(
                        m, report, record.partition, shared=m.id in suspects, transaction=end
                    )
                )
        return settlements

    def _end_transaction(self, batches: list[Batch], parts: list[_HandOver]) -> TransactionEnd:
        """Commit the transaction if Kafka confirmed every record sent, else abort it.

        A session fenced by another producer with its transactional.id (a
        successor recovered a batch while this process was frozen or
        starved) is a zombie: nothing of its batches is recorded, and the
        next batch starts a new session.
        """
        self._transaction_open = False
        reports = [report for p in parts for _, report in p.sent.values()]
        fenced = any(isinstance(r.error, FENCING_ERRORS) for r in reports)
        if fenced:
            self.sink.discard_producer()
            end = TransactionEnd.FENCED
        else:
            commit = bool(reports) and all(r.error is None for r in reports)
            end = self.sink.end_transaction(commit=commit)
        ids = ", ".join(str(b.id) for b in batches)
        if end is TransactionEnd.ABORTED and any(
            may_land_after_abort(r.error, handed_to_producer=r.handed_to_producer) for r in reports
        ):
            # What it carried is settled not written and sent again: never in
            # this session, which a late request of the aborted one could join.
            self._leave_session(
                f"batch {ids}: a record's request went unanswered in the transaction it "
                "aborted, and could still arrive"
            )
        if end is TransactionEnd.FENCED:
            lost = sum(len(b.messages) for b in batches)
            self.totals.stale += lost
            self.metrics.lease_losses.labels("fenced").inc(lost)
            log.error(
                "batch %s: this producer session was fenced: another publisher took its "
                "transactional.id over (this process was frozen or starved past its lease); "
                "nothing of the batch is recorded by this publisher",
                ids,
                extra={"batch_id": batches[0].id},
            )
        elif end is not TransactionEnd.COMMITTED or not reports:
            log.warning(
                "batch %s: transaction %s", ids, end.value, extra={"batch_id": batches[0].id}
            )
        else:
            # Committed: its records are delivered now.
            committed_at = time.time()
            for part in parts:
                for m in part.batch.messages:
                    if m.id in part.sent and m.created_at is not None:
                        self.metrics.commit_to_ack_seconds.observe(
                            max(committed_at - m.created_at.timestamp(), 0.0)
                        )
        return end

    def _abandon_transaction(self, batches: list[Batch]) -> None:
        """Abort the transaction an error left open (the database went away between its
        begin and its end), so that read_committed consumers of its partitions are not
        held back until it times out. What it carried is never committed; its batches
        stay open, for recovery to decide once their leases expire. The run loop then
        leaves the session (``_leave_session``).
        """
        if not self._transaction_open:
            return
        self._transaction_open = False
        ids = ", ".join(str(b.id) for b in batches)
        try:
            end = self.sink.end_transaction(commit=False)
        except Exception as exc:  # noqa: BLE001 - the error that got here is re-raised
            log.warning("batch %s: aborting the transaction failed: %s", ids, exc)
            return
        log.warning("batch %s: transaction %s on an error", ids, end.value)

    def _leave_session(self, why: str = "batches marked under it were left open") -> None:
        """Discard the producer session after an error left batches marked under it open
        (or recovery took one while it was sent, or an aborted transaction left a request
        that could still arrive).

        Recovery takes those batches once their leases expire, and the
        reconciler fences the transactional.id their marks recorded before it
        decides them: a transaction of this session would be fenced with them,
        and its batches left to recovery in turn. The next transaction begins
        in a new session, under a new transactional.id.
        """
        session = self.sink.transactional_id
        if session is None:
            return  # no session was opened
        log.warning("leaving producer session %s: %s", session, why)
        self.sink.discard_producer()

    # --- claiming ahead ----------------------------------------------------------

    def _take_claim(self) -> Batch | None:
        """The batch claimed ahead while the last one was sent, or a claim now."""
        ahead, self._ahead = self._ahead, None
        self._ahead_paused = False
        if ahead is not None:
            batch = ahead.result()  # raises what the claim raised
            # Short (its horizon was mostly keys in flight, or held behind a
            # stuck message): no claim-ahead while it is sent, so that the
            # next claim, made after it settles, can fill a whole batch.
            self._ahead_paused = batch is None or len(batch.messages) < self.config.batch_size
            if batch is not None:
                return batch
            # Nothing was claimable then (its keys were in flight): they may be now.
        return self.store.claim(self.config.batch_size, self.config.lease_seconds)

    def _claim_ahead(self) -> None:
        """Start claiming the next batch, on the other connection, while this one is sent.

        The claim takes only what is claimable now: a key with a message in
        this batch is held until the batch settles, so per-key order is kept
        exactly as between two publishers.
        """
        if (
            self._ahead_store is None
            or self._ahead is not None
            or self._ahead_paused
            or self._stopping.is_set()
        ):
            return
        if self._ahead_worker is None:
            self._ahead_worker = ThreadPoolExecutor(1, thread_name_prefix="outbox-claim-ahead")
        # Only the oldest pending messages are candidates: when every one of
        # them waits behind this batch, the claim gives up at once, and the
        # loop claims again (without a bound) once this batch has settled.
        store = self._ahead_store
        self._ahead = self._ahead_worker.submit(
            lambda: self._hold(
                store.claim(
                    self.config.batch_size,
                    self.config.lease_seconds,
                    horizon=2 * self.config.batch_size,
                )
            )
        )

    def _release_claimed_ahead(self) -> None:
        """On stop: give back, unsent, a batch claimed ahead; then end the worker."""
        ahead, self._ahead = self._ahead, None
        try:
            batch = ahead.result() if ahead is not None else None
        except psycopg.Error as exc:
            log.warning("claiming ahead failed while stopping: %s", exc)
            batch = None
        if batch is not None:
            try:
                self._settle(batch, [self._release(m) for m in batch.messages])
            except psycopg.Error as exc:
                # Never sent: recovery returns them to pending when the lease ends.
                log.warning(
                    "could not release %d messages claimed ahead: %s", len(batch.messages), exc
                )
            finally:
                self._let_go(batch)
        if self._ahead_worker is not None:
            self._ahead_worker.shutdown()
            self._ahead_worker = None
        if self._ahead_store is not None:
            self._ahead_store.close()

    def _describe_topics(self, batch: Batch) -> tuple[dict[str, int], dict[uuid.UUID, Settlement]]:
        """Each topic's partition count; the settlements of messages whose topic failed it.

        Once a lookup fails for want of any broker (``is_unreachable``), or because
        the broker refuses the publisher itself (``refuses_publisher``: in
        transactional delivery a lookup builds the producer session), the
        batch's other topics are refused with the same error without a lookup
        each: every one would meet it again, and the loop would wait for each.
        """
        counts: dict[str, int] = {}
        refused: dict[uuid.UUID, Settlement] = {}
        outage: BaseException | None = None
        for topic in sorted({m.topic for m in batch.messages}):
            error = outage
            if error is None:
                try:
                    counts[topic] = self.sink.partition_count(topic)
                    # Answered (perhaps from a cache): the broker is up, which says
                    # nothing of whether it lets this publisher write (kafka_refused).
                    self.health.kafka.answered()
                except Exception as exc:  # noqa: BLE001 - classified per message, none is lost
                    error = exc
                    if answered_for_topic(exc):
                        # The broker answered: no such topic, or not for this publisher.
                        self.health.kafka.answered()
                    else:
                        self.health.kafka.failed(exc)
                        shared = is_unreachable(exc) or refuses_publisher(exc)
                        outage = exc if shared else None
                self._progress()  # a lookup that ended, either way, is the loop turning
            if error is not None:
                report = SendReport(None, None, error, handed_to_producer=False)
                for m in batch.messages:
                    if m.topic == topic:
                        refused[m.id] = self._settlement(m, report, None)
        return counts, refused

    def _count_lost_before_sending(self, batch: Batch, held: set[uuid.UUID]) -> None:
        """Messages this publisher no longer held when sending began: its batch was
        recovered by another publisher, an operator decided the message (a claim that
        waited for the decision read it as it was before), another open batch names it (a
        claim on a stale snapshot), or an earlier message of its key was left out for one
        of those reasons. A batch still held no longer names them (mark_sending)."""
        lost = [m for m in batch.messages if m.id not in held]
        if not lost:
            return
        log.warning(
            "batch %d: %d messages were no longer this batch's to send when sending began "
            "(recovered, decided, claimed by another batch too, or behind one of those); "
            "not sent",
            batch.id,
            len(lost),
            extra={"batch_id": batch.id},
        )
        for m in lost:
            self._message_log(m, batch.id).info(
                "not this batch's to send any more when sending began (recovered, decided "
                "by an operator, claimed by another batch too, or behind an earlier message "
                "of its key that was); not sent"
            )
        self.totals.stale += len(lost)
        self.metrics.lease_losses.labels("before_send").inc(len(lost))

    def _send_in_order(
        self,
        records: list[OutgoingRecord],
        alone: set[uuid.UUID],
        keys: dict[uuid.UUID, tuple[str, bytes]],
        created: dict[uuid.UUID, datetime | None] | None = None,
        window: SendWindow | None = None,
    ) -> tuple[
        dict[uuid.UUID, tuple[OutgoingRecord, SendReport]], dict[uuid.UUID, str], set[uuid.UUID]
    ]:
        """Send the records in order, those in ``alone`` one by one.

        Returns the records handed over with their reports, why each of the
        others was not (a record of a key stopped earlier in the batch is in
        neither: it is held back), and the refusals shared within one send
        (``_shared_refusals``: a refusal in a send of its own is its own).
        Nothing is handed over after the window's hand-over limit, nor written
        after its write deadline.
        """
        sent: dict[uuid.UUID, tuple[OutgoingRecord, SendReport]] = {}
        unsent: dict[uuid.UUID, str] = {}
        shared: set[uuid.UUID] = set()
        stopped_keys: set[tuple[str, bytes]] = set()
        for candidates in _groups(records, alone):
            # After a record of a key was not delivered, later records of that
            # key in this batch are not sent: they wait for the next claim,
            # behind it (settled pending below).
            group = [r for r in candidates if keys.get(r.message_id) not in stopped_keys]
            if not group:
                continue
            try:
                in_flight = self.sink.send(group, window=window)
            except ProducerUnavailable as exc:
                # Nothing of this group was handed over (a producer discarded
                # after an earlier group could not be opened again): it and
                # the rest go back unsent, and the batch settles.
                log.warning("batch's later records not sent: %s", exc)
                self.health.kafka.failed(exc)
                for later in records[records.index(group[0]) :]:
                    unsent.setdefault(later.message_id, f"not sent: {exc}")
                break
            self.faults.reached("after_send")
            reports = self.sink.complete(in_flight)
            self._progress()
            self._observe_acks(group, reports, created or {})
            shared |= _shared_refusals(zip(group, reports, strict=True))
            for r, report in zip(group, reports, strict=True):
                if isinstance(report.error, HandOverClosed):
                    unsent[r.message_id] = HAND_OVER_CLOSED
                    continue
                if isinstance(report.error, TransactionFailed):
                    unsent[r.message_id] = TRANSACTION_FAILED
                    continue
                if isinstance(report.error, NotHandedOver):
                    continue  # held back: settled unsent, behind the refused one
                sent[r.message_id] = (r, report)
                if report.error is not None and r.message_id in keys:
                    stopped_keys.add(keys[r.message_id])
            if self._transactional and any(r.error is not None for r in reports):
                # The transaction is aborted at the end: what is left is not
                # sent into it (and stays with the producer it was begun on).
                for later in records[records.index(group[-1]) + 1 :]:
                    unsent.setdefault(later.message_id, TRANSACTION_FAILED)
                break
            if any(_spoils_producer(r) for r in reports):
                # The producer session that produced an unknown outcome must
                # not send anything more (abandon its producer id), and after a
                # refused record kafka-python's idempotent producer fails every
                # later send: either way the next send starts a fresh one.
                self.sink.discard_producer()
        return sent, unsent, shared

    def _observe_acks(
        self,
        records: Sequence[OutgoingRecord],
        reports: Sequence[SendReport],
        created: dict[uuid.UUID, datetime | None],
    ) -> None:
        """Commit-to-acknowledgement latencies, and whether Kafka answered at all: a record
        it confirmed says it lets this publisher write (lifting ``kafka_refused``); one it
        refused for its content or topic, only that it is up."""
        acked_at = time.time()
        confirmed = answered = False
        failure: BaseException | None = None
        for r, report in zip(records, reports, strict=True):
            if isinstance(report.error, NotHandedOver):
                continue
            if report.error is None:
                confirmed = True
                committed = created.get(r.message_id)
                # In a transaction a record is delivered only once it commits
                # (observed then, by _end_transaction): one aborted and sent
                # again is not counted twice.
                if committed is not None and not self._transactional:
                    self.metrics.commit_to_ack_seconds.observe(
                        max(acked_at - committed.timestamp(), 0.0)
                    )
            elif _refused_by_broker(report):
                answered = True
            else:
                failure = failure or report.error
        if confirmed:
            self.health.kafka.succeeded()
        elif answered:
            self.health.kafka.answered()
        elif failure is not None:
            self.health.kafka.failed(failure)

    def _settlement(
        self,
        m: ClaimedMessage,
        report: SendReport,
        partition: int | None,
        *,
        shared: bool = False,
        transaction: TransactionEnd | None = None,
    ) -> Settlement:
        outcome = classify(report.error, handed_to_producer=report.handed_to_producer)
        error = (
            None
            if report.error is None
            else error_text(report.error, handed_to_producer=report.handed_to_producer)
        )
        failure_class = outcome.value
        if shared:
            # Refused together with other records of its partition: the
            # refusal cannot be pinned on it, and records already on the wire
            # may have been written. Uncertain; its next attempt goes alone.
            outcome = SendOutcome.UNCERTAIN
            failure_class = outcome.value
            error = f"refused together with other records, not attributable: {error}"
        if transaction is not None:
            ended = after_transaction(outcome, transaction)
            if ended is not outcome:
                error = f"{error}; " if error else ""
                error += f"its transaction was {transaction.value}"
                if outcome is SendOutcome.CONFIRMED and ended is SendOutcome.NOT_WRITTEN:
                    # Aborted for another record's sake: sent again at once.
                    return _unsent(m, f"not committed: {error}", send_began=True)
                outcome = ended
                failure_class = outcome.value
        retry_after = 0.0
        counted = counts_as_failure(outcome, report.error)
        if outcome is SendOutcome.NOT_WRITTEN and not counted:
            # The broker could not be reached or could not take it now: that
            # says nothing about the message, so a broker outage never
            # exhausts --max-attempts. It waits out a backoff that grows with
            # its attempts; its first one records a single failure, because
            # the claim holds later messages of a key back only behind a
            # failed one (else they would overtake it while it waits), and
            # outages never add more. The loop backs off too (``_outage_pause``).
            failure_class = OUTAGE
            counted = m.failures == 0
            retry_after = retry_delay(
                m.attempt,
                base_seconds=self.config.retry_base_seconds,
                cap_seconds=self.config.retry_cap_seconds,
            )
        elif outcome is SendOutcome.NOT_WRITTEN and m.failures + 1 >= self.config.max_attempts:
            outcome = SendOutcome.NON_RETRIABLE
            failure_class = "attempts_exhausted"
            error = f"gave up after {m.failures + 1} attempts; last: {error}"
        elif outcome is SendOutcome.NOT_WRITTEN:
            retry_after = retry_delay(
                m.failures + 1,
                base_seconds=self.config.retry_base_seconds,
                cap_seconds=self.config.retry_cap_seconds,
            )
        if outcome is not SendOutcome.CONFIRMED:
            self._failure_class[m.id] = failure_class
        return Settlement(
            message_id=m.id,
            fence=m.fence,
            state=NEXT_STATE[outcome],
            attempt_outcome=ATTEMPT_OUTCOME[outcome],
            partition=report.partition if report.partition is not None else partition,
            offset=report.offset,
            retry_after=retry_after,
            error=error,
            send_began=report.handed_to_producer,
            counts_as_failure=shared or counted,
            send_alone=shared,
        )

    @staticmethod
    def _release(m: ClaimedMessage) -> Settlement:
        return _unsent(m, "released unsent: publisher stopping")

    def _ends_claims(self, m: ClaimedMessage) -> bool:
        """A suspect message whose failures reached ``--max-attempts``: it is not sent again.

        A send settles a message at its limit itself; a suspect one reaches
        it without a settle, when a batch that named it alone was recovered
        (``recover_expired_leases``): its publisher died or hung with it in
        hand, attempt after attempt, whether before sending (recovered to
        pending) or after (uncertain, then proven absent).
        """
        return m.send_alone and m.failures >= self.config.max_attempts

    def _give_up_unsent(self, m: ClaimedMessage) -> Settlement:
        """Quarantine a message that ends its publisher's claims; release any other unsent."""
        if not self._ends_claims(m):
            return _unsent(m, "released unsent: claimed with a message quarantined at its claim")
        self._failure_class[m.id] = "attempts_exhausted"
        return Settlement(
            message_id=m.id,
            fence=m.fence,
            state=State.QUARANTINED,
            attempt_outcome=AttemptOutcome.FAILED,
            error=(
                f"quarantined unsent at its claim: it ended its publisher's claims: "
                f"{m.failures} failures (--max-attempts {self.config.max_attempts}) "
                "counted while it was suspect, each claim of it alone ending with its "
                "publisher's lease expiring with it in hand (the publisher died or hung on "
                "it), before or after sending began; its attempts (outbox inspect) say how "
                "each ended. outbox retry sends it again, alone"
            ),
            send_began=False,
            send_alone=True,
        )

    def _settle(self, batch: Batch, settlements: list[Settlement]) -> None:
        """Record the outcomes, retrying through database outages while the lease lasts.

        With none to record (no message of the batch was its to send any more
        when sending began: see ``_count_lost_before_sending``), the batch is
        still closed: open, it would hold its keys back until its lease ran out.
        A retry that finds messages no longer its own asks which of them an
        earlier try recorded (``settled_by``): its answer may have been lost
        with the connection after it committed.
        """
        deadline = self._clock() + self.config.lease_seconds
        delay = 0.1
        retried = False
        while True:
            try:
                changed = self.store.settle(batch, settlements)
                if retried and len(changed) < len(settlements):
                    # A try before may have committed, its answer lost with
                    # the connection: what it recorded is not a lease lost.
                    changed |= self.store.settled_by(
                        batch, [s.message_id for s in settlements if s.message_id not in changed]
                    )
                self.health.database.succeeded()
                break
            except psycopg.OperationalError as exc:
                retried = True
                self.health.database.failed(exc)
                self.store.close()
                if self._clock() + delay > deadline:
                    log.error(
                        "could not record the outcome of %d messages before their lease "
                        "ran out: %s",
                        len(settlements),
                        exc,
                    )
                    raise
                log.warning(
                    "recording a batch failed (batch %d: %s); retrying in %.1fs",
                    batch.id,
                    exc,
                    delay,
                    extra={"batch_id": batch.id},
                )
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        self._progress()
        if self._transactional and any(
            s.send_began and s.message_id not in changed for s in settlements
        ):
            # Sent, and its settle changed nothing: recovery took it meanwhile.
            self._leave_session(f"batch {batch.id} marked under it was recovered while sent")
        self._count(batch, settlements, changed)

    def _count(self, batch: Batch, settlements: list[Settlement], changed: set[uuid.UUID]) -> None:
        t = self.totals
        m = self.metrics
        t.batches += 1
        m.batches.inc()
        claimed = {c.id: c for c in batch.messages}
        delivered: Counter[str] = Counter()  # by topic: one increment per topic, not per message
        for s in settlements:
            message = claimed[s.message_id]
            failure_class = self._failure_class.get(s.message_id)
            if s.message_id not in changed:
                t.stale += 1
                m.lease_losses.labels("at_settle").inc()
                self._message_log(message, batch.id).warning(
                    "the outcome %s changed nothing: its lease was taken over (the fence is "
                    "stale), or, the batch never having begun sending, another open batch "
                    "names it",
                    s.attempt_outcome,
                )
                continue
            if failure_class is not None:
                m.failures.labels(message.topic, failure_class).inc()
            if s.state is State.DELIVERED:
                t.delivered += 1
                delivered[message.topic] += 1
            elif s.attempt_outcome is AttemptOutcome.ABANDONED:
                t.released += 1
            elif s.state is State.PENDING:
                t.retried += 1
                self._message_log(message, batch.id).warning("not written, will retry: %s", s.error)
            elif s.state is State.UNCERTAIN:
                t.uncertain += 1
                m.uncertain_found.labels("send").inc()
                self._message_log(message, batch.id).error(
                    "outcome unknown, marked uncertain: %s", s.error
                )
            elif s.state is State.QUARANTINED:
                t.quarantined += 1
                self._message_log(message, batch.id).error("quarantined: %s", s.error)
        if delivered:
            self._outages = 0
        elif any(self._failure_class.get(s.message_id) == OUTAGE for s in settlements):
            self._outages += 1
        for topic, n in delivered.items():
            m.deliveries.labels(topic).inc(n)
        if delivered:
            m.last_delivery_time.set_to_current_time()

    @staticmethod
    def _message_log(m: ClaimedMessage, batch_id: int) -> MessageLog:
        return MessageLog(log, m.id, attempt=m.attempt, fence=m.fence, batch_id=batch_id)

    # --- between batches ------------------------------------------------------

    def maintain(self, *, force: bool = False) -> None:
        """Recover expired leases and reconcile uncertain messages when their time has come."""
        now = self._clock()
        if force or now >= self._next_recovery:
            self._next_recovery = now + self.config.recovery_interval
            moved = self.store.recover_expired_leases()
            self.totals.recovered += len(moved)
            for r in moved:
                self.metrics.recovered.labels(r.state.value).inc()
                if r.state is State.UNCERTAIN:
                    self.metrics.uncertain_found.labels("recovery").inc()
                MessageLog(
                    log, r.message_id, attempt=r.attempt, fence=r.fence, batch_id=r.batch_id
                ).warning(
                    "lease of publisher %s expired, moved to %s", r.previous_owner, r.state.value
                )
        if self.reconciler is not None and (force or now >= self._next_reconcile):
            self._next_reconcile = now + self.config.reconcile_interval
            try:
                report = self.reconciler.run_once()
            except kafka_errors.KafkaError as exc:
                # A read, not a write: the next answer ends it (unanswered).
                self.health.kafka.unanswered(exc)
                log.warning("reconciliation postponed, Kafka unavailable: %s", exc)
            else:
                self._count_reconciled(report)
                if report.decided and self.reconciler.pages_left:
                    # A backlog (after an outage): the next page at the next
                    # turn, between batches, not a whole interval later. A page
                    # whose messages all wait gives the interval back.
                    self._next_reconcile = now

    def _count_reconciled(self, report: ReconcileReport) -> None:
        self.totals.reconciled += report.decided
        resolved = self.metrics.uncertain_resolved
        resolved.labels("delivered").inc(len(report.delivered))
        resolved.labels("pending").inc(len(report.pending))
        resolved.labels("escalated").inc(len(report.escalated))
        if report.decided or report.deferred:
            self.health.kafka.answered()  # the scanner read from the broker

    def _idle_wait(self) -> float | None:
        """Seconds to sleep when a claim found nothing; ``None`` to exit when idle."""
        # Exiting also waits for held messages whose stuck message moved on (their mark
        # goes at the next hold pass); a publisher that keeps running finds them then.
        if not self.store.work_left(stale_holds=self.config.exit_when_idle):
            self._nothing_to_write()
            return None if self.config.exit_when_idle else self.config.poll_interval
        seconds = self.store.seconds_until_due()
        if seconds is None:
            self._nothing_to_write()
        elif seconds > 0:
            return min(seconds, self.config.poll_interval)
        # Something is due that only recovery or reconciliation can move (or a
        # pending message another publisher holds the lock of): come back when
        # the next of those passes is due.
        next_pass = min(
            self._next_recovery,
            self._next_reconcile if self.reconciler is not None else self._next_recovery,
        )
        return min(max(next_pass - self._clock(), 0.01), self.config.poll_interval)

    def _nothing_to_write(self) -> None:
        """Nothing will need this publisher (``seconds_until_due``): writes that failed
        before are not failing now (/readyz). A message waiting out its backoff after a
        failed write still wants one. Stepped back, it finds nothing for want of lanes."""
        if self.heartbeat is None or not self.heartbeat.stepped_back:
            self.health.writes_wanted = False

    def _progress(self) -> None:
        self._progress_at = self._clock()
        self.health.loop_turned()

    def _progressing(self) -> bool:
        """Whether the loop moved recently enough for its leases to be renewed."""
        return self._clock() - self._progress_at < self.config.write_deadline_seconds + 10


def _shared_refusals(sent: Iterable[tuple[OutgoingRecord, SendReport]]) -> set[uuid.UUID]:
    """Messages refused with a content error that more than one record of one send got.

    When the broker refuses one record (too large, say), kafka-python's
    idempotent producer fails every record it still has in flight for that
    partition with the same error, and, taking the refusal for a fatal error,
    may abort every batch it holds, of any topic and partition, with it
    (librdkafka fails the whole message set the broker refused). So an error
    that several records got names no one record.
    """
    refused = [record.message_id for record, report in sent if _refused_by_broker(report)]
    return set(refused) if len(refused) > 1 else set()


def _refused_by_broker(report: SendReport) -> bool:
    """The record reached the producer and was refused for what it is."""
    return report.handed_to_producer and (
        classify(report.error, handed_to_producer=True) is SendOutcome.NON_RETRIABLE
    )


def _spoils_producer(report: SendReport) -> bool:
    """After this report, the producer that sent the record must not send again."""
    return report.handed_to_producer and (
        classify(report.error, handed_to_producer=True)
        in (SendOutcome.UNCERTAIN, SendOutcome.NON_RETRIABLE)
    )


def _groups(records: list[OutgoingRecord], alone: set[uuid.UUID]) -> list[list[OutgoingRecord]]:
    """Split records, in order, into sends: each record in ``alone`` on its own."""
    groups: list[list[OutgoingRecord]] = []
    current: list[OutgoingRecord] = []
    for r in records:
        if r.message_id in alone:
            if current:
                groups.append(current)
                current = []
            groups.append([r])
        else:
            current.append(r)
    if current:
        groups.append(current)
    return groups


@dataclass
class _HandOver:
    """One batch's part of a send: what was handed over, and what the broker said."""

    batch: Batch
    #: Settlements of messages whose topic the broker refused to describe.
    refused: dict[uuid.UUID, Settlement]
    #: The batch's messages this publisher still held when sending began.
    held: set[uuid.UUID]
    records: list[OutgoingRecord]
    sent: dict[uuid.UUID, tuple[OutgoingRecord, SendReport]]
    #: Why each record not handed over was not.
    unsent: dict[uuid.UUID, str]
    #: Whether this batch began the Kafka transaction.
    began: bool = False
    #: Its settlements, already known (the transaction could not begin).
    settled: list[Settlement] | None = None
    #: Messages refused with an error other records of the same send got too.
    shared: set[uuid.UUID] = field(default_factory=set)

    @property
    def clean(self) -> bool:
        """Every record of the batch was handed over and confirmed."""
        return (
            self.settled is None
            and not self.refused
            and not self.unsent
            and len(self.sent) == len(self.records)
            and all(report.error is None for _, report in self.sent.values())
        )


def _done(batch: Batch | None) -> Future[Batch | None]:
    """A finished future holding ``batch`` (a claim made ahead and put back)."""
    future: Future[Batch | None] = Future()
    future.set_result(batch)
    return future


#: The failure class of a message given back because the broker was unavailable.
OUTAGE = "broker_unavailable"

HELD_BACK = "not sent: an earlier message of its key in the batch was not delivered"
TRANSACTION_FAILED = "not sent: an earlier record of its transaction failed"
HAND_OVER_CLOSED = (
    "not sent: its turn came after the batch's hand-over window closed (its write deadline "
    "counts on every record being handed over within it); it goes with a later claim"
)


def _unsent(m: ClaimedMessage, reason: str, *, send_began: bool = False) -> Settlement:
    """Back to pending, not written: an abandoned attempt, no failure counted."""
    return Settlement(
        message_id=m.id,
        fence=m.fence,
        state=State.PENDING,
        attempt_outcome=AttemptOutcome.ABANDONED,
        error=reason,
        send_began=send_began,
        send_alone=m.send_alone,
    )
