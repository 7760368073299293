"""Retention inside the publisher: ``outbox purge`` at an interval, off the delivery path.

A daemon thread, on a connection of its own, runs one purge every interval
(the first one interval after start). A purge is bounded steps of short
transactions, so it neither delays delivery nor holds long locks; when
several publishers run, the purge lock lets one purge at a time and the
others skip their turn. It stops between two steps when the publisher stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import psycopg

from outbox.retention import DEFAULT_BATCH_SIZE, PurgeBusy, PurgeReport, purge
from publisher.connector import connect

log = logging.getLogger(__name__)


class RetentionRunner:
    """Runs ``outbox.retention.purge`` every ``interval`` seconds until stopped."""

    def __init__(
        self,
        conninfo: str,
        *,
        interval: float,
        delivered_older_than: timedelta,
        evidence_older_than: timedelta,
        batch_size: int = DEFAULT_BATCH_SIZE,
        on_report: Callable[[PurgeReport], None] | None = None,
    ) -> None:
        self._conninfo = conninfo
        self._interval = interval
        self._delivered_older_than = delivered_older_than
        self._evidence_older_than = evidence_older_than
        self._batch_size = batch_size
        self._on_report = on_report
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start purging in a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="outbox-retention", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop after the current step (if a purge is running) and wait for the thread."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def run_once(self) -> PurgeReport | None:
        """One purge now; None when another purge was running or the database failed."""
        try:
            with connect(self._conninfo) as conn:
                report = purge(
                    conn,
                    delivered_older_than=self._delivered_older_than,
                    evidence_older_than=self._evidence_older_than,
                    batch_size=self._batch_size,
                    should_stop=self._stopping.is_set,
                )
        except PurgeBusy:
            log.info("retention: another purge is running; skipping this turn")
            return None
        except psycopg.Error as exc:
            log.warning("retention: purge failed, trying again next interval: %s", exc)
            return None
        if report.messages or report.attempts or report.decisions or report.batches:
            log.info(
                "retention: deleted %d delivered messages, %d attempts, %d decisions, "
                "%d batches in %d transactions",
                report.messages,
                report.attempts,
                report.decisions,
                report.batches,
                report.steps,
            )
        if self._on_report is not None:
            self._on_report(report)
        return report

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):
            self.run_once()
