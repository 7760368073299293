"""Helpers for a service's own tests that need the publisher (the publisher extra).

``publish_until_idle`` runs a real publisher in the test's process, built by
the composition root as ``outbox-publisher`` builds it, against the test's
database and broker, until nothing is left to deliver; it returns what the
publisher did::

    outbox.enqueue(conn, "orders", {"id": 1}); conn.commit()
    totals = publish_until_idle(database_url, "127.0.0.1:9092")
    assert totals.delivered == 1

The settings are the publisher's (``PublisherConfig`` fields, checked as a
config file's are), with a short poll interval, and no absence grace: a
test's broker is one local process, so nothing is ever written above its
high watermark. On a cluster of several brokers keep the default grace
(pass ``absence_grace=...``). A publisher that is not idle within
``timeout`` seconds (the database or the broker cannot be reached, or
messages keep failing) is stopped, and ``PublishTimeout`` says why.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from outbox.errors import OutboxError
from outbox.status import StatusLine, read_status
from publisher.app import build_publisher
from publisher.config import PublisherConfig, config_from_values
from publisher.connector import connect
from publisher.loop import Publisher, Totals

__all__ = ["PublishTimeout", "config_for_tests", "publish_until_idle"]

#: Seconds ``publish_until_idle`` gives a publisher to deliver everything, by default.
DEFAULT_TIMEOUT = 60.0


class PublishTimeout(OutboxError, TimeoutError):
    """``publish_until_idle``'s publisher still had work when its time ran out."""

    def __init__(self, message: str, totals: Totals) -> None:
        super().__init__(message)
        #: What the publisher did before it was stopped.
        self.totals = totals


def config_for_tests(database_url: str, kafka_bootstrap: str, **settings: Any) -> PublisherConfig:
    """A publisher config for tests: exits when idle, polls often, no absence grace.

    Raises ``ConfigError`` naming every unknown setting, value of the wrong
    type and invalid value, as ``outbox-publisher`` does for its flags.
    """
    return config_from_values(
        {
            "exit_when_idle": True,
            "poll_interval": 0.2,
            "absence_grace": 0.0,
            **settings,
            "database_url": database_url,
            "kafka_bootstrap": kafka_bootstrap,
        }
    )


def publish_until_idle(
    database_url: str,
    kafka_bootstrap: str,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    **settings: Any,
) -> Totals:
    """Run a publisher in this process until nothing is left to deliver; its totals.

    Stopped after ``timeout`` seconds (``None``: never) if it is not idle by
    then (the batch in hand is settled first, as on SIGTERM), and
    ``PublishTimeout`` is raised.
    """
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be positive or None, got {timeout!r}")
    publisher = build_publisher(config_for_tests(database_url, kafka_bootstrap, **settings))
    timer = threading.Timer(timeout or 0, publisher.request_stop)
    timer.daemon = True
    if timeout is not None:
        timer.start()
    try:
        totals = publisher.run()
    finally:
        timer.cancel()
    # Idle is what was asked for, even if the timer fired as the loop was ending.
    if not publisher.ended_idle:
        raise PublishTimeout(
            f"publish_until_idle: the publisher was not idle after {timeout or 0:g} s "
            f"({_why(publisher, database_url)}; {totals.delivered} delivered, "
            f"{totals.retried} retried); its log says more",
            totals,
        )
    return totals


def _why(publisher: Publisher, database_url: str) -> str:
    """What kept the publisher from going idle: a dependency it could not reach, or
    the messages still open, by state, with the status view's next action."""
    health = publisher.health
    for contact in (health.database, health.kafka):
        problem = contact.problem()
        if problem is not None and contact.ok is False:
            kind = f" ({contact.error_type})" if contact.error_type else ""
            return f"{contact.name} unavailable{kind}"
    if not publisher.started:
        return "the database never answered"
    try:
        with connect(database_url, connect_timeout=5) as conn:
            lines = read_status(conn)
    except psycopg.Error:
        return "messages were still left to deliver"
    return _left(lines)


#: The states that keep a publisher from going idle, the likeliest cause first.
_UNFINISHED = ("uncertain", "in_flight", "pending")


def _left(lines: list[StatusLine]) -> str:
    """The messages still to deliver, by state, and the status view's next action for
    the first of them (uncertain ones wait for their write deadline and grace).
    Escalated uncertain messages are left out: they wait for an operator, not for
    this publisher, which does not wait for them either."""
    left = []
    for state in _UNFINISHED:
        line = next((x for x in lines if x.topic is None and x.state == state), None)
        count = 0 if line is None else line.messages - line.escalated
        if line is not None and count > 0:
            left.append((count, line))
    if not left:
        return "messages were still left to deliver"
    counts = ", ".join(f"{count} {line.state}" for count, line in left)
    first = left[0][1]
    return f"left: {counts}; outbox.status says for {first.state}: {first.next_action}"
