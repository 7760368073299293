"""A publisher whose database is not there yet waits for it, and says so once, not per try.

A sidecar often starts before its database can let it in (the database is
created or migrated by another job, a password is rotated in). It tries
again every poll interval until it can register; its log says the outage
once, then only what changes and a reminder a minute, and when it is over.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

from publisher.app import build_publisher
from tests.conftest import Services
from tests.support import publisher_config, wait_until


@pytest.fixture
def late_database(services: Services) -> Iterator[tuple[str, str]]:
    """The name and URL of a database that does not exist yet (dropped afterwards)."""
    name = f"outbox_late_{uuid.uuid4().hex[:12]}"
    yield name, urlsplit(services.database_url)._replace(path=f"/{name}").geturl()
    with _server(services) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def _server(services: Services) -> psycopg.Connection[tuple[object, ...]]:
    url = urlsplit(services.database_url)._replace(path="/postgres").geturl()
    return psycopg.connect(url, autocommit=True)


def test_a_publisher_waits_for_a_database_that_does_not_exist_yet_and_logs_it_once(
    services: Services,
    template_database: str,
    late_database: tuple[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Many tries, one line; the database created (migrated), the publisher registers and
    says the outage is over."""
    name, url = late_database
    caplog.set_level(logging.INFO, logger="publisher.loop")
    publisher = build_publisher(
        publisher_config(url, services.kafka_bootstrap, exit_when_idle=False, poll_interval=0.02)
    )
    thread = threading.Thread(target=publisher.run, daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: publisher.database_away_at_start.tries >= 10,
            timeout=30,
            what="ten tries to reach the database",
        )
        said = [r for r in caplog.records if "database unavailable at start" in r.getMessage()]
        assert len(said) == 1
        assert said[0].levelname == "WARNING"
        assert f'database "{name}" does not exist' in said[0].getMessage()
        assert not publisher.started

        with _server(services) as admin:
            admin.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(template_database)
                )
            )
        wait_until(lambda: publisher.started, timeout=30, what="the publisher to register")
        over = [r.getMessage() for r in caplog.records if "over after" in r.getMessage()]
        assert len(over) == 1
        assert over[0].startswith("database unavailable at start: over after")
    finally:
        publisher.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive()
