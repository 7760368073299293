"""Waking the publisher when intents commit, and only while it sleeps.

A trigger on ``outbox.messages`` sends ``NOTIFY outbox_pending`` from a
committing transaction, but only while a publisher is asleep: PostgreSQL
serialises the commits of transactions that notified (each holds one
cluster-wide lock from its pre-commit until its commit record is flushed),
and a busy publisher needs no notification. ``Waker`` listens on a
connection of its own, in a background thread, and sets an event the
publisher loop waits on; and, on a second connection, it announces that its
publisher sleeps, before it sleeps, by holding ``outbox.wakeup`` in SHARE
mode until a claim finds work again (``announce_sleep`` in
outbox/queries.sql).

The announcement waits for the writers that are committing without a
notification, so the loop claims once more after it (``fall_asleep``
returns True) and then sleeps: nothing committed before the announcement is
missed, and everything committed after it notifies. The loop also wakes
every poll interval, so a lost notification (a dropped listener, or an
announcement that died with its connection) only delays work. After the
listening connection drops, the waker reconnects with backoff and wakes the
loop once, because notifications sent meanwhile were lost.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
import psycopg.errors

from outbox.queries import query
from publisher.connector import connect, limit_idle_transactions
from publisher.service import BackgroundService

log = logging.getLogger(__name__)

#: The longest wait between two reconnection attempts.
MAX_RECONNECT_DELAY = 30.0


class Waker(BackgroundService):
    """An event set by ``NOTIFY outbox_pending``, by ``wake()``, or never (polling only).

    Unlike the other services, a turn (``run_once``) is a whole listening
    session: it returns only when stopped, or raises when its connection
    drops; the wait between turns is the reconnection backoff, which doubles
    after each failure up to 30 s and starts again after a connection.

    ``fall_asleep``, ``wait`` and ``awake`` belong to the loop's thread: they
    use the announcing connection, which the listening thread never touches.
    """

    recoverable = (psycopg.Error,)

    def __init__(
        self,
        conninfo: str | None,
        *,
        reconnect_delay: float = 1.0,
        idle_transaction_limit: float | None = None,
    ) -> None:
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
        #: The connection whose transaction announces the sleep; opened on first use.
        self._announcer: psycopg.Connection[Any] | None = None
        #: Whether this publisher is announced asleep (its announcer holds outbox.wakeup).
        self.announced = False
        #: When the announcement was made (``time.monotonic()``).
        self._announced_at = 0.0
        #: The last reason the announcement failed, logged once until it succeeds again.
        self._refused: str | None = None
        #: Seconds the announcement's transaction may stay idle before the server ends
        #: its session (None: no limit). It lasts about a poll interval; one that lasts
        #: far longer belongs to a process stopped while asleep (SIGSTOP, a paused host),
        #: whose lock would make every writer's commit notify for as long as it stays so.
        self._idle_transaction_limit = idle_transaction_limit

    def start(self) -> None:
        """Start listening in a daemon thread (no-op without a conninfo)."""
        if self._conninfo is not None:
            super().start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop listening, and end the announcement (its connection is closed)."""
        super().stop(timeout)
        if self._announcer is not None:
            self._announcer.close()
            self._announcer = None
        self.announced = False

    def fall_asleep(self) -> bool:
        """Announce that the publisher sleeps, for commits to notify it from now on.

        The loop calls this when a claim found nothing, before it waits.
        True: announced now; claim once more before waiting, since every
        commit that did not notify is visible by now. Also True when writers
        held the announcement up past its lock timeout (they were committing:
        there is work). False: announced already, or cannot be (polling
        only; the database refused it, which is logged): wait as usual, the
        poll interval bounding what does not notify.
        """
        if self._conninfo is None or self.announced:
            return False
        try:
            if self._announcer is None or self._announcer.closed:
                self._announcer = connect(
                    self._conninfo, application_name="outbox-publisher wakeup"
                )
                if self._idle_transaction_limit is not None:
                    limit_idle_transactions(self._announcer, self._idle_transaction_limit)
            self._announcer.execute(query("announce_sleep"))
        except psycopg.errors.LockNotAvailable:
            self._end_transaction()
            log.debug("writers held the sleep announcement up; claiming again")
            return True
        except psycopg.OperationalError as exc:
            if self._announcer is not None:
                self._announcer.close()
            self._refuse(exc, "")
            return False
        except psycopg.Error as exc:  # no outbox.wakeup (an older schema), or no grant on it
            self._end_transaction()
            self._refuse(
                exc, " (outbox migrate --create-roles brings schema and grants up to date)"
            )
            return False
        self.announced = True
        self._announced_at = time.monotonic()
        if self._refused is not None:
            log.info("announcing sleep again: commits wake this publisher")
            self._refused = None
        return True

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a wake-up; clear it and say whether one came.

        A wake-up leaves the sleep announced, so that the claim it leads to
        comes at once; the loop ends the announcement if that claim finds work
        (``awake``). A wait that runs out ends it, and so does any wait once
        the announcement is older than ``timeout``: each announcement's
        transaction lasts about one poll interval at most, then the next sleep
        announces anew.
        """
        woke = self._event.wait(timeout)
        self._event.clear()
        if not woke or time.monotonic() - self._announced_at >= timeout:
            self.awake()
        return woke

    def awake(self) -> None:
        """The publisher is busy (a claim found work): end its sleep's announcement."""
        if self.announced:
            self.announced = False
            self._end_transaction()

    def wake(self) -> None:
        """Wake the waiting loop now."""
        self._event.set()

    def _end_transaction(self) -> None:
        """Roll the announcer's transaction back (releasing outbox.wakeup); a broken
        connection is closed, to be opened again at the next announcement."""
        if self._announcer is None or self._announcer.closed:
            return
        try:
            self._announcer.rollback()
        except psycopg.Error as exc:
            log.debug("closing the announcing connection: %s", exc)
            self._announcer.close()

    def _refuse(self, exc: psycopg.Error, hint: str) -> None:
        """Log why the sleep could not be announced, once while the reason stays the same."""
        reason = f"{type(exc).__name__}: {str(exc).strip()}"
        if reason != self._refused:
            self._refused = reason
            log.warning(
                "cannot announce that this publisher sleeps (%s): commits may not wake it, "
                "and it claims every poll interval until it can%s",
                reason,
                hint,
            )

    def run_once(self) -> None:
        """Listen on a new connection, setting the event on each NOTIFY, until stopped."""
        assert self._conninfo is not None
        try:
            with connect(
                self._conninfo,
                autocommit=True,
                application_name="outbox-publisher listener",
            ) as conn:
                conn.execute(query("listen"))
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
