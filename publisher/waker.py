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

log = logging.getLogger(__name__)

CHANNEL = "outbox_pending"


class Waker:
    """An event set by ``NOTIFY outbox_pending``, by ``wake()``, or never (polling only)."""

    def __init__(self, conninfo: str | None, *, reconnect_delay: float = 1.0) -> None:
        self._conninfo = conninfo
        self._reconnect_delay = reconnect_delay
        self._event = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        #: Set while a LISTEN connection is established (tests wait on it).
        self.listening = threading.Event()

    def start(self) -> None:
        """Start listening in a daemon thread (no-op without a conninfo)."""
        if self._conninfo is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._listen, name="outbox-listener", daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a wake-up; clear it and say whether one came."""
        woke = self._event.wait(timeout)
        self._event.clear()
        return woke

    def wake(self) -> None:
        """Wake the waiting loop now."""
        self._event.set()

    def stop(self) -> None:
        """Stop listening; returns once the listener thread has ended."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _listen(self) -> None:
        assert self._conninfo is not None
        delay = self._reconnect_delay
        while not self._stopping.is_set():
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
                    delay = self._reconnect_delay
                    self._event.set()  # anything committed while we were not listening
                    while not self._stopping.is_set():
                        for _ in conn.notifies(timeout=0.5, stop_after=1):
                            self._event.set()
            except psycopg.Error as exc:
                self.listening.clear()
                if self._stopping.is_set():
                    return
                log.warning("listener connection lost (%s); reconnecting in %.1fs", exc, delay)
                self._stopping.wait(delay)
                delay = min(delay * 2, 30.0)
        self.listening.clear()
