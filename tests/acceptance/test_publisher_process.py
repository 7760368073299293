"""The real ``outbox-publisher`` console script, run as a separate process."""

from __future__ import annotations

import signal

import psycopg
import pytest

import outbox
from tests.support import (
    DELIVERY_MODES,
    SINKS,
    count_by_state,
    delivery_flags,
    read_topic,
    reads_committed,
    start_publisher,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.acceptance


@pytest.mark.parametrize("delivery", DELIVERY_MODES)
@pytest.mark.parametrize("sink", SINKS)
def test_sigterm_finishes_the_batch_in_hand_and_leaves_nothing_in_flight(
    database_url: str, kafka_bootstrap: str, topic: str, sink: str, delivery: str
) -> None:
    """SIGTERM mid-run: exit 0, no row in_flight, every sent record confirmed exactly once
    (in transactional delivery, every committed one)."""
    mode = ("--sink", sink, *delivery_flags(delivery))
    committed = reads_committed(delivery)
    total = 20_000
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(
            conn, [outbox.Message(topic, f"m{i}", key=f"k{i % 50}") for i in range(total)]
        )
    process = start_publisher(database_url, kafka_bootstrap, "--batch-size", "200", *mode)
    wait_until(
        lambda: count_by_state(database_url).get("delivered", 0) >= 1_000,
        timeout=60,
        what="the publisher to deliver its first batches",
    )
    stderr = stop_process(process, signal.SIGTERM, timeout=60)
    assert process.returncode == 0, stderr
    assert "SIGTERM received" in stderr
    assert "stopped:" in stderr

    counts = count_by_state(database_url)
    assert "in_flight" not in counts
    assert counts.get("delivered", 0) + counts.get("pending", 0) == total
    assert 1_000 <= counts["delivered"] < total, "stopped before the end of the backlog"
    with psycopg.connect(database_url) as conn:
        stopped = conn.execute(
            "SELECT count(*) FILTER (WHERE stopped_at IS NOT NULL), count(*) FROM outbox.publishers"
        ).fetchone()
    assert stopped == (1, 1)

    # Everything it confirmed is in Kafka exactly once, at the stored offset.
    records = read_topic(kafka_bootstrap, topic, committed=committed)
    with psycopg.connect(database_url) as conn:
        stored = {
            mid: (p, o)
            for mid, p, o in conn.execute(
                "SELECT id, kafka_partition, kafka_offset FROM outbox.messages "
                "WHERE state = 'delivered'"
            )
        }
    assert len(records) == len(stored)
    assert {r.outbox_id: (r.partition, r.offset) for r in records} == stored

    # A second publisher delivers the rest and exits by itself.
    finisher = start_publisher(database_url, kafka_bootstrap, "--exit-when-idle", *mode)
    _, stderr = finisher.communicate(timeout=120)
    assert finisher.returncode == 0, stderr
    assert count_by_state(database_url) == {"delivered": total}
    ids = [r.outbox_id for r in read_topic(kafka_bootstrap, topic, committed=committed)]
    assert len(ids) == total
    assert len(set(ids)) == total


def test_idle_publisher_exits_promptly_on_sigint(database_url: str, kafka_bootstrap: str) -> None:
    """A publisher waiting for work stops on SIGINT without waiting for its poll interval."""
    process = start_publisher(database_url, kafka_bootstrap, "--poll-interval", "300")
    wait_until(lambda: _registered(database_url), timeout=30, what="registration")
    stderr = stop_process(process, signal.SIGINT, timeout=15)
    assert process.returncode == 0, stderr
    assert "SIGINT received" in stderr


def _registered(database_url: str) -> bool:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT count(*) FROM outbox.publishers").fetchone()
    return row is not None and row[0] == 1


def test_bad_configuration_is_refused_with_every_problem_named() -> None:
    """Invalid settings exit 2 and list each problem, before connecting to anything."""
    process = start_publisher(
        "mysql://x", "no-port", "--batch-size", "0", "--lease-seconds", "5", "--sink", "kafka"
    )
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 2
    assert "must start with postgresql://" in stderr
    assert "'no-port' is not host:port" in stderr
    assert "batch size must be at least 1" in stderr
    assert "lease (5s) must be longer" in stderr
    assert "sink 'kafka' is not one of kafka-python, confluent" in stderr
