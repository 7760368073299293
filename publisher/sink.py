"""The broker seam: sending a batch of records and reporting on each one.

``Sink`` is the narrow interface the publisher loop depends on;
``KafkaSink`` implements it with kafka-python's idempotent producer.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kafka import KafkaProducer
from kafka import errors as kafka_errors

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OutgoingRecord:
    """One record to send, with its partition already chosen."""

    message_id: uuid.UUID
    topic: str
    partition: int
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


@dataclass(frozen=True, slots=True)
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

    def send(self, records: Sequence[OutgoingRecord]) -> InFlight:
        """Hand every record to the producer without waiting for the broker."""
        ...

    def complete(self, in_flight: InFlight) -> list[SendReport]:
        """Wait for the broker once and report on each record, in the order sent."""
        ...

    def discard_producer(self) -> None:
        """Abandon the current producer session; the next send starts a fresh one."""
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
    max_request_size: int = 1_048_576
    extra: dict[str, Any] = field(default_factory=dict)


class KafkaSink:
    """Sends with an idempotent kafka-python producer (``acks='all'``)."""

    def __init__(self, config: KafkaSinkConfig) -> None:
        self._config = config
        self._producer: Any = None

    def _get_producer(self) -> Any:
        if self._producer is None:
            c = self._config
            self._producer = KafkaProducer(
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
                max_request_size=c.max_request_size,
                **c.extra,
            )
        return self._producer

    def partition_count(self, topic: str) -> int:
        """Look the topic up (creating it where the broker auto-creates topics)."""
        partitions = self._get_producer().partitions_for(topic)
        if not partitions:
            raise kafka_errors.UnknownTopicOrPartitionError(f"topic {topic!r} has no partitions")
        return len(partitions)

    def send(self, records: Sequence[OutgoingRecord]) -> _KafkaInFlight:
        """Hand every record to the producer; a refusal is kept as its report."""
        producer = self._get_producer()
        in_flight = _KafkaInFlight()
        for r in records:
            try:
                future = producer.send(
                    r.topic, value=r.value, key=r.key, headers=r.headers, partition=r.partition
                )
            except Exception as exc:  # noqa: BLE001 - every refusal is classified, none is lost
                in_flight.entries.append(SendReport(None, None, exc, handed_to_producer=False))
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
            except kafka_errors.KafkaTimeoutError:
                log.warning("producer flush did not finish within %.1fs", flush_timeout)
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
                reports.append(SendReport(None, None, entry.exception, handed_to_producer=True))
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
        """Close the producer, letting it finish what it already holds."""
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.close(timeout=self._config.request_timeout_ms / 1000)
