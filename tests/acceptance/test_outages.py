"""The broker or the database goes away in the middle of a run and comes back.

These tests stop and restart the local services that ``services/up`` runs,
so they are skipped when the tests use services started some other way.
"""

from __future__ import annotations

import signal

import psycopg
import pytest

import outbox
from tests.support import (
    assert_each_delivered_once,
    count_by_state,
    fast_publisher_flags,
    local_service,
    local_services_running,
    start_publisher,
    stop_process,
    wait_until,
)

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(
        not local_services_running(), reason="needs the services that services/up runs"
    ),
]

TOTAL = 4_000
FAST = fast_publisher_flags(100)


def _enqueue(database_url: str, topic: str, first: int, count: int) -> None:
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(
            conn,
            [outbox.Message(topic, f"m{i}", key=f"k{i % 11}") for i in range(first, first + count)],
        )


def _failed_attempts(database_url: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM outbox.attempts WHERE outcome <> 'delivered'"
        ).fetchone()
    return row[0] if row else 0


def _wait_all_delivered(database_url: str) -> None:
    wait_until(
        lambda: count_by_state(database_url) == {"delivered": TOTAL},
        timeout=240,
        interval=0.5,
        what="every message to be delivered after the restart",
    )


def _assert_exactly_once(database_url: str, kafka_bootstrap: str, topic: str) -> None:
    with psycopg.connect(database_url) as conn:
        ids = [mid for (mid,) in conn.execute("SELECT id FROM outbox.messages")]
    assert len(ids) == TOTAL
    assert_each_delivered_once(database_url, kafka_bootstrap, topic, ids)
    with psycopg.connect(database_url) as conn:
        twice = conn.execute(
            "SELECT count(*) FROM (SELECT message_id FROM outbox.attempts "
            "WHERE outcome = 'delivered' GROUP BY message_id HAVING count(*) > 1) AS t"
        ).fetchone()
    assert twice == (0,)


def test_broker_restart_mid_run_ends_with_each_message_delivered_once(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Kafka stops and restarts: failed sends retry or are reconciled, none is duplicated."""
    _enqueue(database_url, topic, 0, TOTAL // 2)
    publisher = start_publisher(database_url, kafka_bootstrap, *FAST)
    try:
        wait_until(
            lambda: count_by_state(database_url) == {"delivered": TOTAL // 2},
            timeout=60,
            what="the first half to be delivered",
        )
        local_service("down", "kafka")
        try:
            # Committed while the broker is away: the publisher tries and fails.
            _enqueue(database_url, topic, TOTAL // 2, TOTAL // 2)
            wait_until(
                lambda: _failed_attempts(database_url) > 0,
                timeout=60,
                what="a failed attempt while Kafka is down",
            )
        finally:
            local_service("up", "kafka")
        _wait_all_delivered(database_url)
    finally:
        stderr = stop_process(publisher, signal.SIGTERM, timeout=60)
    assert publisher.returncode == 0, stderr
    _assert_exactly_once(database_url, kafka_bootstrap, topic)
    with psycopg.connect(database_url) as conn:
        outcomes: dict[str, int] = dict(
            conn.execute(
                "SELECT outcome, count(*) FROM outbox.attempts GROUP BY outcome"
            ).fetchall()
        )
        decided = conn.execute("SELECT count(*) FROM outbox.decisions").fetchone()
    assert outcomes["delivered"] == TOTAL
    # Each uncertain outcome was reconciled from Kafka rather than resent blindly.
    assert (decided or (0,))[0] == outcomes.get("uncertain", 0)


def test_database_restart_mid_run_reconnects_without_breaking_a_fence(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """PostgreSQL restarts: the publisher reconnects and every outcome lands under its fence."""
    _enqueue(database_url, topic, 0, TOTAL)
    publisher = start_publisher(database_url, kafka_bootstrap, *FAST)
    try:
        wait_until(
            lambda: count_by_state(database_url).get("delivered", 0) >= 300,
            timeout=60,
            what="the first deliveries",
        )
        local_service("down", "postgres")
        local_service("up", "postgres")
        _wait_all_delivered(database_url)
    finally:
        stderr = stop_process(publisher, signal.SIGTERM, timeout=60)
    assert publisher.returncode == 0, stderr
    assert "database unavailable" in stderr or "recording a batch failed" in stderr
    _assert_exactly_once(database_url, kafka_bootstrap, topic)
    with psycopg.connect(database_url) as conn:
        stale = conn.execute(
            "SELECT count(*) FROM outbox.messages m JOIN outbox.attempts a "
            "ON a.message_id = m.id AND a.outcome = 'delivered' WHERE a.fence <> m.fence"
        ).fetchone()
    assert stale == (0,)
