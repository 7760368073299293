"""Both sinks: after the producer refuses a record, later records of its key stay behind."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from publisher.sink import HeldBack, KafkaSink, KafkaSinkConfig, OutgoingRecord, Sink
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
