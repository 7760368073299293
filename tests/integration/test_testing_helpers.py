"""The helpers a service's own tests use: what was enqueued, and a publisher run in-process.

The first test is the example ``docs/embedding.md`` shows: code that writes an
order and its event, checked for exactly the events it enqueued, then
delivered by a publisher running in the test's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import psycopg.types.string
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from outbox.errors import ConnectionNotSupported
from outbox.redaction import DatabaseURLError
from outbox.testing import EnqueueRecorder
from publisher.config import ConfigError
from publisher.testing import PublishTimeout, publish_until_idle
from tests.support import assert_excerpt_of_file, fetch_rows, make_uncertain, read_topic

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def place_order(conn: psycopg.Connection[tuple[object, ...]], topic: str, item: str) -> int:
    """The code under test: an order row and its event, in the caller's transaction."""
    conn.execute("CREATE TABLE IF NOT EXISTS orders (id serial PRIMARY KEY, item text)")
    row = conn.execute("INSERT INTO orders (item) VALUES (%s) RETURNING id", (item,)).fetchone()
    assert row is not None
    order_id = int(str(row[0]))
    outbox.enqueue(conn, topic, {"order_id": order_id, "item": item}, key=str(order_id))
    return order_id


def test_a_request_enqueued_exactly_these_events_and_they_are_delivered(
    outbox_recorder: EnqueueRecorder, database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """The recorder sees the one event of the committed request, and nothing else; a
    publisher run in the test's process delivers it."""
    with psycopg.connect(database_url) as conn:
        order_id = place_order(conn, topic, "book")

    [event] = outbox_recorder.enqueued()
    assert event.topic == topic
    assert event.key == str(order_id).encode()
    assert event.json() == {"order_id": order_id, "item": "book"}
    assert event.header("content-type") == b"application/json"

    totals = publish_until_idle(database_url, kafka_bootstrap)
    assert totals.delivered == 1
    [record] = read_topic(kafka_bootstrap, topic)
    assert record.outbox_id == event.id


def test_what_was_enqueued_before_the_recorder_started_or_rolled_back_is_not_recorded(
    database_url: str,
) -> None:
    """Only intents written after the start and committed (or, through ``conn``, the
    connection's own open transaction) are recorded, in the order written."""
    with psycopg.connect(database_url) as conn:
        outbox.enqueue(conn, "orders", "before")
    recorder = EnqueueRecorder(database_url)
    with psycopg.connect(database_url) as conn:
        outbox.enqueue(conn, "orders", "rolled back")
        conn.rollback()
        outbox.enqueue(conn, "orders", "first")
        outbox.enqueue(conn, "payments", "second")
        # Not committed yet: only the connection that wrote them sees them.
        assert recorder.enqueued() == []
        assert [e.value for e in recorder.enqueued(conn=conn)] == [b"first", b"second"]
    assert [e.value for e in recorder.enqueued()] == [b"first", b"second"]
    assert [e.value for e in recorder.enqueued(topic="payments")] == [b"second"]
    recorder.restart()
    assert recorder.enqueued() == []


def test_the_docs_show_this_file_and_the_conftest_verbatim() -> None:
    """Each excerpt of the doc's "Test helpers" section is a part of the file it names."""
    doc = (ROOT / "docs" / "embedding.md").read_text(encoding="utf-8")
    section = doc.split("\n## Test helpers\n", 1)[1].split("\n## ", 1)[0]
    excerpts = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(excerpts) == 2
    for code in excerpts:
        assert_excerpt_of_file(code, ROOT)


def _reads_uuid_as_text(conn: psycopg.Connection[Any]) -> None:
    conn.adapters.register_loader("uuid", psycopg.types.string.TextLoader)


@pytest.mark.parametrize(
    "kind", ["sqlalchemy-session", "sqlalchemy-connection", "raw-cursor", "uuid-as-text"]
)
def test_the_recorder_reads_through_any_connection_enqueue_accepts(
    database_url: str, kind: str
) -> None:
    """``enqueued(conn=...)`` reads through a SQLAlchemy Session or Connection, and a
    psycopg connection whatever its cursor factory or loaders, as ``enqueue`` writes:
    the connection's own open transaction's intents, with their ids as UUIDs."""
    recorder = EnqueueRecorder(database_url)
    engine = sa.create_engine(database_url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with contextlib.ExitStack() as stack:
            conn: Any
            if kind == "sqlalchemy-session":
                conn = stack.enter_context(Session(engine))
            elif kind == "sqlalchemy-connection":
                conn = stack.enter_context(engine.connect())
            else:
                factory = psycopg.RawCursor if kind == "raw-cursor" else psycopg.Cursor
                conn = stack.enter_context(psycopg.connect(database_url, cursor_factory=factory))
                if kind == "uuid-as-text":
                    _reads_uuid_as_text(conn)
            message_id = outbox.enqueue(conn, "orders", b"uncommitted")
            [event] = recorder.enqueued(conn=conn)
            assert (event.id, event.value) == (message_id, b"uncommitted")
            assert isinstance(event.id, uuid.UUID)
    finally:
        engine.dispose()


def test_the_recorder_refuses_an_async_connection_and_a_sqlalchemy_url(
    database_url: str,
) -> None:
    """An async connection is named, with the way out; so is a SQLAlchemy URL, with no
    piece of its password in the error."""
    recorder = EnqueueRecorder(database_url)

    async def read_through_async() -> None:
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            recorder.enqueued(conn=conn)

    with pytest.raises(ConnectionNotSupported, match="reads synchronously"):
        asyncio.run(read_through_async())
    url = database_url.replace("postgresql://", "postgresql+psycopg://")
    with_password = url.replace("postgres@", "postgres:s3cret-pw@", 1)
    with pytest.raises(DatabaseURLError, match=r"names a SQLAlchemy driver") as refused:
        EnqueueRecorder(with_password)
    assert "s3cret" not in str(refused.value)


def test_publish_until_idle_stops_and_says_why_when_it_cannot_finish(
    database_url: str, topic: str
) -> None:
    """A broker that cannot be reached (or a database) would keep the publisher
    retrying for ever: after ``timeout`` it is stopped and PublishTimeout names what was
    unavailable. Nothing was delivered, so the message is still to deliver."""
    with psycopg.connect(database_url) as conn:
        outbox.enqueue(conn, topic, b"x")
    started = time.monotonic()
    with pytest.raises(PublishTimeout, match=r"not idle after 4 s \(kafka unavailable"):
        publish_until_idle(database_url, "127.0.0.1:1", timeout=4, max_block_ms=500)
    assert time.monotonic() - started < 30
    assert fetch_rows(database_url, "SELECT state FROM outbox.message_status") == [("pending",)]

    nowhere = database_url.rsplit("/", 1)[0] + "/no_such_database"
    with pytest.raises(PublishTimeout, match=r"database unavailable") as stopped:
        publish_until_idle(nowhere, "127.0.0.1:1", timeout=2)
    assert stopped.value.totals.delivered == 0


def test_publish_until_idle_says_which_messages_it_left_and_why(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Both dependencies answer, yet a message stays: uncertain, it waits for its write
    deadline before the reconciler may decide it. PublishTimeout says so, with the
    status view's next action, rather than blaming the database."""
    with psycopg.connect(database_url) as conn:
        outbox.enqueue(conn, topic, b"x", key="k")
    make_uncertain(database_url, write_deadline_seconds=600)

    with pytest.raises(PublishTimeout) as stopped:
        publish_until_idle(database_url, kafka_bootstrap, timeout=3)
    text = str(stopped.value)
    assert "left: 1 uncertain; outbox.status says for uncertain: " in text, text
    assert "never answered" not in text
    assert stopped.value.totals.delivered == 0
    assert fetch_rows(database_url, "SELECT state FROM outbox.message_status") == [("uncertain",)]


def test_publish_until_idle_names_every_bad_setting_before_it_starts(
    database_url: str, kafka_bootstrap: str
) -> None:
    """Settings are checked as a config file's are: an unknown name (with the closest
    known one), a value of the wrong type, a value out of range, all in one error."""
    with pytest.raises(ConfigError) as refused:
        publish_until_idle(
            database_url, kafka_bootstrap, batch_size="10", absence_grace=-1, batch_szie=5
        )
    text = str(refused.value)
    assert 'batch_size = "10" is a string, expected an integer' in text
    assert "unknown setting 'batch_szie' (did you mean 'batch_size'?)" in text
    assert "absence grace must be 0 or more, got -1" in text
