"""A sink on confluent-kafka (librdkafka), behind the same ``Sink`` interface as ``KafkaSink``.

Installed with the ``confluent`` extra (``pip install 'pg-kafka-outbox[confluent]'``)
and chosen with ``--sink confluent``. The producer is idempotent with
``acks=all``, every record goes to the partition the publisher chose, and
each record's delivery callback reports its partition and offset or its
error. Errors are translated by ``publisher.outcomes.from_librdkafka`` into
the exceptions ``classify`` already knows, so both sinks' records end in
the same outcomes; a record whose callback has not fired by the deadline is
uncertain, as a silent future is for ``KafkaSink``.

librdkafka writes from native threads that no check in this process can
reach, so the batch's write deadline is held by librdkafka itself: every
record's ``message.timeout.ms`` ends early enough that librdkafka has given
up on it, and dropped it from its queues unwritten, before the deadline
(``message_timeout_ms`` has the arithmetic).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from kafka import errors as kafka_errors

from publisher.config import WRITE_MARGIN_MS, ConfigError
from publisher.kafka_security import LIBRDKAFKA_FIXED, refuse_fixed
from publisher.outcomes import LibrdkafkaError, TopicMissing, TransactionEnd, from_librdkafka
from publisher.sink import (
    InFlight,
    KafkaSinkConfig,
    OutgoingRecord,
    ProducerSessions,
    SendReport,
    SendWindow,
    hand_over_closed,
    held_back,
    key_identity,
    opening_producer,
    transaction_failed,
    window_open,
)

log = logging.getLogger(__name__)

#: What librdkafka reports to a session whose transactional.id was taken over.
_FENCING_CODES = frozenset(
    code
    for code in (
        getattr(KafkaError, "_FENCED", None),
        getattr(KafkaError, "PRODUCER_FENCED", None),
        getattr(KafkaError, "INVALID_PRODUCER_EPOCH", None),
    )
    if code is not None
)

#: librdkafka's own log lines (connections, metadata), as Python log records.
librdkafka_log = logging.getLogger("publisher.librdkafka")

#: How long a topic's partition count is used before it is looked up again.
#: kafka-python reads it from metadata it refreshes every 5 minutes; asking
#: the broker before every batch would cost a round trip per batch.
PARTITION_COUNT_MAX_AGE = 30.0

#: Errors of a topic lookup that no waiting can cure.
_LOOKUP_REFUSALS = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.TOPIC_EXCEPTION})

#: librdkafka's names for the per-record delivery timeout.
_TIMEOUT_PROPERTIES = ("message.timeout.ms", "delivery.timeout.ms")


#: librdkafka's (and the broker's usual) transaction timeout, kept unless the records'
#: own timeout is longer.
_DEFAULT_TRANSACTION_TIMEOUT_MS = 60_000


def message_timeout_ms(config: KafkaSinkConfig) -> int:
    """librdkafka's ``message.timeout.ms`` for ``config``: it gives up on every record in time.

    The write deadline a batch records (``PublisherConfig.write_deadline_seconds``)
    is, from the batch's mark::

        hand-over window + max_block_ms + delivery_timeout_ms + request_timeout_ms

    A record is handed over within the hand-over window, and ``produce()``
    blocks at most ``max_block_ms`` on a full queue, so librdkafka stamps its
    enqueue time (on the monotonic clock) at most ``hand-over window +
    max_block_ms`` after the mark, and gives up on it ``message.timeout.ms``
    later; after that it may still write it for ``WRITE_MARGIN_MS``. So::

        message.timeout.ms + WRITE_MARGIN_MS <= delivery_timeout_ms + request_timeout_ms

    It is the delivery timeout, as for kafka-python, shortened where the
    request timeout is below the margin (2.1 s). A shorter value set in
    ``config.extra`` is kept; a longer one, or 0 (no timeout), is refused.
    ``send()`` checks each record's own stamp against its batch's deadline
    (``_times_out_in_time``). Raises ``ConfigError`` naming the settings when
    nothing is left for librdkafka.
    """
    allowed = config.delivery_timeout_ms + config.request_timeout_ms - WRITE_MARGIN_MS
    timeout = min(config.delivery_timeout_ms, allowed)
    if timeout < 1:
        raise ConfigError(
            f"with the confluent sink, the delivery timeout ({config.delivery_timeout_ms} ms, "
            f"--delivery-timeout-ms) and the request timeout ({config.request_timeout_ms} ms, "
            f"--request-timeout-ms) must add up to more than {WRITE_MARGIN_MS} ms: librdkafka "
            f"may write a record up to {WRITE_MARGIN_MS} ms after its message.timeout.ms, and "
            "must have given it up before the batch's write deadline"
        )
    for name in _TIMEOUT_PROPERTIES:
        if name not in config.extra:
            continue
        value = int(config.extra[name])
        if value == 0 or value > allowed:
            raise ConfigError(
                f"librdkafka property {name}={value} lets a record be written after its "
                f"batch's write deadline: with a delivery timeout of "
                f"{config.delivery_timeout_ms} ms (--delivery-timeout-ms) and a request "
                f"timeout of {config.request_timeout_ms} ms (--request-timeout-ms) it must "
                f"be between 1 and {allowed} ms"
            )
        timeout = value
    return timeout


#: What ``produce()`` raises once the transaction failed (an earlier record of it was
#: refused: _STATE until the abort) or the producer did (_FATAL): the record is not at fault.
_TRANSACTION_FAILED_CODES = frozenset((KafkaError._STATE, KafkaError._FATAL))


def _transaction_failed(exc: Exception) -> bool:
    """Whether ``produce()`` refused a record because its transaction (or producer) had failed."""
    return (
        isinstance(exc, KafkaException)
        and isinstance(exc.args[0], KafkaError)
        and exc.args[0].code() in _TRANSACTION_FAILED_CODES
    )


def _exception(error: KafkaError) -> BaseException:
    return from_librdkafka(error.code(), error.name(), error.str())


@dataclass
class _ConfluentInFlight:
    """The producer that was handed the records, and per record its report once known."""

    producer: Producer | None
    reports: list[SendReport | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.reports)


def _on_delivery(
    reports: list[SendReport | None], index: int, error: KafkaError | None, message: Message
) -> None:
    """librdkafka's delivery report of record ``index`` (served by ``poll``/``flush``)."""
    if error is not None:
        reports[index] = SendReport(None, None, _exception(error), handed_to_producer=True)
        return
    partition, offset = message.partition(), message.offset()
    if partition is None or offset is None or offset < 0:
        # Cannot happen with acks=all, but a delivery without an offset is
        # no confirmation: let reconciliation find where it is.
        silent = kafka_errors.KafkaError(f"acknowledged without an offset ({partition}, {offset})")
        reports[index] = SendReport(None, None, silent, handed_to_producer=True)
        return
    reports[index] = SendReport(partition, offset, None, handed_to_producer=True)


class ConfluentSink:
    """Sends with an idempotent librdkafka producer (``acks=all``).

    ``config.extra`` holds librdkafka properties (``{"compression.type": "lz4"}``)
    here, not kafka-python keyword arguments.
    """

    def __init__(self, config: KafkaSinkConfig) -> None:
        refuse_fixed(config.extra, LIBRDKAFKA_FIXED, "librdkafka")
        self._config = config
        #: Refuses, before any producer exists, a config that could write past a deadline.
        self._message_timeout_ms = message_timeout_ms(config)
        #: Transactional delivery: librdkafka refuses a producer whose records may wait
        #: longer than its transactions (message.timeout.ms <= transaction.timeout.ms).
        self._transaction_timeout_ms = max(
            _DEFAULT_TRANSACTION_TIMEOUT_MS, self._message_timeout_ms
        )
        if config.transactional_id_prefix is not None and "transaction.timeout.ms" in config.extra:
            given = int(config.extra["transaction.timeout.ms"])
            if given < self._message_timeout_ms:
                raise ConfigError(
                    f"librdkafka property transaction.timeout.ms={given} is shorter than the "
                    f"records' timeout ({self._message_timeout_ms} ms, from "
                    "--delivery-timeout-ms): librdkafka refuses such a transactional producer"
                )
            self._transaction_timeout_ms = given
        self._producer: Producer | None = None
        #: Topic -> (partition count, monotonic time it may be used until).
        self._counts: dict[str, tuple[int, float]] = {}
        #: A fatal error of the current producer (idempotence broken): replace it.
        self._fatal: KafkaError | None = None
        self._sessions = ProducerSessions(config.transactional_id_prefix)
        self._transactional_id: str | None = None

    def _get_producer(self) -> Producer:
        if self._fatal is not None:
            log.warning("replacing the producer after a fatal error: %s", self._fatal)
            self.discard_producer()
        if self._producer is None:
            c = self._config
            self._fatal = None
            settings: dict[str, Any] = {
                "bootstrap.servers": c.bootstrap_servers,
                "client.id": c.client_id,
                # Both set explicitly: the guarantees depend on them.
                "enable.idempotence": True,
                "acks": "all",
                # librdkafka refuses a linger as long as the record's timeout
                # (such a record would time out before it was sent): shortened.
                "linger.ms": min(c.linger_ms, self._message_timeout_ms - 1),
                "batch.size": c.batch_size,
                "request.timeout.ms": c.request_timeout_ms,
                "message.max.bytes": c.max_request_size,
                "allow.auto.create.topics": c.allow_auto_create_topics,
                "error_cb": self._on_error,
                "logger": librdkafka_log,
                **c.security.librdkafka(),
                **c.extra,
                # Each record is reported on within this, retries included,
                # and none is written after its batch's write deadline (see
                # message_timeout_ms): the one place the deadline is held.
                "message.timeout.ms": self._message_timeout_ms,
            }
            for alias in _TIMEOUT_PROPERTIES[1:]:
                settings.pop(alias, None)
            transactional_id = self._sessions.next_id()
            if transactional_id is not None:
                settings["transactional.id"] = transactional_id
                settings["transaction.timeout.ms"] = self._transaction_timeout_ms
            producer = Producer(settings)
            if transactional_id is not None:
                try:
                    # Fences any earlier session of this id, and gets an epoch.
                    producer.init_transactions(c.max_block_ms / 1000)
                except KafkaException as exc:
                    producer.close()
                    raise _exception(exc.args[0]) from exc
            self._producer, self._transactional_id = producer, transactional_id
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

        Waits at most the request timeout: no answer is ``UNKNOWN``, and the
        session is discarded (the reconciler fences its transactional.id
        before deciding). A commit that fails and needs an abort is aborted.
        ``FENCED``: the session is a zombie.
        """
        producer = self._producer
        if producer is None:
            return TransactionEnd.UNKNOWN
        timeout = self._config.request_timeout_ms / 1000
        end = TransactionEnd.COMMITTED if commit else TransactionEnd.ABORTED
        try:
            if commit:
                producer.commit_transaction(timeout)
            else:
                producer.abort_transaction(timeout)
        except KafkaException as exc:
            error = exc.args[0]
            if isinstance(error, KafkaError) and error.code() in _FENCING_CODES:
                end = TransactionEnd.FENCED
            elif commit and isinstance(error, KafkaError) and error.txn_requires_abort():
                log.warning("the transaction's commit failed (%s); aborting it", error)
                return self.end_transaction(commit=False)
            else:
                log.warning("the transaction's %s failed: %s", end.value, error)
                end = TransactionEnd.UNKNOWN
        if end in (TransactionEnd.UNKNOWN, TransactionEnd.FENCED):
            self.discard_producer()
        return end

    def _on_error(self, error: KafkaError) -> None:
        """librdkafka's client-level errors: a broker down, a fatal idempotence error."""
        if error.fatal():
            self._fatal = error
            log.error("Kafka producer: fatal error: %s", error)
        else:
            log.warning("Kafka producer: %s", error)

    def partition_count(self, topic: str) -> int:
        """Look the topic up (creating it where allowed); ``TopicMissing`` if it does not exist."""
        cached = self._counts.get(topic)
        if cached is not None and time.monotonic() < cached[1]:
            return cached[0]
        producer = self._get_producer()
        deadline = time.monotonic() + self._config.max_block_ms / 1000
        answered_unknown = False
        while True:
            try:
                metadata = producer.list_topics(
                    topic, timeout=max(deadline - time.monotonic(), 0.001)
                )
            except KafkaException as exc:
                if answered_unknown and time.monotonic() >= deadline:
                    # The broker answered that it does not know the topic; the
                    # last question ran out of time: still unknown.
                    raise self._missing(topic) from None
                raise _exception(exc.args[0]) from None
            described = metadata.topics.get(topic)
            error: KafkaError | None = described.error if described is not None else None
            if described is not None and error is None and described.partitions:
                count = len(described.partitions)
                self._counts[topic] = (count, time.monotonic() + PARTITION_COUNT_MAX_AGE)
                return count
            unknown = error is None or error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
            if error is not None and error.code() in _LOOKUP_REFUSALS:
                raise _exception(error)
            # Being created (LEADER_NOT_AVAILABLE), or not yet known: a topic just
            # created may be missing from the metadata of the broker asked for a
            # moment, so an unknown topic is asked for again until the deadline
            # (as kafka-python's lookup waits) before it counts as missing.
            answered_unknown = unknown
            if time.monotonic() >= deadline:
                if unknown:
                    raise self._missing(topic)
                assert error is not None
                raise _exception(error)
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))

    def _missing(self, topic: str) -> TopicMissing:
        if not self._config.allow_auto_create_topics:
            return TopicMissing(f"topic {topic!r} does not exist and is not created automatically")
        return TopicMissing(f"topic {topic!r} does not exist and the broker did not create it")

    def send(
        self, records: Sequence[OutgoingRecord], *, window: SendWindow | None = None
    ) -> _ConfluentInFlight:
        """Hand every record to the producer; a refusal is kept as its report.

        librdkafka gives up on each record before the window's write deadline
        (``message_timeout_ms``). A record it took too late for that (this
        process stalled between the hand-over check and ``produce()``) is
        purged from the queue at once, with every record still queued, and
        nothing more is handed over.
        """
        with opening_producer():
            producer = self._get_producer()
        in_flight = _ConfluentInFlight(producer, [None] * len(records))
        refused_keys: set[tuple[str, bytes] | None] = set()
        for index, r in enumerate(records):
            if not window_open(window):
                for later in range(index, len(records)):
                    in_flight.reports[later] = hand_over_closed()
                break
            key = key_identity(r)
            if key is not None and key in refused_keys:
                in_flight.reports[index] = held_back()
                continue
            try:
                self._produce(producer, r, partial(_on_delivery, in_flight.reports, index))
            except Exception as exc:  # noqa: BLE001 - every refusal is classified, none is lost
                refusal = self._refusal(exc)  # notes a fatal error: the producer is replaced
                if self._transactional_id is not None and _transaction_failed(exc):
                    # Refused for an earlier record's failure, as is every later one.
                    for later in range(index, len(records)):
                        in_flight.reports[later] = transaction_failed()
                    break
                in_flight.reports[index] = SendReport(None, None, refusal, handed_to_producer=False)
                refused_keys.add(key)
                continue
            if window is not None and not self._times_out_in_time(window):
                self._purge_late(producer)
                for later in range(index + 1, len(records)):
                    in_flight.reports[later] = hand_over_closed()
                break
        return in_flight

    def _times_out_in_time(self, window: SendWindow) -> bool:
        """Whether a record ``produce()`` just took is given up before the window's deadline.

        librdkafka stamped it no earlier than now: its timeout ends at most
        ``message.timeout.ms`` from now, after which it may still be written
        for ``WRITE_MARGIN_MS``. Within the hand-over budget this always
        holds; it fails when the process stalled (or the machine slept: the
        wall clock) after the hand-over check, before librdkafka took it.
        """
        budget = (self._message_timeout_ms + WRITE_MARGIN_MS) / 1000
        return (
            time.monotonic() + budget <= window.write_until
            and time.time() + budget <= window.write_until_wall
        )

    def _purge_late(self, producer: Producer) -> None:
        """Drop what the producer still queues: a record in it could outlive its write deadline.

        librdkafka would send it after its linger, so purging at once nearly
        always wins; a request it built meanwhile is sent all the same. The
        purged records are reported ``_PURGE_QUEUE``: uncertain, as every
        record handed over is until the reconciler looks.
        """
        log.error(
            "a record was handed to librdkafka too late to be given up before its batch's "
            "write deadline (the process stalled while handing it over): purging what the "
            "producer still queues, handing nothing more over"
        )
        try:
            producer.purge(in_queue=True, in_flight=False, blocking=True)
        except (KafkaException, RuntimeError) as exc:
            log.error("could not purge the producer's queue: %s", exc)

    def _produce(
        self,
        producer: Producer,
        r: OutgoingRecord,
        callback: Callable[[KafkaError | None, Message], None],
    ) -> None:
        """``produce()``; while the local queue is full, serve delivery reports (max_block_ms)."""
        deadline: float | None = None
        while True:
            try:
                producer.produce(
                    r.topic,
                    value=r.value,
                    key=r.key,
                    partition=r.partition,
                    # A list of (str, bytes) is what it takes; its stub is invariant.
                    headers=cast("list[tuple[str, str | bytes | None]]", r.headers),
                    on_delivery=callback,
                )
            except BufferError:
                now = time.monotonic()
                deadline = deadline or now + self._config.max_block_ms / 1000
                if now >= deadline:
                    raise
                producer.poll(min(0.1, deadline - now))
            else:
                return

    def _refusal(self, exc: Exception) -> BaseException:
        """What ``produce()`` raised, as ``classify`` knows it."""
        if isinstance(exc, KafkaException) and isinstance(exc.args[0], KafkaError):
            error: KafkaError = exc.args[0]
            if error.fatal():
                self._fatal = error
            return _exception(error)
        if isinstance(exc, BufferError):
            # The local queue stayed full for max_block_ms (confluent-kafka raises
            # a Python BufferError, not librdkafka's error): an outage, as
            # kafka-python's timeout is, that says nothing of the record.
            return LibrdkafkaError(f"local queue full for --max-block-ms: {exc}", "_QUEUE_FULL")
        return exc

    def complete(self, in_flight: InFlight) -> list[SendReport]:
        """Flush once, then report each record; one whose callback never fired is uncertain."""
        assert isinstance(in_flight, _ConfluentInFlight)
        producer = in_flight.producer
        if producer is not None and producer is self._producer and None in in_flight.reports:
            timeout = (self._config.delivery_timeout_ms + self._config.request_timeout_ms) / 1000
            try:
                left = producer.flush(timeout)
            except (KafkaException, SystemError) as exc:
                # A fatal error (the session fenced) may surface from the delivery
                # callbacks as SystemError, its KafkaException as the cause:
                # confluent-kafka calls a callback with that exception pending.
                # Records whose report never came are uncertain, as below.
                log.warning("producer flush ended early: %s", exc.__cause__ or exc)
            else:
                if left:
                    log.warning("%d records still unanswered after %gs", left, timeout)
        silence = kafka_errors.KafkaTimeoutError("no answer from the broker in time")
        return [
            report if report is not None else SendReport(None, None, silence, True)
            for report in in_flight.reports
        ]

    def discard_producer(self) -> None:
        """Make the producer send nothing more, then drop it.

        Records still in its queues are purged (never sent by it, though a
        retry in that queue may have been written before); records in flight
        are purged too: a request already on the wire may still be appended,
        but its answer is ignored and it is never retried. Their delivery
        reports are served here; they are uncertain whichever error they carry.
        """
        producer, self._producer = self._producer, None
        self._counts.clear()
        self._transactional_id = None
        if producer is None:
            return
        try:
            producer.purge(in_queue=True, in_flight=True, blocking=True)
        except (KafkaException, RuntimeError) as exc:
            # Closing would flush, i.e. send what the purge did not remove:
            # the producer is dropped unclosed instead.
            log.error("could not purge the discarded producer, dropping it unclosed: %s", exc)
            return
        try:
            # Serves the purged records' delivery reports; nothing is left to send.
            producer.flush(self._config.request_timeout_ms / 1000)
        except (KafkaException, RuntimeError) as exc:
            log.warning("discarding the producer: %s", exc)
        finally:
            producer.close()

    def close(self) -> None:
        """Let the producer finish what it holds (briefly), then drop it."""
        producer, self._producer = self._producer, None
        self._counts.clear()
        if producer is None:
            return
        try:
            left = producer.flush(self._config.request_timeout_ms / 1000)
            if left:
                log.warning("closing the producer with %d records unanswered", left)
                producer.purge(in_queue=True, in_flight=True, blocking=True)
                producer.flush(0)
        except (KafkaException, RuntimeError) as exc:
            log.warning("closing the producer: %s", exc)
        finally:
            producer.close()
