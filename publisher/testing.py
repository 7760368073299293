"""Helpers for a service's own tests that need the publisher (the publisher extra).

``publish_until_idle`` runs a real publisher in the test's process, built by
the composition root as ``outbox-publisher`` builds it, against the test's
database and broker, until nothing is left to deliver; it returns what the
publisher did::

    outbox.enqueue(conn, "orders", {"id": 1}); conn.commit()
    totals = publish_until_idle(database_url, "127.0.0.1:9092")
    assert totals.delivered == 1

The settings are the publisher's (``PublisherConfig`` fields), with a short
poll interval, and no absence grace: a test's broker is one local process,
so nothing is ever written above its high watermark. On a cluster of
several brokers keep the default grace (pass ``absence_grace=...``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from publisher.app import build_publisher
from publisher.config import PublisherConfig
from publisher.loop import Totals

__all__ = ["config_for_tests", "publish_until_idle"]


def config_for_tests(database_url: str, kafka_bootstrap: str, **settings: Any) -> PublisherConfig:
    """A publisher config for tests: exits when idle, polls often, no absence grace."""
    base = PublisherConfig(
        database_url=database_url,
        kafka_bootstrap=kafka_bootstrap,
        exit_when_idle=True,
        poll_interval=0.2,
        absence_grace=0.0,
    )
    return replace(base, **settings)


def publish_until_idle(database_url: str, kafka_bootstrap: str, **settings: Any) -> Totals:
    """Run a publisher in this process until nothing is left to deliver; its totals."""
    return build_publisher(config_for_tests(database_url, kafka_bootstrap, **settings)).run()
