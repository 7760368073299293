"""kafka-python's producer writes nothing of a batch after the batch's write deadline.

The check sits at the last step before the socket (``publisher.socket_guard``):
records still buffered when the deadline passes (a long linger here stands in
for a process frozen after handing them over) are dropped, never written.
"""

from __future__ import annotations

import time
import uuid

import pytest

from publisher.outcomes import SendOutcome, classify
from publisher.sink import KafkaSink, KafkaSinkConfig, OutgoingRecord, SendWindow
from publisher.socket_guard import WriteDeadlinePassed
from tests.support import read_topic, wait_until

pytestmark = pytest.mark.integration


def _records(topic: str, n: int) -> list[OutgoingRecord]:
    return [OutgoingRecord(uuid.uuid4(), topic, 0, b"k", f"v{i}".encode(), []) for i in range(n)]


def test_records_buffered_past_the_write_deadline_are_dropped_not_written(
    kafka_bootstrap: str, topic: str
) -> None:
    """Lingering past the deadline: nothing reaches Kafka, each record is uncertain, none lost."""
    sink = KafkaSink(KafkaSinkConfig(kafka_bootstrap, linger_ms=1500))
    try:
        sink.partition_count(topic)  # connected, metadata known: only the records wait
        window = SendWindow.from_now(hand_over_seconds=10, write_deadline_seconds=0.5)
        in_flight = sink.send(_records(topic, 5), window=window)
        # Not flushed (a flush sends at once): the records linger past the deadline.
        guard = sink._guard
        assert guard is not None
        wait_until(lambda: guard.tripped, timeout=10, what="the linger to end past the deadline")
        reports = sink.complete(in_flight)
        # The guard closed that producer; the next batch gets a fresh one.
        later = sink.complete(sink.send(_records(topic, 1), window=SendWindow.from_now(10, 60)))
    finally:
        sink.close()
    assert len(reports) == 5
    for report in reports:
        assert isinstance(report.error, WriteDeadlinePassed)
        assert report.handed_to_producer
        assert classify(report.error, handed_to_producer=True) is SendOutcome.UNCERTAIN
    assert later[0].error is None
    assert [r.value for r in read_topic(kafka_bootstrap, topic)] == [b"v0"]


def test_records_written_within_the_write_deadline_are_delivered(
    kafka_bootstrap: str, topic: str
) -> None:
    """The same linger inside a longer deadline: every record is written once and confirmed."""
    sink = KafkaSink(KafkaSinkConfig(kafka_bootstrap, linger_ms=1500))
    started = time.monotonic()
    try:
        in_flight = sink.send(_records(topic, 5), window=SendWindow.from_now(10, 30))
        # Not flushed (a flush sends at once): written when the linger ends.
        wait_until(lambda: all(f.is_done for f in in_flight.entries), timeout=10, what="the acks")
        reports = sink.complete(in_flight)
        # Answered: the guard no longer holds the producer to that batch's deadline.
        guard = sink._guard
        assert guard is not None
        assert guard._window is None
    finally:
        sink.close()
    assert time.monotonic() - started >= 1.0  # it did linger
    assert [r.error for r in reports] == [None] * 5
    assert [r.value for r in read_topic(kafka_bootstrap, topic)] == [
        f"v{i}".encode() for i in range(5)
    ]
