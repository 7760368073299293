"""Fixtures shared by all tests.

Integration and acceptance tests need a real PostgreSQL and a real Apache
Kafka. They are found, in this order, from the environment variables
``OUTBOX_DATABASE_URL`` and ``OUTBOX_KAFKA_BOOTSTRAP``, from the
``.services.env`` file that ``make services`` writes, or from testcontainers
where a Docker engine answers. Unit tests need none of them.

Each test that asks for ``database_url`` gets a database of its own, copied
from a migrated template; each test that asks for ``topic`` gets a new topic.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

from outbox.migrations import migrate
from tests.secure_kafka import SecureKafka
from tests.support import create_topic

ROOT = Path(__file__).resolve().parent.parent

#: The helpers the library offers a service's tests (the fixture
#: ``outbox_recorder``), used here as a service uses them.
pytest_plugins = ["outbox.testing"]


@dataclass(frozen=True)
class Services:
    """Where the real PostgreSQL and Kafka of this test run are."""

    database_url: str
    kafka_bootstrap: str


def _from_services_env() -> dict[str, str]:
    path = ROOT / ".services.env"
    if not path.exists():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"export (\w+)=(.*)", line.strip())
        if match:
            found[match[1]] = match[2].strip("'\"")
    return found


def _docker_answers() -> bool:
    try:
        import docker  # type: ignore[import-untyped]  # noqa: PLC0415 - only with Docker

        docker.from_env().ping()
    except Exception:  # noqa: BLE001 - any failure means: no engine to use
        return False
    return True


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    """The real services, or a failure that says how to start them."""
    env = {**_from_services_env(), **os.environ}
    url, bootstrap = env.get("OUTBOX_DATABASE_URL"), env.get("OUTBOX_KAFKA_BOOTSTRAP")
    if url and bootstrap:
        yield Services(url, bootstrap)
        return
    if _docker_answers():
        from testcontainers.community.kafka import KafkaContainer  # noqa: PLC0415
        from testcontainers.community.postgres import PostgresContainer  # noqa: PLC0415

        with (
            PostgresContainer("postgres:15", driver=None) as pg,
            KafkaContainer("confluentinc/cp-kafka:7.6.0").with_kraft() as kafka,
        ):
            yield Services(pg.get_connection_url(), kafka.get_bootstrap_server())
        return
    pytest.fail(
        "no PostgreSQL/Kafka for integration tests: run `make services` "
        "(or set OUTBOX_DATABASE_URL and OUTBOX_KAFKA_BOOTSTRAP)"
    )


def _with_database(url: str, name: str) -> str:
    """The same server URL, naming another database."""
    return urlsplit(url)._replace(path=f"/{name}").geturl()


def _admin(services: Services) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(_with_database(services.database_url, "postgres"), autocommit=True)


@pytest.fixture(scope="session")
def template_database(services: Services) -> Iterator[str]:
    """A migrated database that every test database is copied from."""
    name = f"outbox_template_{os.getpid()}"
    with _admin(services) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    migrate(_with_database(services.database_url, name))
    yield name
    with _admin(services) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def empty_database_url(services: Services) -> Iterator[str]:
    """A fresh database with no outbox tables."""
    name = f"outbox_test_{uuid.uuid4().hex[:12]}"
    with _admin(services) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield _with_database(services.database_url, name)
    with _admin(services) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def database_url(services: Services, template_database: str) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    name = f"outbox_test_{uuid.uuid4().hex[:12]}"
    with _admin(services) as admin:
        admin.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template_database)
            )
        )
    yield _with_database(services.database_url, name)
    with _admin(services) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def outbox_database_url(database_url: str) -> str:
    """The database ``outbox.testing``'s fixture reads: the test's own."""
    return database_url


@pytest.fixture(scope="session")
def secure_kafka(services: Services) -> SecureKafka:
    """The broker's SASL_SSL listener (SCRAM, TLS with a test CA) that ``services/up`` starts.

    Skipped when the services run without one (``OUTBOX_KAFKA_SASL_PORT=0``,
    external services that name none, or a data directory formatted before
    the listener existed: ``services/up`` says so).
    """
    found = SecureKafka.from_env({**_from_services_env(), **os.environ})
    if found is None:
        pytest.skip("the services have no SASL_SSL listener (OUTBOX_SECURE_KAFKA_* unset)")
    return found


@pytest.fixture
def kafka_bootstrap(services: Services) -> str:
    """Bootstrap servers of the real Kafka."""
    return services.kafka_bootstrap


@pytest.fixture
def topic(kafka_bootstrap: str) -> str:
    """A new topic with three partitions, for one test."""
    name = f"outbox-test-{uuid.uuid4().hex[:12]}"
    create_topic(kafka_bootstrap, name, partitions=3)
    return name
