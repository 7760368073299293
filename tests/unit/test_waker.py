"""The waker's thread and backoff (publisher/waker.py), with no database to listen to.

Listening to a real PostgreSQL, and reconnecting to it: tests/integration/test_wakeup.py.
"""

from __future__ import annotations

import logging

import psycopg
import pytest

from publisher.waker import Waker

#: Nothing listens on port 1: a connection is refused at once.
NOWHERE = "postgresql://127.0.0.1:1/outbox?connect_timeout=2"


def test_without_a_conninfo_start_runs_no_thread() -> None:
    """A polling-only waker starts no listener, and wake() still wakes its waiter."""
    waker = Waker(None)
    waker.start()
    assert not waker.running
    waker.wake()
    assert waker.wait(0)


def test_a_turn_that_cannot_connect_raises_and_is_not_listening() -> None:
    """run_once raises the connection error, for the thread to back off on."""
    waker = Waker(NOWHERE)
    with pytest.raises(psycopg.OperationalError):
        waker.run_once()
    assert not waker.listening.is_set()


def test_each_failed_connection_doubles_the_wait_up_to_30_seconds() -> None:
    """The waits between attempts go 4, 8, 16, then stay at 30 s while the failures go on."""
    waker = Waker(NOWHERE, reconnect_delay=4)
    waits = []
    for _ in range(5):
        waker._turn()  # one turn as the thread runs it, failure handling included
        waits.append(waker._wait_seconds())
    assert waits == [4, 8, 16, 30, 30]


def test_polling_only_never_announces_a_sleep() -> None:
    """Without a conninfo there is nothing to announce: fall_asleep says wait as usual."""
    waker = Waker(None)
    assert waker.fall_asleep() is False
    assert not waker.announced


def test_an_announcement_that_cannot_connect_is_logged_once_and_waits_as_usual(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused announcing connection raises nothing: fall_asleep says wait as usual (the
    poll interval bounds it), and the warning is not repeated while the reason stays."""
    waker = Waker(NOWHERE)
    with caplog.at_level(logging.WARNING, logger="publisher.waker"):
        assert waker.fall_asleep() is False
        assert waker.fall_asleep() is False
    assert not waker.announced
    [warning] = [r.getMessage() for r in caplog.records if r.name == "publisher.waker"]
    assert "cannot announce that this publisher sleeps" in warning
    waker.stop()
