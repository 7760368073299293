"""Helpers for a service's own tests: what did this code enqueue?

``EnqueueRecorder`` notes where the outbox stands when it starts; afterwards
``enqueued()`` returns every intent written since, in the order written, as
plain values to assert on::

    recorder = EnqueueRecorder(database_url)
    client.post("/orders", json={"item": "book"})      # the code under test
    [event] = recorder.enqueued(topic="orders")
    assert event.json() == {"order_id": 1, "item": "book"}

It reads committed intents on a connection of its own; pass ``conn=`` to
read through the caller's connection instead, which also sees what that
connection's open transaction has enqueued so far. It is for tests: it
tells intents apart by their sequence number, so an intent that a
concurrent transaction wrote before the recorder started but committed
after it would count as recorded.

As a pytest plugin (``pytest_plugins = ["outbox.testing"]`` in a
``conftest.py``) it adds the fixture ``outbox_recorder``, a recorder started
at the beginning of the test; it reads the database URL from a fixture the
project defines, ``outbox_database_url``.

Running a publisher in the test's process until nothing is left to deliver
is ``publisher.testing.publish_until_idle`` (it needs the publisher extra).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

from outbox.connection import Executor, PsycopgExecutor, Purpose, as_uuid, executor_for
from outbox.queries import query
from outbox.redaction import check_conninfo, connect_errors_redacted

__all__ = ["EnqueueRecorder", "Enqueued", "outbox_recorder"]

#: Reading through a caller's connection: any open transaction (or none) that has not failed.
_READ = Purpose(
    doing="reading",
    autocommit=None,
    sync_hint="",
    async_hint=(
        "enqueued() reads synchronously: pass a synchronous connection, or no conn= to read "
        "the committed intents on a connection of the recorder's own"
    ),
)


@dataclass(frozen=True, slots=True)
class Enqueued:
    """One intent as written: what the publisher will send."""

    id: uuid.UUID
    topic: str
    key: bytes | None
    value: bytes
    #: The headers, in order, as (name, value) pairs.
    headers: tuple[tuple[str, bytes], ...]
    idempotency_key: str | None

    def json(self) -> Any:
        """The value decoded as JSON (a value given as a dict or list was sent as JSON)."""
        return json.loads(self.value)

    def header(self, name: str) -> bytes | None:
        """The value of the first header called ``name``, or ``None``."""
        return next((v for n, v in self.headers if n == name), None)


class EnqueueRecorder:
    """The intents written since it was created (or since ``restart``).

    ``database_url`` is libpq's (``postgresql://...``); a URL it cannot read
    is refused here, with no piece of its password in the error.
    """

    def __init__(self, database_url: str) -> None:
        check_conninfo(database_url)
        self._database_url = database_url
        self._after = 0
        self.restart()

    def restart(self) -> None:
        """Forget what was recorded: ``enqueued()`` returns only what is written next."""
        with self._connect() as conn:
            row = conn.execute(query("last_seq")).fetchone()
        self._after = int(row[0]) if row else 0

    def enqueued(self, *, topic: str | None = None, conn: object = None) -> list[Enqueued]:
        """Every intent written since the start, in order; only ``topic``'s if given.

        Read on a connection of its own (committed intents), or through
        ``conn`` (a psycopg ``Connection`` or a SQLAlchemy ``Session`` or
        ``Connection``, whatever its row factory, cursor factory or loaders),
        which sees its own open transaction's intents too. That read is a statement
        on ``conn``: with no transaction open it begins one, as any statement does
        (unless ``conn`` is in autocommit mode), which its owner ends.
        """
        if conn is not None:
            return self._read(executor_for(conn, _READ), topic)
        with self._connect() as own:
            return self._read(PsycopgExecutor(own), topic)

    @contextmanager
    def _connect(self) -> Iterator[psycopg.Connection[Any]]:
        with connect_errors_redacted(self._database_url):
            conn = psycopg.connect(self._database_url)
        with conn:
            yield conn

    def _read(self, executor: Executor, topic: str | None) -> list[Enqueued]:
        rows = executor.fetchall(query("enqueued_since"), {"after": self._after})
        intents = [
            Enqueued(
                id=as_uuid(row[0]),
                topic=row[1],
                key=bytes(row[2]) if row[2] is not None else None,
                value=bytes(row[3]),
                headers=tuple(
                    (name, bytes(value)) for name, value in zip(row[4], row[5], strict=True)
                ),
                idempotency_key=row[6],
            )
            for row in rows
        ]
        return [i for i in intents if topic is None or i.topic == topic]


try:
    import pytest
except ImportError:  # pragma: no cover - the plugin is only loaded by pytest
    pass
else:

    @pytest.fixture
    def outbox_recorder(outbox_database_url: str) -> EnqueueRecorder:
        """A recorder started when the test begins (needs a fixture ``outbox_database_url``)."""
        return EnqueueRecorder(outbox_database_url)
