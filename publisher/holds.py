"""The hold pass beside the loop: messages held behind a stuck one, marked and released.

A daemon thread runs one pass every ``--recovery-interval`` (the loop runs
the first one itself, at start, once the publisher has its lanes): it marks
held the pending messages of this publisher's lanes that wait behind an
uncertain or quarantined message of their key, then releases held messages
whose key has nothing stuck before them any more (``outbox.holds``). Off the
delivery path: marking the queue behind a busy stuck key writes up to 50,000
rows per key and pass, which the loop would otherwise wait for between two
batches. The pass opens a connection for its turn and closes it after.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import psycopg

from publisher.service import BackgroundService
from publisher.store import PublisherStore

log = logging.getLogger(__name__)


class HoldRunner(BackgroundService):
    """Runs ``PublisherStore.hold_and_release`` every ``interval`` seconds until stopped."""

    recoverable = (psycopg.Error,)

    def __init__(
        self,
        store: PublisherStore,
        *,
        interval: float,
        on_pass: Callable[[int, int], None] | None = None,
    ) -> None:
        super().__init__(name="outbox-holds", interval=interval, join_timeout=30)
        self._store = store
        self._on_pass = on_pass

    def run_once(self) -> tuple[int, int]:
        """One pass now; how many messages it marked held and how many it released."""
        try:
            held, released = self._store.hold_and_release()
        finally:
            self._store.close()
        if held or released:
            log.info(
                "held %d messages behind an uncertain or quarantined message of their key; "
                "released %d",
                held,
                released,
            )
        if self._on_pass is not None:
            self._on_pass(held, released)
        return held, released
