"""The confluent-kafka (librdkafka) sink against a real broker.

The same promises as ``KafkaSink``: each record at the partition the
publisher chose, with its key and headers, reported at the offset a
consumer reads it at; refusals classified as kafka-python's are; no answer
is never "delivered"; and a discarded producer sends nothing more. The
loop runs end to end with this sink in test_broker_refusals.py and
tests/acceptance/test_publisher_process.py.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator

import pytest

pytest.importorskip("confluent_kafka", reason="the confluent extra is not installed")

from kafka import KafkaAdminClient
from kafka import errors as kafka_errors

from publisher.config import ConfigError
from publisher.confluent_sink import ConfluentSink
from publisher.outcomes import (
    LibrdkafkaError,
    SendOutcome,
    TopicMissing,
    TransactionEnd,
    classify,
    is_outage,
)
from publisher.sink import KafkaSinkConfig, OutgoingRecord, SendReport
from tests.support import read_topic, small_topic

pytestmark = pytest.mark.integration


def _records(topic: str, count: int, partitions: int = 3) -> list[OutgoingRecord]:
    records = []
    for i in range(count):
        message_id = uuid.uuid4()
        records.append(
            OutgoingRecord(
                message_id,
                topic,
                i % partitions,
                f"k{i}".encode(),
                f"v{i}".encode(),
                [("h", b"1"), ("h", b"2"), ("outbox-id", str(message_id).encode())],
            )
        )
    return records


def _outcomes(reports: list[SendReport]) -> list[SendOutcome]:
    return [classify(r.error, handed_to_producer=r.handed_to_producer) for r in reports]


@pytest.fixture
def sinks() -> Iterator[list[ConfluentSink]]:
    """Sinks made by a test, closed after it."""
    made: list[ConfluentSink] = []
    yield made
    for sink in made:
        sink.close()


def _sink(made: list[ConfluentSink], bootstrap: str, **settings: object) -> ConfluentSink:
    sink = ConfluentSink(KafkaSinkConfig(bootstrap, **settings))  # type: ignore[arg-type]
    made.append(sink)
    return sink


def test_records_land_at_their_partition_with_key_headers_and_the_reported_offset(
    kafka_bootstrap: str, topic: str, sinks: list[ConfluentSink]
) -> None:
    """Every record is confirmed at the partition it was sent to; a consumer reads it there."""
    sink = _sink(sinks, kafka_bootstrap)
    assert sink.partition_count(topic) == 3
    records = _records(topic, 30)
    reports = sink.complete(sink.send(records))
    assert all(r.error is None and r.handed_to_producer for r in reports), reports
    assert [r.partition for r in reports] == [r.partition for r in records]

    consumed = {(c.partition, c.offset): c for c in read_topic(kafka_bootstrap, topic)}
    assert len(consumed) == len(records)
    for record, report in zip(records, reports, strict=True):
        found = consumed[(report.partition, report.offset)]  # type: ignore[index]
        assert found.outbox_id == record.message_id
        assert found.key == record.key
        assert found.value == record.value
        assert found.headers == record.headers


def test_a_record_too_large_for_the_topic_fails_its_whole_message_set(
    kafka_bootstrap: str, sinks: list[ConfluentSink]
) -> None:
    """librdkafka sends a partition's records as one message set and the broker refuses all of it.

    Unlike kafka-python, it does not split the set to find the record at
    fault: every record of the set is reported with the size error. The
    loop's shared-refusal handling sends each alone next time (end to end in
    test_broker_refusals.py); sent alone, only the big one is refused.
    """
    small = small_topic(kafka_bootstrap)
    # A long linger: nothing leaves before the flush, so the three go together.
    sink = _sink(sinks, kafka_bootstrap, linger_ms=2_000)
    assert sink.partition_count(small) == 1
    before, big, after = (
        OutgoingRecord(uuid.uuid4(), small, 0, b"k", value, [])
        for value in (b"a", b"x" * 5_000, b"b")
    )
    reports = sink.complete(sink.send([before, big, after]))
    assert all(isinstance(r.error, kafka_errors.MessageSizeTooLargeError) for r in reports)
    assert all(r.handed_to_producer for r in reports)
    assert _outcomes(reports) == [SendOutcome.NON_RETRIABLE] * 3
    sink.discard_producer()  # as the loop does after a refusal

    alone = [sink.complete(sink.send([r]))[0] for r in (before, big, after)]
    assert _outcomes(alone) == [
        SendOutcome.CONFIRMED,
        SendOutcome.NON_RETRIABLE,
        SendOutcome.CONFIRMED,
    ]
    assert [r.value for r in read_topic(kafka_bootstrap, small)] == [b"a", b"b"]


def test_a_record_larger_than_the_producer_accepts_is_refused_before_it_is_handed_over(
    kafka_bootstrap: str, topic: str, sinks: list[ConfluentSink]
) -> None:
    """Over max_request_size, produce() refuses it: non-retriable, its neighbours delivered."""
    sink = _sink(sinks, kafka_bootstrap, max_request_size=10_000)
    sink.partition_count(topic)
    records = _records(topic, 3)
    records[1] = OutgoingRecord(uuid.uuid4(), topic, 1, b"big", b"x" * 20_000, [])
    reports = sink.complete(sink.send(records))
    assert _outcomes(reports) == [
        SendOutcome.CONFIRMED,
        SendOutcome.NON_RETRIABLE,
        SendOutcome.CONFIRMED,
    ]
    assert not reports[1].handed_to_producer
    assert isinstance(reports[1].error, kafka_errors.MessageSizeTooLargeError)


def test_a_missing_topic_is_topic_missing_when_it_may_not_be_created(
    kafka_bootstrap: str, sinks: list[ConfluentSink]
) -> None:
    """Without auto-creation the lookup says TopicMissing and creates nothing, once it has
    asked until --max-block-ms (a topic just created may be missing from the metadata of
    the broker asked for a moment); with it, creates."""
    missing = f"outbox-missing-{uuid.uuid4().hex[:8]}"
    refusing = _sink(sinks, kafka_bootstrap, allow_auto_create_topics=False, max_block_ms=1_000)
    began = time.monotonic()
    with pytest.raises(TopicMissing, match=missing):
        refusing.partition_count(missing)
    assert time.monotonic() - began >= 1.0

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="outbox-tests")
    try:
        assert missing not in admin.list_topics()
        creating = _sink(sinks, kafka_bootstrap, allow_auto_create_topics=True)
        assert creating.partition_count(missing) == 3  # the broker's num.partitions
        assert missing in admin.list_topics()
        admin.delete_topics([missing])
    finally:
        admin.close()


def _dead_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_producer_that_reaches_no_broker_never_reports_delivered(
    sinks: list[ConfluentSink],
) -> None:
    """Handed over: uncertain (it may have left); refused by produce(): not written."""
    sink = _sink(
        sinks,
        f"127.0.0.1:{_dead_port()}",
        linger_ms=0,
        # librdkafka gives each record 1.5 s (2.6 + 1 - 2.1 s, message_timeout_ms).
        delivery_timeout_ms=2_600,
        request_timeout_ms=1_000,
        max_block_ms=300,
        # Two records fill the local queue; the third waits max_block_ms, then is refused.
        extra={"queue.buffering.max.messages": 2},
    )
    with pytest.raises(LibrdkafkaError) as lookup:
        sink.partition_count("any-topic")
    assert classify(lookup.value, handed_to_producer=False) is SendOutcome.NOT_WRITTEN

    reports = sink.complete(sink.send(_records("any-topic", 4)))
    assert [r.handed_to_producer for r in reports] == [True, True, False, False]
    assert _outcomes(reports) == [
        SendOutcome.UNCERTAIN,
        SendOutcome.UNCERTAIN,
        SendOutcome.NOT_WRITTEN,
        SendOutcome.NOT_WRITTEN,
    ]
    assert "_MSG_TIMED_OUT" in str(reports[0].error)
    # confluent-kafka's BufferError, taken as librdkafka's own _QUEUE_FULL: an outage.
    assert isinstance(reports[2].error, LibrdkafkaError)
    assert reports[2].error.name == "_QUEUE_FULL"
    assert is_outage(reports[2].error)


def test_a_discarded_producer_sends_nothing_more(
    kafka_bootstrap: str, topic: str, sinks: list[ConfluentSink]
) -> None:
    """Records still queued when the producer is discarded are purged: none reaches Kafka later."""
    sink = _sink(sinks, kafka_bootstrap, linger_ms=5_000)
    sink.partition_count(topic)
    in_flight = sink.send(_records(topic, 50))
    sink.discard_producer()
    # Every record was reported by the discard itself (purged), not left to a
    # producer that would send it once the linger is over.
    assert None not in in_flight.reports
    reports = sink.complete(in_flight)
    assert all("_PURGE_QUEUE" in str(r.error) for r in reports)
    # librdkafka may have put a retry back in its queue, so even a purged
    # record is only uncertain: reconciliation proves it absent.
    assert set(_outcomes(reports)) == {SendOutcome.UNCERTAIN}
    # A fresh producer writes a marker; anything else in the log would be
    # from the discarded one.
    marker = sink.complete(sink.send(_records(topic, 3)))
    assert all(r.error is None for r in marker)
    assert len(read_topic(kafka_bootstrap, topic)) == 3


def test_a_transactional_sink_with_a_delivery_timeout_past_a_minute_opens_its_session(
    kafka_bootstrap: str, topic: str, sinks: list[ConfluentSink]
) -> None:
    """librdkafka refuses a transactional producer whose records may wait longer than its
    transactions: the sink's transaction timeout follows a longer delivery timeout, and a
    shorter one given as an extra is refused when the sink is built."""
    sink = _sink(
        sinks,
        kafka_bootstrap,
        delivery_timeout_ms=90_000,
        request_timeout_ms=30_000,
        transactional_id_prefix=f"outbox-{uuid.uuid4()}",
    )
    sink.begin_transaction()
    reports = sink.complete(sink.send(_records(topic, 2)))
    assert sink.end_transaction(commit=True) is TransactionEnd.COMMITTED
    assert all(r.error is None for r in reports)
    with pytest.raises(ConfigError, match=r"transaction\.timeout\.ms=60000 is shorter"):
        _sink(
            sinks,
            kafka_bootstrap,
            delivery_timeout_ms=90_000,
            request_timeout_ms=30_000,
            transactional_id_prefix="outbox-x",
            extra={"transaction.timeout.ms": 60_000},
        )
