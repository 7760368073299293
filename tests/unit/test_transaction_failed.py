"""A send refused because its Kafka transaction had already failed is not the record's fault.

Once the broker refuses a record of a transaction, the producer refuses
every later send into it until the abort: kafka-python raises a plain
``KafkaError`` from its transaction manager, librdkafka ``_STATE``. Both
sinks report those records as ``TransactionFailed`` (not handed over), so
the loop settles them pending without counting a failure.
"""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from kafka import errors as kafka_errors
from kafka.producer.transaction_manager import TransactionManager, TransactionState
from kafka.structs import TopicPartition

from outbox.ids import new_message_id
from publisher.outcomes import TransactionEnd
from publisher.sink import (
    KafkaSink,
    KafkaSinkConfig,
    OutgoingRecord,
    SendReport,
    SendWindow,
    TransactionFailed,
)


def _records(count: int) -> list[OutgoingRecord]:
    return [
        OutgoingRecord(new_message_id(), "orders", 0, f"k{i}".encode(), b"v", [])
        for i in range(count)
    ]


class _Guard:
    tripped = False

    def arm(self, window: object) -> None:
        """Nothing to guard: no socket is written."""


class _TransactionalProducer:
    """kafka-python's ``send`` path into a transaction: the real transaction manager decides.

    The broker's refusal of the first record reaches the sender thread while
    the loop is still handing records over: here, right after the first send.
    """

    def __init__(self) -> None:
        self._transaction_manager = TransactionManager(
            transactional_id="outbox-test-1",
            transaction_timeout_ms=60_000,
            retry_backoff_ms=20,
            api_version=(3, 0),
            metadata=None,
        )
        manager = self._transaction_manager
        manager.producer_id_and_epoch = type(manager.producer_id_and_epoch)(1, 0)
        manager._current_state = TransactionState.IN_TRANSACTION
        self.sent = 0

    def send(self, topic: str, *, partition: int, **_: Any) -> Future[Any]:
        self._transaction_manager.maybe_add_partition_to_transaction(
            TopicPartition(topic, partition)
        )
        self.sent += 1
        if self.sent == 1:
            self._transaction_manager.transition_to_abortable_error(
                kafka_errors.InvalidRecordError("a compacted topic needs a key")
            )
        return Future()


def test_kafka_python_reports_the_sends_refused_after_the_transaction_failed() -> None:
    """The first record is in flight; the producer refused the rest: TransactionFailed, all."""
    sink = KafkaSink(KafkaSinkConfig("127.0.0.1:1", transactional_id_prefix="outbox-test"))
    producer = _TransactionalProducer()
    sink._producer, sink._guard = producer, _Guard()  # type: ignore[assignment]

    in_flight = sink.send(_records(3))

    assert producer.sent == 1
    assert isinstance(in_flight.entries[0], Future)
    assert [type(e.error) for e in in_flight.entries[1:]] == [TransactionFailed] * 2
    refused = in_flight.entries[1:]
    assert all(isinstance(e, SendReport) and not e.handed_to_producer for e in refused)


def test_kafka_python_keeps_a_records_own_refusal_in_a_failed_transaction() -> None:
    """A record refused for what it is (its size) keeps that error, even once the transaction
    failed: only the transaction manager's own refusal is TransactionFailed."""
    sink = KafkaSink(KafkaSinkConfig("127.0.0.1:1", transactional_id_prefix="outbox-test"))
    producer = _TransactionalProducer()
    producer._transaction_manager.transition_to_abortable_error(
        kafka_errors.InvalidRecordError("an earlier record needs a key")
    )

    def too_large(*_: Any, **__: Any) -> Any:
        raise kafka_errors.MessageSizeTooLargeError("the record is 2,000,000 bytes")

    producer.send = too_large  # type: ignore[method-assign]
    sink._producer, sink._guard = producer, _Guard()  # type: ignore[assignment]

    in_flight = sink.send(_records(1))

    assert [type(e.error) for e in in_flight.entries] == [kafka_errors.MessageSizeTooLargeError]


def test_kafka_python_reports_an_ordinary_refusal_as_it_was() -> None:
    """Without a failed transaction, a refused send keeps its own error (classified as usual)."""
    sink = KafkaSink(KafkaSinkConfig("127.0.0.1:1"))

    class Refusing:
        def send(self, *_: Any, **__: Any) -> Any:
            raise kafka_errors.KafkaTimeoutError("no metadata")

    sink._producer, sink._guard = Refusing(), _Guard()  # type: ignore[assignment]

    in_flight = sink.send(_records(1))

    assert [type(e.error) for e in in_flight.entries] == [kafka_errors.KafkaTimeoutError]


def test_confluent_reports_the_sends_refused_after_the_transaction_failed() -> None:
    """librdkafka's _STATE ("Producing not allowed in transactional state") is TransactionFailed."""
    confluent_kafka = pytest.importorskip("confluent_kafka", reason="the confluent extra is absent")
    from publisher.confluent_sink import ConfluentSink  # noqa: PLC0415 - after the skip

    class Producer:
        produced = 0

        def produce(self, *_: Any, **__: Any) -> None:
            self.produced += 1
            if self.produced > 1:
                raise confluent_kafka.KafkaException(
                    confluent_kafka.KafkaError(confluent_kafka.KafkaError._STATE)
                )

    sink = ConfluentSink(KafkaSinkConfig("127.0.0.1:1", transactional_id_prefix="outbox-test"))
    producer = Producer()
    sink._producer, sink._transactional_id = producer, "outbox-test-1"  # type: ignore[assignment]

    in_flight = sink.send(_records(3))

    assert producer.produced == 2
    assert in_flight.reports[0] is None  # handed over, its delivery report not served yet
    reports = in_flight.reports[1:]
    assert all(r is not None and isinstance(r.error, TransactionFailed) for r in reports)


class _Ended:
    """An abort the coordinator answered."""

    def wait(self, timeout_ms: int) -> bool:
        return True


class _AbortableProducer:
    """A session whose abort succeeds."""

    def __init__(self) -> None:
        self._sender = SimpleNamespace(wakeup=lambda: None)
        self._transaction_manager = SimpleNamespace(
            has_abortable_error=lambda: True, begin_abort=_Ended, begin_commit=_Ended
        )


def test_an_aborted_transaction_leaves_the_guard_unarmed_for_the_next_send() -> None:
    """After a record failed (the guard stays armed) and the abort succeeded, the session is
    kept; its guard must not keep the old batch's deadline, on which the next metadata
    request after it would close the healthy session."""
    sink = KafkaSink(KafkaSinkConfig("k:9092", transactional_id_prefix="outbox-test"))
    producer = _AbortableProducer()
    window = SendWindow.from_now(1.0, 2.0)
    guard = _ArmedGuard()
    guard.arm(window)
    sink._producer, sink._guard = producer, guard  # type: ignore[assignment]

    assert sink.end_transaction(commit=False) is TransactionEnd.ABORTED

    assert sink._producer is producer
    assert guard.window is None


class _ArmedGuard:
    """Records the window it is held to."""

    tripped = False
    window: object = None

    def arm(self, window: object) -> None:
        self.window = window

    def disarm(self) -> None:
        self.window = None
