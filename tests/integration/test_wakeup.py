"""The publisher wakes on NOTIFY from commits, and keeps waking after the listener drops."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

import outbox
from publisher.app import build_publisher
from publisher.loop import Publisher
from tests.support import count_by_state, publisher_config, wait_until

pytestmark = pytest.mark.integration

#: Far longer than any wait below: a delivery within the wait proves a NOTIFY woke it.
LONG_POLL = 60.0


@pytest.fixture
def running_publisher(database_url: str, kafka_bootstrap: str) -> Iterator[Publisher]:
    """A real publisher in a thread, polling only every minute."""
    publisher = build_publisher(
        publisher_config(
            database_url, kafka_bootstrap, exit_when_idle=False, poll_interval=LONG_POLL
        )
    )
    thread = threading.Thread(target=publisher.run, daemon=True)
    thread.start()
    wait_until(publisher.waker.listening.is_set, timeout=10, what="the listener")
    yield publisher
    publisher.request_stop()
    thread.join(timeout=30)
    assert not thread.is_alive()


def _enqueue_and_time_delivery(database_url: str, topic: str) -> float:
    with psycopg.connect(database_url) as conn:
        outbox.enqueue(conn, topic, b"wake up")
    committed = time.monotonic()
    wait_until(
        lambda: (
            count_by_state(database_url).get("pending", 0) == 0
            and count_by_state(database_url).get("delivered", 0) >= 1
        ),
        timeout=10,
        interval=0.01,
        what="delivery after commit",
    )
    return time.monotonic() - committed


def _listener_backends(database_url: str) -> list[int]:
    with psycopg.connect(database_url) as conn:
        return [
            pid
            for (pid,) in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = 'outbox-publisher listener'"
            )
        ]


def test_commit_wakes_the_publisher(
    database_url: str, topic: str, running_publisher: Publisher
) -> None:
    """A committed intent is delivered long before the poll interval comes round."""
    assert _enqueue_and_time_delivery(database_url, topic) < 5.0


def test_listener_reconnects_after_its_connection_is_killed(
    database_url: str, topic: str, running_publisher: Publisher
) -> None:
    """After the LISTEN backend is terminated, the waker reconnects and NOTIFY works again."""
    [backend] = _listener_backends(database_url)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
    wait_until(
        lambda: _listener_backends(database_url) not in ([], [backend]),
        timeout=15,
        what="a new listener connection",
    )
    wait_until(running_publisher.waker.listening.is_set, timeout=10, what="listening again")
    assert _enqueue_and_time_delivery(database_url, topic) < 5.0
