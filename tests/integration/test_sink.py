"""The Kafka sink against a real broker: reports per record, and a discard that really stops."""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import replace

import pytest
from kafka.errors import KafkaError, UnknownTopicOrPartitionError

from publisher.config import ConfigError
from publisher.outcomes import (
    SendOutcome,
    TransactionEnd,
    classify,
    counts_as_failure,
    is_unreachable,
)
from publisher.sink import KafkaSink, KafkaSinkConfig, OutgoingRecord
from tests.support import read_topic

pytestmark = pytest.mark.integration


def _records(topic: str, count: int) -> list[OutgoingRecord]:
    return [
        OutgoingRecord(uuid.uuid4(), topic, i % 3, f"k{i}".encode(), b"v", [("h", b"1")])
        for i in range(count)
    ]


def test_complete_reports_each_record_at_its_partition_and_offset(
    kafka_bootstrap: str, topic: str
) -> None:
    """Every record handed over is reported confirmed, at the partition it was sent to."""
    sink = KafkaSink(KafkaSinkConfig(kafka_bootstrap))
    try:
        records = _records(topic, 30)
        reports = sink.complete(sink.send(records))
    finally:
        sink.close()
    assert [r.partition for r in reports] == [r.partition for r in records]
    assert all(r.error is None and r.handed_to_producer for r in reports)
    consumed = {(c.partition, c.offset) for c in read_topic(kafka_bootstrap, topic)}
    assert {(r.partition, r.offset) for r in reports} == consumed


def test_discarded_producer_never_sends_what_it_still_buffered(
    kafka_bootstrap: str, topic: str
) -> None:
    """Discarding with records still buffered fails them at once; none reaches Kafka later."""
    sink = KafkaSink(KafkaSinkConfig(kafka_bootstrap, linger_ms=5_000, delivery_timeout_ms=30_000))
    sink.partition_count(topic)
    in_flight = sink.send(_records(topic, 50))
    sink.discard_producer()  # must not raise, though every batch is incomplete
    # Every buffered record was failed by the discard itself, not left to a
    # sender thread that would send it once the linger is over.
    assert all(future.is_done and future.failed() for future in in_flight.entries)
    reports = sink.complete(in_flight)
    assert all(r.error is not None for r in reports)
    # A fresh producer session writes a marker; everything before it in the
    # log would have to be from the discarded one.
    marker = sink.complete(sink.send(_records(topic, 3)))
    sink.close()
    assert all(r.error is None for r in marker)
    assert len(read_topic(kafka_bootstrap, topic)) == 3


def test_a_topic_lookup_with_no_broker_gives_up_within_max_block_and_request_timeouts() -> None:
    """With nothing listening, a lookup fails within --max-block-ms (finding a broker)
    plus --request-timeout-ms (telling a missing topic from a missing cluster), not
    kafka-python's own 30 s to bootstrap; and so does the next, on a new producer."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # nobody listens there once it is closed
    sink = KafkaSink(
        KafkaSinkConfig(f"127.0.0.1:{port}", max_block_ms=1_000, request_timeout_ms=1_000)
    )
    try:
        for topic in ("orders", "payments"):
            began = time.monotonic()
            with pytest.raises(KafkaError) as failed:
                sink.partition_count(topic)
            assert time.monotonic() - began < 10, f"the lookup of {topic} took longer"
            assert is_unreachable(failed.value)
    finally:
        sink.close()


def test_extras_tune_what_the_sink_sets_itself_and_a_misspelt_one_is_refused_at_once(
    kafka_bootstrap: str, topic: str
) -> None:
    """An extra the sink also sets (linger_ms, and retry_backoff_ms in transactional delivery)
    tunes it instead of breaking every producer; a setting kafka-python does not know is
    refused when the sink is built, not at each batch."""
    sink = KafkaSink(
        KafkaSinkConfig(
            kafka_bootstrap,
            transactional_id_prefix=f"outbox-{uuid.uuid4()}",
            extra={"linger_ms": 1, "retry_backoff_ms": 50},
        )
    )
    try:
        sink.begin_transaction()
        reports = sink.complete(sink.send(_records(topic, 3)))
        assert sink.end_transaction(commit=True) is TransactionEnd.COMMITTED
    finally:
        sink.close()
    assert all(r.error is None for r in reports)
    with pytest.raises(ConfigError, match="kafka-python has no producer setting 'lingerms'"):
        KafkaSink(KafkaSinkConfig(kafka_bootstrap, extra={"lingerms": 1}))


def test_a_partition_the_producers_metadata_does_not_list_is_retried_not_quarantined(
    kafka_bootstrap: str, topic: str
) -> None:
    """kafka-python refuses a partition its metadata does not list (yet) with a ValueError:
    reported as an unknown partition, an outage that counts no failure, not a bad record."""
    [record] = _records(topic, 1)
    sink = KafkaSink(KafkaSinkConfig(kafka_bootstrap))
    try:
        [report] = sink.complete(sink.send([replace(record, partition=99)]))
    finally:
        sink.close()
    assert isinstance(report.error, UnknownTopicOrPartitionError)
    assert not report.handed_to_producer
    outcome = classify(report.error, handed_to_producer=False)
    assert (outcome, counts_as_failure(outcome, report.error)) == (SendOutcome.NOT_WRITTEN, False)
