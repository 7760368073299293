"""The broker seam: sending a batch of records and reporting on each one.

``Sink`` is the narrow interface the publisher loop depends on;
``KafkaSink`` implements it with kafka-python's idempotent producer.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kafka import KafkaAdminClient, KafkaProducer
from kafka import errors as kafka_errors

from publisher.config import ConfigError
from publisher.kafka_security import KAFKA_PYTHON_FIXED, PLAINTEXT, KafkaSecurity, refuse_fixed
from publisher.outcomes import FENCING_ERRORS, TopicMissing, TransactionEnd
from publisher.socket_guard import SocketGuard, WriteDeadlinePassed

log = logging.getLogger(__name__)


# Not frozen: one is built per message, and a frozen dataclass's __init__
# costs about four times as much (it sets each field through object.__setattr__).
@dataclass(slots=True)
class OutgoingRecord:
    """One record to send, with its partition already chosen."""

    message_id: uuid.UUID
    topic: str
    partition: int
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


# Not frozen: one is built per message, and a frozen dataclass's __init__
# costs about four times as much (it sets each field through object.__setattr__).
@dataclass(slots=True)
class SendReport:
    """What the producer said about one record.

    ``error`` is ``None`` when the broker acknowledged it at ``partition`` and
    ``offset``. ``handed_to_producer`` is false when ``send()`` itself refused
    the record, which proves it never left this process.
    """

    partition: int | None
    offset: int | None
    error: BaseException | None
    handed_to_producer: bool


class NotHandedOver(Exception):
    """Never handed to the producer, through no fault of its own: settled pending, unsent."""


class HandOverClosed(NotHandedOver):
    """Not handed to the producer: the batch's hand-over window had closed.

    The batch's write deadline (after which the reconciler may prove its
    records absent) counts on every record being handed over within that
    window; one handed over later could still be written after it.
    """


class TransactionFailed(NotHandedOver):
    """Not handed to the producer: its Kafka transaction had already failed.

    Once a record of a transaction is refused, the producer refuses every
    later send into it until the abort; the record itself is not at fault.
    """


def transaction_failed() -> SendReport:
    """The report of a record the producer refused because its transaction had failed."""
    return SendReport(
        None, None, TransactionFailed("an earlier record of its transaction failed"), False
    )


class ProducerUnavailable(NotHandedOver):
    """Raised by ``send`` before any record was handed over: no producer could be opened
    (no broker answered within ``max_block_ms``, or the session could not begin)."""


@contextlib.contextmanager
def opening_producer() -> Iterator[None]:
    """Around a sink's opening of its producer in ``send``: a failure there handed nothing
    over, and says so as ``ProducerUnavailable``."""
    try:
        yield
    except Exception as exc:
        raise ProducerUnavailable(f"no producer could be opened: {exc}") from exc


def hand_over_closed() -> SendReport:
    """The report of a record whose turn came after its batch's hand-over window."""
    return SendReport(None, None, HandOverClosed("the batch's hand-over window had closed"), False)


@dataclass(frozen=True, slots=True)
class SendWindow:
    """When a batch's records may be handed to the producer, and until when written.

    Both limits count from just before the batch's mark, so each ends no
    later than its counterpart in the database (the batch's ``write_deadline``
    is computed from the mark's own time):

    * ``hand_over_until``: a record whose turn comes later is not handed over;
    * the write deadline: no byte of the batch leaves the process after it.
      The reconciler may prove the batch's records absent once it (and the
      absence grace) has passed, and a successor then sends them again; a
      producer that wrote them later would write them twice.

    The write deadline is checked on two clocks: the monotonic one cannot
    jump back, and the wall clock also counts the time a suspended machine
    was asleep (the monotonic clock stops then). Whichever passes first ends
    the window.
    """

    #: ``time.monotonic()`` after which nothing more is handed over.
    hand_over_until: float
    #: ``time.monotonic()`` after which nothing more is written.
    write_until: float
    #: ``time.time()`` after which nothing more is written.
    write_until_wall: float

    @classmethod
    def from_now(cls, hand_over_seconds: float, write_deadline_seconds: float) -> SendWindow:
        """The window of a batch whose mark is about to be recorded."""
        mono, wall = time.monotonic(), time.time()
        return cls(
            mono + hand_over_seconds, mono + write_deadline_seconds, wall + write_deadline_seconds
        )

    def may_hand_over(self) -> bool:
        """Whether a record may still be handed to the producer."""
        return time.monotonic() <= self.hand_over_until

    def may_write(self) -> bool:
        """Whether the producer may still write the batch's bytes to a socket."""
        return time.monotonic() <= self.write_until and time.time() <= self.write_until_wall


def window_open(window: SendWindow | None) -> bool:
    """Whether a record may still be handed to the producer (always, without a window)."""
    return window is None or window.may_hand_over()


class HeldBack(NotHandedOver):
    """Not handed to the producer: an earlier record of its key in the same send was refused.

    Handing it over anyway could write it ahead of the refused record, which
    will be sent again later (or never): a key's records leave in order or
    not at all. The loop settles it pending, unsent, behind the refused one.
    """


def key_identity(record: OutgoingRecord) -> tuple[str, bytes] | None:
    """The key a record's order is kept within: its topic and key (None when unkeyed)."""
    return None if record.key is None else (record.topic, record.key)


def held_back() -> SendReport:
    """The report of a record held back behind a refusal of its key in the same send."""
    return SendReport(
        None,
        None,
        HeldBack("an earlier record of its key was refused in this send"),
        handed_to_producer=False,
    )


class InFlight(Protocol):
    """Records handed to the producer, not yet reported on."""

    def __len__(self) -> int:
        """How many records were handed over (or refused)."""
        ...


class Sink(Protocol):
    """Where records go: a partition count lookup, then send and complete a batch."""

    def partition_count(self, topic: str) -> int:
        """Number of partitions of ``topic``; raises if the topic cannot be described."""
        ...

    def send(
        self, records: Sequence[OutgoingRecord], *, window: SendWindow | None = None
    ) -> InFlight:
        """Hand every record to the producer without waiting for the broker.

        Once the producer refuses a record, the later records of its key are
        not handed over: their reports are ``held_back()``. Nor is any record
        whose turn comes after the window's hand-over limit: its report, and
        every later record's, is ``hand_over_closed()``. Where the producer
        allows it, nothing is written after the window's write deadline.
        """
        ...

    def complete(self, in_flight: InFlight) -> list[SendReport]:
        """Wait for the broker once and report on each record, in the order sent."""
        ...

    def discard_producer(self) -> None:
        """Abandon the current producer session; the next send starts a fresh one."""
        ...

    @property
    def transactional_id(self) -> str | None:
        """The current session's transactional.id; ``None`` in idempotent delivery."""
        ...

    def begin_transaction(self) -> None:
        """Open a Kafka transaction for the next sends (transactional delivery only)."""
        ...

    def end_transaction(self, *, commit: bool) -> TransactionEnd:
        """Commit (or abort) the open transaction and say how it ended."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


@dataclass
class _KafkaInFlight:
    """Per record, in order: kafka-python's future, or the report of a refused send."""

    entries: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.entries)


#: Settings of a transactional kafka-python producer. A transaction begun right
#: after the last one committed is answered CONCURRENT_TRANSACTIONS until the
#: coordinator has written the commit's markers, and kafka-python retries it
#: after retry_backoff_ms: at its default, 100 ms, every other transaction
#: waited about 100 ms (p90 116 ms against 22 ms at 10 ms, 30 small
#: transactions on one broker). 20 ms is what the Java client uses there.
_TRANSACTIONAL_SETTINGS: dict[str, Any] = {"retry_backoff_ms": 20}


class ProducerSessions:
    """The transactional.ids of a sink's producer sessions, ``<prefix>-<n>``.

    Every producer a sink opens is a new session with a new id, so a fence
    the reconciler takes on an old session's id never hits a session still in
    use. Without a prefix (idempotent delivery) there is no id.
    """

    def __init__(self, prefix: str | None) -> None:
        self._prefix = prefix
        #: Sessions opened so far.
        self._opened = 0

    def next_id(self) -> str | None:
        """The id of the next session, or ``None`` in idempotent delivery."""
        if self._prefix is None:
            return None
        self._opened += 1
        return f"{self._prefix}-{self._opened}"


@dataclass
class KafkaSinkConfig:
    """Producer settings the publisher exposes; the rest are fixed on purpose."""

    bootstrap_servers: str
    client_id: str = "outbox-publisher"
    linger_ms: int = 5
    batch_size: int = 256 * 1024
    #: Upper bound for the broker to acknowledge a record, retries included.
    delivery_timeout_ms: int = 30_000
    request_timeout_ms: int = 10_000
    #: How long ``send()`` and metadata lookups may block.
    max_block_ms: int = 10_000
    #: Whether the publisher's metadata requests may create a missing topic
    #: (where the broker allows it at all).
    allow_auto_create_topics: bool = True
    max_request_size: int = 1_048_576
    #: Transactional delivery: each producer session gets the transactional.id
    #: ``<prefix>-<n>`` (n counts the sessions); ``None``: idempotent delivery.
    transactional_id_prefix: str | None = None
    #: TLS and SASL, for the producer and the sink's admin client.
    security: KafkaSecurity = PLAINTEXT
    #: Passed to the producer as they are: kafka-python keyword arguments, or
    #: librdkafka properties for ``ConfluentSink``, which takes this config too.
    #: A setting the publisher fixes (acks, idempotence, timeouts, security:
    #: ``publisher.kafka_security``) is refused with ``ConfigError`` when the
    #: sink is built.
    extra: dict[str, Any] = field(default_factory=dict)


class KafkaSink:
    """Sends with an idempotent kafka-python producer (``acks='all'``).

    A ``SocketGuard`` keeps each producer from writing a batch's bytes after
    the batch's write deadline (``publisher.socket_guard``).
    """

    def __init__(self, config: KafkaSinkConfig) -> None:
        refuse_fixed(config.extra, KAFKA_PYTHON_FIXED, "kafka-python")
        unknown = sorted(set(config.extra) - set(KafkaProducer.DEFAULT_CONFIG))
        if unknown:
            # Refused now: kafka-python would refuse each producer, at every batch.
            raise ConfigError(
                "invalid Kafka producer settings: kafka-python has no producer setting "
                + ", ".join(repr(k) for k in unknown)
            )
        self._config = config
        self._producer: Any = None
        #: Keeps the current producer from writing past its batch's write deadline.
        self._guard: SocketGuard | None = None
        self._sessions = ProducerSessions(config.transactional_id_prefix)
        self._transactional_id: str | None = None

    def _get_producer(self) -> Any:
        if self._guard is not None and self._guard.tripped:
            # The guard closed this producer after its batch was answered (a
            # late write of a batch left armed): start a fresh one.
            self.discard_producer()
        if self._producer is None:
            c = self._config
            transactional_id = self._sessions.next_id()
            settings: dict[str, Any] = dict(
                bootstrap_servers=c.bootstrap_servers,
                client_id=c.client_id,
                # Both set explicitly: the guarantees below depend on them.
                enable_idempotence=True,
                acks="all",
                linger_ms=c.linger_ms,
                batch_size=c.batch_size,
                delivery_timeout_ms=c.delivery_timeout_ms,
                request_timeout_ms=c.request_timeout_ms,
                max_block_ms=c.max_block_ms,
                # Finding a broker at all is bounded alike (kafka-python's own
                # default is 30 s): a topic lookup blocks at most max_block_ms.
                bootstrap_timeout_ms=c.max_block_ms,
                max_request_size=c.max_request_size,
                allow_auto_create_topics=c.allow_auto_create_topics,
                transactional_id=transactional_id,
                **(_TRANSACTIONAL_SETTINGS if transactional_id is not None else {}),
                **c.security.kafka_python(),
            )
            # The extras may tune what is not fixed (linger_ms, retry_backoff_ms...):
            # merged, not passed twice.
            settings.update(c.extra)
            self._producer = KafkaProducer(**settings)
            # kafka-python 3.0 does not pass allow_auto_create_topics on to the
            # metadata its producer requests, so a missing topic would be
            # created all the same; set it where the request is built.
            self._producer._metadata.config["allow_auto_create_topics"] = c.allow_auto_create_topics
            self._guard = SocketGuard(self._producer)
            if transactional_id is not None:
                try:
                    # Fences any earlier session of this id, and gets an epoch.
                    self._producer.init_transactions()
                except BaseException:
                    self.discard_producer()
                    raise
                self._transactional_id = transactional_id
        return self._producer

    @property
    def transactional_id(self) -> str | None:
        """The current session's transactional.id; ``None`` in idempotent delivery."""
        return self._transactional_id if self._producer is not None else None

    def begin_transaction(self) -> None:
        """Open a Kafka transaction for the next sends."""
        self._get_producer().begin_transaction()

    def end_transaction(self, *, commit: bool) -> TransactionEnd:
        """Commit (after every record was confirmed) or abort the open transaction.

        Waits at most the request timeout for the coordinator's answer: no
        answer is ``UNKNOWN``, and the session is discarded (the reconciler
        fences its transactional.id before deciding). A commit that fails
        with an abortable error is aborted. ``FENCED``: the session is a zombie.
        """
        producer = self._producer
        if producer is None:
            return TransactionEnd.UNKNOWN  # closed mid-transaction (by the socket guard)
        manager = producer._transaction_manager
        end = TransactionEnd.COMMITTED if commit else TransactionEnd.ABORTED
        try:
            if commit and manager.has_abortable_error():
                end = TransactionEnd.ABORTED
            result = (
                manager.begin_commit() if end is TransactionEnd.COMMITTED else manager.begin_abort()
            )
            producer._sender.wakeup()
            if not result.wait(timeout_ms=self._config.request_timeout_ms):
                log.warning("no answer to the transaction's %s in time", end.value)
                end = TransactionEnd.UNKNOWN
        except kafka_errors.KafkaError as exc:
            if _fenced(producer):
                end = TransactionEnd.FENCED
            elif end is TransactionEnd.COMMITTED and manager.has_abortable_error():
                log.warning("the transaction's commit failed (%s); aborting it", exc)
                return self.end_transaction(commit=False)
            else:
                log.warning("the transaction's %s failed: %s", end.value, exc)
                end = TransactionEnd.UNKNOWN
        if end in (TransactionEnd.UNKNOWN, TransactionEnd.FENCED):
            self.discard_producer()
        elif self._guard is not None:
            # Ended, its records are out of the producer (an abort drops what it
            # still held): the next send arms the guard with its own window. Left
            # armed, the old deadline would trip on the next metadata request
            # and close a healthy session.
            self._guard.disarm()
        return end

    def partition_count(self, topic: str) -> int:
        """Look the topic up (creating it where allowed); ``TopicMissing`` if it does not exist.

        A topic that cannot be created makes kafka-python wait ``max_block_ms``
        and time out, which on its own would look like an unreachable broker;
        the cluster's topic list tells the two apart.
        """
        try:
            partitions = self._get_producer().partitions_for(topic)
        except kafka_errors.KafkaTimeoutError:
            if topic not in self._list_topics():
                raise TopicMissing(
                    f"topic {topic!r} does not exist and is not created automatically"
                ) from None
            raise
        if not partitions:
            raise TopicMissing(f"topic {topic!r} has no partitions")
        return len(partitions)

    def _list_topics(self) -> set[str]:
        admin = KafkaAdminClient(
            bootstrap_servers=self._config.bootstrap_servers,
            client_id=f"{self._config.client_id}-admin",
            request_timeout_ms=self._config.request_timeout_ms,
            # Not kafka-python's 30 s to find a broker: the loop waits on this.
            bootstrap_timeout_ms=self._config.request_timeout_ms,
            **self._config.security.kafka_python(),
        )
        try:
            return set(admin.list_topics())
        finally:
            admin.close()

    def send(
        self, records: Sequence[OutgoingRecord], *, window: SendWindow | None = None
    ) -> _KafkaInFlight:
        """Hand every record to the producer; a refusal is kept as its report.

        The producer's socket writes are guarded from here until every record
        is answered: none is written after the window's write deadline.
        """
        with opening_producer():
            producer = self._get_producer()
        assert self._guard is not None
        self._guard.arm(window)
        in_flight = _KafkaInFlight()
        refused_keys: set[tuple[str, bytes] | None] = set()
        for index, r in enumerate(records):
            if not window_open(window):
                in_flight.entries.extend(hand_over_closed() for _ in records[index:])
                break
            key = key_identity(r)
            if key is not None and key in refused_keys:
                in_flight.entries.append(held_back())
                continue
            try:
                future = producer.send(
                    r.topic, value=r.value, key=r.key, headers=r.headers, partition=r.partition
                )
            except Exception as exc:  # noqa: BLE001 - every refusal is classified, none is lost
                if _transaction_failed(producer, exc):
                    # Refused for an earlier record's failure, as is every later one.
                    in_flight.entries.extend(transaction_failed() for _ in records[index:])
                    break
                in_flight.entries.append(
                    SendReport(None, None, _send_refusal(exc), handed_to_producer=False)
                )
                refused_keys.add(key)
            else:
                in_flight.entries.append(future)
        return in_flight

    def complete(self, in_flight: InFlight) -> list[SendReport]:
        """Flush once, then read every future; one still unanswered is uncertain."""
        assert isinstance(in_flight, _KafkaInFlight)
        if self._producer is not None:
            flush_timeout = (
                self._config.delivery_timeout_ms + self._config.request_timeout_ms
            ) / 1000
            try:
                self._producer.flush(timeout=flush_timeout)
            except kafka_errors.KafkaError as exc:
                # A timeout, or a fatal error after which kafka-python aborts
                # its batches: either way each future below says what it knows,
                # and one still unanswered is uncertain.
                log.warning("producer flush ended early: %s", exc)
                # After a fatal error the sender fails the remaining batches
                # from its own thread; give their futures a moment to say so.
                deadline = time.monotonic() + self._config.request_timeout_ms / 1000
                for entry in in_flight.entries:
                    if isinstance(entry, SendReport) or entry.is_done:
                        continue
                    with contextlib.suppress(Exception):
                        entry.get(timeout=max(deadline - time.monotonic(), 0.001))
        tripped = self._guard is not None and self._guard.tripped
        reports: list[SendReport] = []
        for entry in in_flight.entries:
            if isinstance(entry, SendReport):
                reports.append(entry)
            elif not entry.is_done:
                silence = kafka_errors.KafkaTimeoutError("no answer from the broker in time")
                reports.append(SendReport(None, None, silence, handed_to_producer=True))
            elif entry.succeeded():
                metadata = entry.value
                reports.append(SendReport(metadata.partition, metadata.offset, None, True))
            else:
                # After the guard closed the producer, its records fail with a
                # generic "closed forcefully": name the real cause.
                error = WriteDeadlinePassed(str(entry.exception)) if tripped else entry.exception
                reports.append(SendReport(None, None, error, handed_to_producer=True))
        if tripped:
            self.discard_producer()  # closed by the guard: the next send starts a fresh one
        elif self._guard is not None and all(
            isinstance(e, SendReport) or (e.is_done and e.succeeded()) for e in in_flight.entries
        ):
            # Only a batch the broker confirmed whole is out of the producer.
            # A future that failed proves nothing about its bytes: kafka-python's
            # sender expires the batches it has just drained and then writes
            # them all the same, in the same turn, so disarming on a failed
            # future would let that write through after the deadline. Such a
            # producer is discarded next (the outcome is uncertain), and the
            # guard stays armed until then.
            self._guard.disarm()
        return reports

    def discard_producer(self) -> None:
        """Stop the producer at once: buffered records are dropped, never sent later.

        kafka-python's ``close(timeout=0)`` flushes first and raises when
        batches are still incomplete, before it force-closes the sender
        thread, which would then go on sending in the background. So the
        sender is force-closed first; that fails every incomplete batch, and
        the close that follows has nothing left to wait for.
        """
        producer, self._producer = self._producer, None
        self._guard = None
        self._transactional_id = None
        if producer is None:
            return
        sender = getattr(producer, "_sender", None)
        if sender is not None:
            sender.force_close()
            sender.join(timeout=self._config.request_timeout_ms / 1000)
        try:
            producer.close(timeout=0)
        except kafka_errors.KafkaError as exc:
            log.warning("closing the abandoned producer: %s", exc)

    def close(self) -> None:
        """Close the producer, letting it finish what it already holds (for a request
        timeout); what is still unanswered then is dropped, as ``discard_producer`` drops it.

        kafka-python's ``close(timeout)`` flushes first and raises when the flush
        times out, before it closes anything: its sender thread would go on.
        """
        producer = self._producer
        if producer is None:
            return
        try:
            producer.close(timeout=self._config.request_timeout_ms / 1000)
        except kafka_errors.KafkaError as exc:
            log.warning("closing the producer with records unanswered: %s", exc)
            self.discard_producer()
            return
        self._producer = None
        self._guard = None
        self._transactional_id = None


def _send_refusal(exc: Exception) -> Exception:
    """What ``producer.send`` raised, as ``classify`` should know it.

    kafka-python raises a plain ``ValueError`` for a partition its metadata
    does not list yet (a fresh producer, asking a broker not yet up to date
    after partitions were added): that is the metadata's state, not the
    record's fault, so it is retried as an unknown partition is, not
    quarantined as a bad argument.
    """
    if isinstance(exc, ValueError) and str(exc).startswith("Unrecognized partition"):
        unknown: Exception = kafka_errors.UnknownTopicOrPartitionError(
            f"{exc} (in the producer's metadata)"
        )
        return unknown
    return exc


def _transaction_failed(producer: Any, exc: Exception) -> bool:
    """Whether ``send`` refused a record because the producer's transaction had failed.

    Its transaction manager then raises a plain ``KafkaError``; a record
    refused for what it is (its size, say) raises a subclass, and keeps it.
    """
    manager = getattr(producer, "_transaction_manager", None)
    return (
        type(exc) is kafka_errors.KafkaError
        and manager is not None
        and manager.is_transactional()
        and manager.has_error()
    )


def _fenced(producer: Any) -> bool:
    """Whether this producer session was fenced by another with its transactional.id."""
    manager = getattr(producer, "_transaction_manager", None)
    return manager is not None and isinstance(manager.last_error, FENCING_ERRORS)
