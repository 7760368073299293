"""Retention inside the publisher: ``outbox purge`` at an interval, off the delivery path.

A daemon thread, on a connection of its own, runs one purge every interval
(the first one interval after start). A purge is bounded steps of short
transactions, so it neither delays delivery nor holds long locks; when
several publishers run, the purge lock lets one purge at a time and the
others skip their turn. It stops between two steps when the publisher stops.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import psycopg

from outbox.retention import DEFAULT_BATCH_SIZE, PurgeBusy, PurgeReport, purge
from publisher.connector import connect
from publisher.service import BackgroundService

log = logging.getLogger(__name__)


class RetentionRunner(BackgroundService):
    """Runs ``outbox.retention.purge`` every ``interval`` seconds until stopped.

    ``stop()`` waits up to 30 s: the purge in progress ends after its step.
    """

    def __init__(
        self,
        conninfo: str,
        *,
        interval: float,
        delivered_older_than: timedelta,
        evidence_older_than: timedelta | None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        on_report: Callable[[PurgeReport], None] | None = None,
    ) -> None:
        super().__init__(name="outbox-retention", interval=interval, join_timeout=30)
        self._conninfo = conninfo
        self._delivered_older_than = delivered_older_than
        self._evidence_older_than = evidence_older_than
        self._batch_size = batch_size
        self._on_report = on_report

    def run_once(self) -> PurgeReport | None:
        """One purge now; None when another purge was running or the database failed."""
        began = time.monotonic()
        try:
            with connect(self._conninfo) as conn:
                report = purge(
                    conn,
                    delivered_older_than=self._delivered_older_than,
                    evidence_older_than=self._evidence_older_than,
                    batch_size=self._batch_size,
                    should_stop=lambda: self.stopping,
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
                "%d batches in %d transactions, %.1f s",
                report.messages,
                report.attempts,
                report.decisions,
                report.batches,
                report.steps,
                time.monotonic() - began,
            )
        if self._on_report is not None:
            self._on_report(report)
        return report
