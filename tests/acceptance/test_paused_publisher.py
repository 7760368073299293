"""A publisher frozen with SIGSTOP while it holds a batch, woken after others took over.

A lease stops two publishers from claiming the same message; it cannot stop a
frozen ("zombie") publisher from writing to Kafka when it wakes. These tests
show that a zombie writes no second copy in the default (idempotent) mode:
a batch acknowledged before the freeze is found in Kafka and not resent; a
batch still buffered is dropped at the socket by kafka-python's producer,
and given up by librdkafka's, its write deadline past (docs/guarantees.md,
"A zombie publisher").
"""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from pathlib import Path

import psycopg
import pytest

import outbox
from tests.support import (
    SINKS,
    count_by_state,
    fast_publisher_flags,
    fault_env,
    read_topic,
    start_publisher,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.acceptance

TOTAL = 200
BATCH = 100
FAST = fast_publisher_flags(BATCH)


def _stopped(process: subprocess.Popen[str]) -> bool:
    """Whether the process is frozen by SIGSTOP (state T in /proc)."""
    stat = Path(f"/proc/{process.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def _freeze_then_take_over(
    database_url: str,
    kafka_bootstrap: str,
    topic: str,
    pause_at: str,
    *flags: str,
    successor_flags: tuple[str, ...] = (),
) -> subprocess.Popen[str]:
    """Freeze a publisher at ``pause_at`` of its first batch; let a second one finish the work."""
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(
            conn, [outbox.Message(topic, f"m{i}", key=f"k{i % 7}") for i in range(TOTAL)]
        )
    zombie = start_publisher(
        database_url, kafka_bootstrap, *FAST, *flags, env=fault_env(pause_at=f"{pause_at}:1")
    )
    wait_until(lambda: _stopped(zombie), timeout=60, what="the publisher to freeze")
    successor = start_publisher(
        database_url, kafka_bootstrap, *FAST, *successor_flags, "--exit-when-idle"
    )
    _, stderr = successor.communicate(timeout=180)
    assert successor.returncode == 0, stderr
    assert count_by_state(database_url) == {"delivered": TOTAL}
    return zombie


def _stored_locations(database_url: str) -> dict[object, tuple[int, int]]:
    with psycopg.connect(database_url) as conn:
        return {
            mid: (p, o)
            for mid, p, o in conn.execute(
                "SELECT id, kafka_partition, kafka_offset FROM outbox.messages"
            )
        }


def test_zombie_whose_records_were_acknowledged_changes_nothing_when_it_wakes(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Frozen after the broker acknowledged its batch: found in Kafka, its late settle ignored."""
    zombie = _freeze_then_take_over(database_url, kafka_bootstrap, topic, "after_ack")
    before = _stored_locations(database_url)
    with psycopg.connect(database_url) as conn:
        found = conn.execute(
            "SELECT count(*) FROM outbox.decisions WHERE to_state = 'delivered'"
        ).fetchone()
    assert found == (BATCH,)  # the frozen batch was found in Kafka, not resent

    zombie.send_signal(signal.SIGCONT)
    stderr = stop_process(zombie, signal.SIGTERM, timeout=60)
    assert zombie.returncode == 0, stderr
    assert "the outcome delivered changed nothing: its lease was taken over" in stderr

    copies = Counter(r.outbox_id for r in read_topic(kafka_bootstrap, topic))
    assert len(copies) == TOTAL
    assert max(copies.values()) == 1  # no duplicate
    assert _stored_locations(database_url) == before


#: How long each sink lingers, so that the frozen batch is still in the
#: producer when the publisher freezes: kafka-python buffers it for the whole
#: linger; librdkafka needs a linger below the 1.9 s it gives each record here.
_LINGER_MS = {"kafka-python": "2000", "confluent": "1000"}


@pytest.mark.parametrize("sink", SINKS)
def test_zombie_frozen_before_its_producer_sent_writes_nothing_when_it_wakes(
    database_url: str, kafka_bootstrap: str, topic: str, sink: str
) -> None:
    """Woken past its write deadline, a frozen producer writes none of its buffered batch.

    The publisher froze after handing its batch to the producer and before
    the producer sent it (a long linger keeps it buffered). Its lease
    expired, the reconciler proved the records absent after the write
    deadline, and a successor delivered them. On waking:

    * kafka-python's sender drains the lingering batches, expires them (their
      delivery timeout is long past: the futures fail, "Expiring ...") and
      still writes them, in the same turn. The expiry proves nothing: the
      socket guard, still armed because no record was confirmed, refuses the
      write past the deadline and closes the producer;
    * librdkafka's timeout for those records ended before the deadline, and
      its first turn after the freeze drops timed-out records before it
      builds a request: they are reported timed out.

    Either way the records are uncertain, the zombie's settle changes
    nothing, Kafka has each message once and the database keeps the
    successor's offsets.
    """
    flags = ("--sink", sink)
    zombie = _freeze_then_take_over(
        database_url,
        kafka_bootstrap,
        topic,
        "after_send",
        *flags,
        "--linger-ms",
        _LINGER_MS[sink],
        successor_flags=flags,
    )
    before = _stored_locations(database_url)
    with psycopg.connect(database_url) as conn:
        proven_absent = conn.execute(
            "SELECT count(*) FROM outbox.decisions WHERE to_state = 'pending'"
        ).fetchone()
    assert proven_absent == (BATCH,)

    zombie.send_signal(signal.SIGCONT)
    # It settles the batch in hand before it stops: by then its producer has
    # met the socket, and after the exit nothing of it can write any more.
    stderr = stop_process(zombie, signal.SIGTERM, timeout=60)
    assert zombie.returncode == 0, stderr
    assert "the outcome uncertain changed nothing: its lease was taken over" in stderr

    copies = Counter(r.outbox_id for r in read_topic(kafka_bootstrap, topic))
    assert len(copies) == TOTAL
    assert max(copies.values()) == 1  # no duplicate
    assert _stored_locations(database_url) == before


@pytest.mark.parametrize("sink", SINKS)
def test_transactional_zombie_is_fenced_by_kafka_and_its_batch_is_read_once(
    database_url: str, kafka_bootstrap: str, topic: str, sink: str
) -> None:
    """Transactional delivery: the successor fences the frozen session before deciding.

    Frozen with its batch buffered in an open transaction, the publisher's
    lease expires; the successor's reconciler fences its transactional.id
    (the open transaction is aborted), reads the partition read_committed,
    finds nothing committed and sends the batch again, at once (no absence
    grace). The woken zombie can commit nothing: a read_committed consumer
    sees every message once, and the database keeps the successor's offsets.
    """
    mode = ("--delivery", "transactional", "--sink", sink)
    zombie = _freeze_then_take_over(
        database_url,
        kafka_bootstrap,
        topic,
        "after_send",
        *mode,
        "--linger-ms",
        "2000",
        successor_flags=mode,
    )
    before = _stored_locations(database_url)
    with psycopg.connect(database_url) as conn:
        proven_absent = conn.execute(
            "SELECT count(*) FROM outbox.decisions WHERE to_state = 'pending'"
        ).fetchone()
        sessions = conn.execute(
            "SELECT count(DISTINCT transactional_id) FROM outbox.batches"
        ).fetchone()
    assert proven_absent == (BATCH,)
    assert sessions is not None
    assert sessions[0] >= 2  # the zombie's session and the successor's

    zombie.send_signal(signal.SIGCONT)
    stderr = stop_process(zombie, signal.SIGTERM, timeout=60)
    assert zombie.returncode == 0, stderr

    copies = Counter(r.outbox_id for r in read_topic(kafka_bootstrap, topic, committed=True))
    assert len(copies) == TOTAL
    assert max(copies.values()) == 1  # no duplicate for a read_committed consumer
    assert _stored_locations(database_url) == before
