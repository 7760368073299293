"""One small base for the publisher's background threads.

The heartbeat, the NOTIFY listener, retention, the hold pass, the Kafka
probe and the HTTP endpoints each run beside the loop in a daemon thread of
their own, so that none of them waits for a batch and a stuck loop holds up
none of them. They share one shape, after River's services: ``run_once`` is
one turn of the work, which tests call directly; ``start`` runs turns in the
thread, an interval apart, waiting on a stop event; ``stop`` sets the event,
so a waiting thread ends at once, and joins it.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import ClassVar

from publisher.logs import Outage

log = logging.getLogger(__name__)

#: What a service's failures that have lasted a minute tell the operator to check.
_SERVICE_HINT = (
    "The publisher goes on and tries again; check what the error names (the database, "
    "the brokers), and this publisher's /readyz"
)


class BackgroundService(ABC):
    """Calls ``run_once`` in a daemon thread every ``interval`` seconds until ``stop()``.

    The first turn comes one interval after ``start()``, or at once with
    ``run_at_start``. An error a turn raises that is one of ``recoverable``
    goes to ``_failed`` and the next turn comes as usual; any other error
    ends the thread, as a bug should: it is logged with its traceback, kept
    in ``died`` (the publisher's readiness and liveness fail on it), and
    ``threading.excepthook`` reports it too. A stopped service does not start
    again. Failures are logged as an outage (``publisher.logs.Outage``): once,
    then what changes and a reminder a minute, an ERROR after a minute, and
    a line when a turn succeeds again.
    """

    #: Errors of a turn that the service outlives (a dropped connection, say).
    recoverable: ClassVar[tuple[type[Exception], ...]] = ()

    def __init__(
        self,
        *,
        name: str,
        interval: float,
        run_at_start: bool = False,
        join_timeout: float = 10.0,
        failure: str | None = None,
    ) -> None:
        #: The thread's name, as logs and thread dumps show it.
        self.name = name
        #: Seconds between the end of one turn and the start of the next.
        self.interval = interval
        self._run_at_start = run_at_start
        #: How long ``stop()`` waits for a turn in progress, by default.
        self.join_timeout = join_timeout
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        #: The error that ended the thread, if one did.
        self.died: BaseException | None = None
        #: The log lines of its turns failing (``failure``: what they say failed).
        self.outage = Outage(log, failure or f"{name} failed", hint=_SERVICE_HINT)

    @abstractmethod
    def run_once(self) -> object:
        """One turn of the work, in the caller's thread."""

    @property
    def stopping(self) -> bool:
        """Whether ``stop()`` was called: a long turn checks it to end early."""
        return self._stop_event.is_set()

    @property
    def running(self) -> bool:
        """Whether the service's thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread; a second call, or a call after ``stop()``, does nothing."""
        if self._thread is None and not self._stop_event.is_set():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop, waking a waiting thread, and wait up to ``timeout`` s for a turn in progress.

        ``timeout`` defaults to ``join_timeout``. Stopping twice, or a service
        never started, is harmless.
        """
        self._stop_event.set()
        # The thread is kept: while a turn outlives the timeout, ``running`` says so.
        if self._thread is not None:
            self._thread.join(self.join_timeout if timeout is None else timeout)

    def _wait_seconds(self) -> float:
        """How long to wait before the next turn; ``interval`` unless a service backs off."""
        return self.interval

    def _failed(self, exc: Exception) -> None:
        """A turn raised a ``recoverable`` error; the next turn comes after the usual wait."""
        self.outage.failed(exc)

    def _run(self) -> None:
        if self._run_at_start and not self._stop_event.is_set():
            self._turn()
        while not self._stop_event.wait(self._wait_seconds()):
            self._turn()

    def _turn(self) -> None:
        try:
            self.run_once()
        except self.recoverable as exc:
            self._failed(exc)
        except Exception as exc:
            self.died = exc
            log.exception("%s ended by an unexpected error", self.name)
            raise
        else:
            self.outage.ended()
