"""The publisher loop: claim a batch, send it, record what the broker said.

One iteration (``run_once``) is the whole state machine of a batch:

1. claim: pending -> in_flight under a lease, fence + 1 (one statement);
2. choose each record's partition and send the batch, flushing once;
3. classify each record's outcome and settle the batch in one statement:
   delivered, pending again (not written, with backoff), uncertain, or
   quarantined. Only rows still carrying this claim's fence change.

``run`` repeats it, sleeping on NOTIFY or the poll interval when there is
nothing to do, until ``request_stop`` is called.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from outbox.intent import ID_HEADER
from outbox.states import State
from publisher.config import PublisherConfig
from publisher.outcomes import ATTEMPT_OUTCOME, NEXT_STATE, SendOutcome, classify, retry_delay
from publisher.partitioning import partition_for
from publisher.sink import OutgoingRecord, SendReport, Sink
from publisher.store import Batch, PublisherStore, Settlement
from publisher.waker import Waker

log = logging.getLogger(__name__)


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


class Publisher:
    """Delivers committed intents to Kafka until asked to stop."""

    def __init__(
        self,
        config: PublisherConfig,
        store: PublisherStore,
        sink: Sink,
        waker: Waker | None = None,
        *,
        version: str = "dev",
        pid: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.store = store
        self.sink = sink
        self.waker = waker or Waker(None)
        self.totals = Totals()
        self._version = version
        self._pid = pid
        self._clock = clock
        self._stopping = threading.Event()
        self._last_heartbeat = 0.0

    @property
    def publisher_id(self) -> uuid.UUID:
        """This process's id in ``outbox.publishers`` and ``lease_owner``."""
        return self.store.publisher_id

    def request_stop(self) -> None:
        """Stop claiming; the batch in hand is finished and settled first."""
        self._stopping.set()
        self.waker.wake()

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested."""
        return self._stopping.is_set()

    def run(self) -> Totals:
        """Deliver until stopped (or idle, with ``exit_when_idle``); return the totals."""
        self.store.register(self._version, self._pid)
        self.waker.start()
        log.info(
            "publisher %s started (batch %d, lease %gs, poll %gs)",
            self.publisher_id,
            self.config.batch_size,
            self.config.lease_seconds,
            self.config.poll_interval,
        )
        try:
            while not self._stopping.is_set():
                try:
                    self._maybe_heartbeat()
                    if self.run_once():
                        continue
                    wait = self._idle_wait()
                except psycopg.OperationalError as exc:
                    log.warning("database unavailable (%s); retrying", exc)
                    self.store.close()
                    wait = self.config.poll_interval
                if wait is None:
                    log.info("nothing left to deliver; exiting (--exit-when-idle)")
                    break
                self.waker.wait(wait)
        finally:
            self.waker.stop()
            self.sink.close()
            try:
                self.store.mark_stopped()
            except psycopg.Error as exc:
                log.warning("could not record the stop: %s", exc)
            self.store.close()
        t = self.totals
        log.info(
            "publisher %s stopped: %d delivered, %d to retry, %d uncertain, %d quarantined, "
            "%d released, %d stale in %d batches",
            self.publisher_id,
            t.delivered,
            t.retried,
            t.uncertain,
            t.quarantined,
            t.released,
            t.stale,
            t.batches,
        )
        return t

    def run_once(self) -> int:
        """Claim, send and settle one batch; return how many messages it claimed."""
        batch = self.store.claim(self.config.batch_size, self.config.lease_seconds)
        if batch is None:
            return 0
        if self._stopping.is_set():
            self._settle(batch, [self._release(m.id, m.fence) for m in batch.messages])
            return len(batch.messages)
        settlements = self._send(batch)
        if any(s.state is State.UNCERTAIN for s in settlements):
            # The producer session that produced an unknown outcome must not
            # send anything more: abandon its producer id before going on.
            self.sink.discard_producer()
        self._settle(batch, settlements)
        return len(batch.messages)

    def _send(self, batch: Batch) -> list[Settlement]:
        """Send the batch; return one settlement per message, in batch order."""
        partition_counts: dict[str, int] = {}
        topic_errors: dict[str, BaseException] = {}
        for topic in {m.topic for m in batch.messages}:
            try:
                partition_counts[topic] = self.sink.partition_count(topic)
            except Exception as exc:  # noqa: BLE001 - classified below, per message
                topic_errors[topic] = exc
        records: list[OutgoingRecord] = []
        settlements: list[Settlement | None] = []
        for m in batch.messages:
            error = topic_errors.get(m.topic)
            if error is not None:
                report = SendReport(None, None, error, handed_to_producer=False)
                settlements.append(self._settlement(m.id, m.fence, m.attempt, report, None))
                continue
            partition = partition_for(m.key, m.id, partition_counts[m.topic])
            records.append(
                OutgoingRecord(
                    m.id,
                    m.topic,
                    partition,
                    m.key,
                    m.value,
                    [*m.headers, (ID_HEADER, str(m.id).encode())],
                )
            )
            settlements.append(None)
        reports = iter(self.sink.send_batch(records)) if records else iter(())
        sent = iter(records)
        return [
            s
            if s is not None
            else self._settlement(m.id, m.fence, m.attempt, next(reports), next(sent).partition)
            for m, s in zip(batch.messages, settlements, strict=True)
        ]

    def _settlement(
        self,
        message_id: uuid.UUID,
        fence: int,
        attempt: int,
        report: SendReport,
        partition: int | None,
    ) -> Settlement:
        outcome = classify(report.error, handed_to_producer=report.handed_to_producer)
        error = None if report.error is None else f"{type(report.error).__name__}: {report.error}"
        retry_after = 0.0
        if outcome is SendOutcome.NOT_WRITTEN:
            retry_after = retry_delay(
                attempt,
                base_seconds=self.config.retry_base_seconds,
                cap_seconds=self.config.retry_cap_seconds,
            )
        return Settlement(
            message_id=message_id,
            fence=fence,
            state=NEXT_STATE[outcome],
            attempt_outcome=ATTEMPT_OUTCOME[outcome],
            partition=report.partition if report.partition is not None else partition,
            offset=report.offset,
            retry_after=retry_after,
            error=error,
            send_began=report.handed_to_producer,
        )

    @staticmethod
    def _release(message_id: uuid.UUID, fence: int) -> Settlement:
        return Settlement(
            message_id=message_id,
            fence=fence,
            state=State.PENDING,
            attempt_outcome="abandoned",
            error="released unsent: publisher stopping",
            send_began=False,
        )

    def _settle(self, batch: Batch, settlements: list[Settlement]) -> None:
        """Record the outcomes, retrying through database outages while the lease lasts."""
        deadline = self._clock() + self.config.lease_seconds
        delay = 0.1
        while True:
            try:
                changed = self.store.settle(batch, settlements)
                break
            except psycopg.OperationalError as exc:
                self.store.close()
                if self._clock() + delay > deadline:
                    log.error(
                        "could not record the outcome of %d messages before their lease "
                        "ran out: %s",
                        len(settlements),
                        exc,
                    )
                    raise
                log.warning("recording a batch failed (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        t = self.totals
        t.batches += 1
        for s in settlements:
            if s.message_id not in changed:
                t.stale += 1
                log.warning(
                    "message %s: fence %d is stale, the outcome %s changed nothing",
                    s.message_id,
                    s.fence,
                    s.attempt_outcome,
                )
            elif s.state is State.DELIVERED:
                t.delivered += 1
            elif s.attempt_outcome == "abandoned":
                t.released += 1
            elif s.state is State.PENDING:
                t.retried += 1
                log.warning("message %s attempt failed, will retry: %s", s.message_id, s.error)
            elif s.state is State.UNCERTAIN:
                t.uncertain += 1
                log.error("message %s outcome unknown, marked uncertain: %s", s.message_id, s.error)
            elif s.state is State.QUARANTINED:
                t.quarantined += 1
                log.error("message %s quarantined: %s", s.message_id, s.error)
        log.debug("batch of %d settled", len(settlements))

    def _maybe_heartbeat(self) -> None:
        now = self._clock()
        if now - self._last_heartbeat >= self.config.heartbeat_interval:
            self.store.heartbeat()
            self._last_heartbeat = now

    def _idle_wait(self) -> float | None:
        """Seconds to sleep when a claim found nothing; ``None`` to exit when idle."""
        seconds = self.store.seconds_until_available()
        if seconds is None:
            return None if self.config.exit_when_idle else self.config.poll_interval
        return min(max(seconds, 0.01), self.config.poll_interval)
