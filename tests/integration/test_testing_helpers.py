"""The helpers a service's own tests use: what was enqueued, and a publisher run in-process.

The first test is the example ``docs/embedding.md`` shows: code that writes an
order and its event, checked for exactly the events it enqueued, then
delivered by a publisher running in the test's process.
"""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest

import outbox
from outbox.testing import EnqueueRecorder
from publisher.testing import publish_until_idle
from tests.support import assert_excerpt_of_file, read_topic

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
