"""Waking the publisher when intents commit.

A trigger on ``outbox.messages`` sends ``NOTIFY outbox_pending`` on commit.
``Waker`` listens on a connection of its own, in a background thread, and
sets an event the publisher loop waits on. The loop also wakes every poll
interval, so a lost notification (or a dropped listener) only delays work.
After the listening connection drops, the waker reconnects with backoff and
wakes the loop once, because notifications sent meanwhile were lost.
"""

from __future__ import annotations

import logging
import threading

import psycopg

from publisher.connector import connect
from publisher.service import BackgroundService

log = logging.getLogger(__name__)

CHANNEL = "outbox_pending"

#: The longest wait between two reconnection attempts.
MAX_RECONNECT_DELAY = 30.0


class Waker(BackgroundService):
    """An event set by ``NOTIFY outbox_pending``, by ``wake()``, or never (polling only).

    Unlike the other services, a turn (``run_once``) is a whole listening
    session: it returns only when stopped, or raises when its connection
    drops; the wait between turns is the reconnection backoff, which doubles
    after each failure up to 30 s and starts again after a connection.
    """

    recoverable = (psycopg.Error,)

    def __init__(self, conninfo: str | None, *, reconnect_delay: float = 1.0) -> None:
        super().__init__(
            name="outbox-listener", interval=reconnect_delay, run_at_start=True, join_timeout=5
        )
        self._conninfo = conninfo
        self._reconnect_delay = reconnect_delay
        #: The backoff after the next failure: doubles with each failure in a row.
        self._delay = reconnect_delay
        #: The wait before the next turn (the backoff of the last failure).
        self._wait = reconnect_delay
        self._event = threading.Event()
        #: Set while a LISTEN connection is established (tests wait on it).
        self.listening = threading.Event()

    def start(self) -> None:
        """Start listening in a daemon thread (no-op without a conninfo)."""
        if self._conninfo is not None:
            super().start()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a wake-up; clear it and say whether one came."""
        woke = self._event.wait(timeout)
        self._event.clear()
        return woke

    def wake(self) -> None:
        """Wake the waiting loop now."""
        self._event.set()

    def run_once(self) -> None:
        """Listen on a new connection, setting the event on each NOTIFY, until stopped."""
        assert self._conninfo is not None
        try:
            with connect(
                self._conninfo,
                autocommit=True,
                application_name="outbox-publisher listener",
                # Notice a silently dead peer within about a minute.
                keepalives=1,
                keepalives_idle=30,
                keepalives_interval=10,
                keepalives_count=3,
            ) as conn:
                conn.execute(f"LISTEN {CHANNEL}")
                self.listening.set()
                self._delay = self._reconnect_delay
                self._event.set()  # anything committed while we were not listening
                while not self.stopping:
                    for _ in conn.notifies(timeout=0.5, stop_after=1):
                        self._event.set()
        finally:
            self.listening.clear()

    def _wait_seconds(self) -> float:
        return self._wait

    def _failed(self, exc: Exception) -> None:
        if self.stopping:
            return  # the connection was closed under us on the way out
        self._wait, self._delay = self._delay, min(self._delay * 2, MAX_RECONNECT_DELAY)
        log.warning("listener connection lost (%s); reconnecting in %.1fs", exc, self._wait)
