"""Both sinks: what they do not hand to the producer.

After the producer refuses a record, later records of its key stay behind;
once the batch's hand-over window has closed, nothing more is handed over.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from publisher.sink import (
    HandOverClosed,
    HeldBack,
    KafkaSink,
    KafkaSinkConfig,
    OutgoingRecord,
    SendWindow,
    Sink,
)
from tests.support import read_topic

pytestmark = pytest.mark.integration


def _kafka_python(config: KafkaSinkConfig) -> Sink:
    return KafkaSink(config)


def _confluent(config: KafkaSinkConfig) -> Sink:
    confluent_sink = pytest.importorskip(
        "publisher.confluent_sink", reason="the confluent extra is not installed"
    )
    sink: Sink = confluent_sink.ConfluentSink(config)
    return sink


@pytest.mark.parametrize(
    "make_sink", [_kafka_python, _confluent], ids=["kafka-python", "confluent"]
)
def test_a_refused_record_holds_back_its_key_and_only_its_key(
    kafka_bootstrap: str, topic: str, make_sink: Callable[[KafkaSinkConfig], Sink]
) -> None:
    """Too big for the producer: refused; its key's next record is not handed over; others go."""
    big, behind, other = (uuid.uuid4() for _ in range(3))
    records = [
        OutgoingRecord(big, topic, 0, b"k", b"x" * 20_000, []),
        OutgoingRecord(behind, topic, 0, b"k", b"small", []),
        OutgoingRecord(other, topic, 0, b"j", b"small", []),
    ]
    sink = make_sink(KafkaSinkConfig(kafka_bootstrap, max_request_size=10_000))
    try:
        refused, held, delivered = sink.complete(sink.send(records))
    finally:
        sink.close()
    assert refused.error is not None
    assert not refused.handed_to_producer
    assert isinstance(held.error, HeldBack)
    assert not held.handed_to_producer
    assert delivered.error is None
    assert delivered.offset is not None
    # Only the other key's record reached the topic.
    assert [(r.key, r.value) for r in read_topic(kafka_bootstrap, topic)] == [(b"j", b"small")]


@pytest.mark.parametrize(
    "make_sink", [_kafka_python, _confluent], ids=["kafka-python", "confluent"]
)
def test_nothing_is_handed_over_after_the_hand_over_window(
    kafka_bootstrap: str, topic: str, make_sink: Callable[[KafkaSinkConfig], Sink]
) -> None:
    """A send whose window has closed hands nothing to the producer: nothing reaches Kafka."""
    records = [
        OutgoingRecord(uuid.uuid4(), topic, 0, b"k", value, [])
        for value in (b"on time", b"late", b"later")
    ]
    sink = make_sink(KafkaSinkConfig(kafka_bootstrap))
    try:
        on_time = sink.complete(sink.send(records[:1], window=SendWindow.from_now(60, 60)))
        late = sink.complete(sink.send(records[1:], window=SendWindow.from_now(-1, 60)))
    finally:
        sink.close()
    assert on_time[0].error is None
    for report in late:
        assert isinstance(report.error, HandOverClosed)
        assert not report.handed_to_producer
    assert [r.value for r in read_topic(kafka_bootstrap, topic)] == [b"on time"]
