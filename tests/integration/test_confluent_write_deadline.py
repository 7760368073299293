"""librdkafka writes nothing of a batch after the batch's write deadline.

Its threads write from native code that no check in this process reaches,
so ``ConfluentSink`` holds the deadline through librdkafka itself: each
record's ``message.timeout.ms`` ends early enough that librdkafka drops it
from its queues, unwritten, before the deadline
(``publisher.confluent_sink.message_timeout_ms``). A process frozen with
SIGSTOP after handing its batch over stands for a paused publisher, as in
tests/acceptance/test_paused_publisher.py; test_write_deadline.py checks the
same promise for kafka-python.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("confluent_kafka", reason="the confluent extra is not installed")

from publisher.confluent_sink import ConfluentSink
from publisher.outcomes import SendOutcome, classify
from publisher.sink import HandOverClosed, KafkaSinkConfig, OutgoingRecord, SendWindow
from tests.support import read_topic, wait_until

pytestmark = pytest.mark.integration

#: Publisher settings of the frozen producer: records linger a second (so the
#: freeze finds them still queued), librdkafka gives up on them after 1.4 s
#: (message.timeout.ms: 2.5 + 1 - 2.1 s), and the write deadline is 5.5 s
#: after the mark (hand-over 1 s + max block 1 s + delivery 2.5 s + request 1 s).
FROZEN = {
    "linger_ms": 1_000,
    "delivery_timeout_ms": 2_500,
    "request_timeout_ms": 1_000,
    "max_block_ms": 1_000,
}

#: A process that hands a batch to the confluent sink the way the publisher
#: builds it, prints the batch's monotonic write deadline, freezes itself,
#: and once woken prints each record's outcome.
_CHILD = """
import json, os, signal, sys, uuid
from publisher.app import build_sink
from publisher.config import PublisherConfig
from publisher.outcomes import classify
from publisher.sink import OutgoingRecord, SendWindow

bootstrap, topic, count, settings = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
config = PublisherConfig("postgresql://localhost/unused", bootstrap, sink="confluent",
                         **json.loads(settings))
config.validate()
sink = build_sink(config, uuid.uuid4())
sink.partition_count(topic)  # connected, metadata known: only the records wait
records = [OutgoingRecord(uuid.uuid4(), topic, 0, b"k", f"v{i}".encode(), [])
           for i in range(count)]
window = SendWindow.from_now(config.hand_over_seconds, config.write_deadline_seconds)
in_flight = sink.send(records, window=window)
print(json.dumps({"write_until": window.write_until}), flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
reports = sink.complete(in_flight)
print(json.dumps([
    {"outcome": classify(r.error, handed_to_producer=r.handed_to_producer).value,
     "error": None if r.error is None else str(r.error)}
    for r in reports
]), flush=True)
sink.close()
"""


def _stopped(process: subprocess.Popen[str]) -> bool:
    """Whether the process is frozen by SIGSTOP (state T in /proc)."""
    stat = Path(f"/proc/{process.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def _freeze_after_send(
    bootstrap: str, topic: str, count: int, *, past_deadline: bool
) -> list[dict[str, Any]]:
    """Run ``_CHILD``; wake it half a second past its write deadline, or after 0.3 s."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, bootstrap, topic, str(count), json.dumps(FROZEN)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, child.communicate(timeout=10)[1]
        write_until = json.loads(line)["write_until"]
        wait_until(lambda: _stopped(child), timeout=10, what="the producer's process to freeze")
        # CLOCK_MONOTONIC is one clock for every process of the machine.
        wake_at = write_until + 0.5 if past_deadline else time.monotonic() + 0.3
        time.sleep(max(wake_at - time.monotonic(), 0))
        woke = time.monotonic()
        child.send_signal(signal.SIGCONT)
        stdout, stderr = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, stderr
    assert (woke > write_until) is past_deadline
    reports: list[dict[str, Any]] = json.loads(stdout.strip().splitlines()[-1])
    return reports


def test_a_producer_frozen_past_the_write_deadline_writes_nothing_when_it_wakes(
    kafka_bootstrap: str, topic: str
) -> None:
    """Woken after the deadline, librdkafka drops the batch it queued: nothing reaches Kafka.

    Its first turn after a pause of a second or more looks for timed-out
    records before it builds a request, and every record of the batch timed
    out before the deadline: each is reported ``_MSG_TIMED_OUT``, which is
    uncertain (librdkafka's Python API does not say whether it was sent).
    """
    reports = _freeze_after_send(kafka_bootstrap, topic, 5, past_deadline=True)
    assert [r["outcome"] for r in reports] == [SendOutcome.UNCERTAIN.value] * 5
    assert all("_MSG_TIMED_OUT" in r["error"] for r in reports)
    assert read_topic(kafka_bootstrap, topic) == []


def test_a_producer_frozen_briefly_delivers_its_batch(kafka_bootstrap: str, topic: str) -> None:
    """Frozen for a moment, well within its deadline: every record is written once and confirmed."""
    reports = _freeze_after_send(kafka_bootstrap, topic, 5, past_deadline=False)
    assert [r["outcome"] for r in reports] == [SendOutcome.CONFIRMED.value] * 5
    assert [r.value for r in read_topic(kafka_bootstrap, topic)] == [
        f"v{i}".encode() for i in range(5)
    ]


def test_a_record_taken_too_late_for_its_deadline_is_purged_and_the_rest_not_handed_over(
    kafka_bootstrap: str, topic: str
) -> None:
    """A record librdkafka takes when its timeout would outlast the deadline is purged at once.

    That happens when the process stalls between the hand-over check and
    ``produce()``; here the window's write deadline is simply nearer than
    librdkafka's timeout (30 s). The record is purged while it lingers, and
    the records after it are not handed over.
    """
    sink = ConfluentSink(KafkaSinkConfig(kafka_bootstrap, linger_ms=1_000))
    try:
        sink.partition_count(topic)
        mono, wall = time.monotonic(), time.time()
        window = SendWindow(
            hand_over_until=mono + 60, write_until=mono + 5, write_until_wall=wall + 5
        )
        records = [OutgoingRecord(uuid.uuid4(), topic, 0, b"k", b"v", []) for _ in range(3)]
        reports = sink.complete(sink.send(records, window=window))
    finally:
        sink.close()
    first, *rest = reports
    assert first.handed_to_producer
    assert "_PURGE_QUEUE" in str(first.error)
    assert classify(first.error, handed_to_producer=True) is SendOutcome.UNCERTAIN
    assert all(isinstance(r.error, HandOverClosed) and not r.handed_to_producer for r in rest)
    assert read_topic(kafka_bootstrap, topic) == []
