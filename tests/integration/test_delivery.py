"""End to end: an intent committed in a transaction arrives in Kafka exactly as written."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

import outbox
from outbox.intent import (
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_KEY_BYTES,
    DEFAULT_MAX_VALUE_BYTES,
    header_bytes,
)
from publisher.partitioning import partition_for
from tests.support import SINKS, count_by_state, publish_until_idle, read_topic

pytestmark = pytest.mark.integration


def test_enqueued_message_arrives_with_key_headers_id_and_stored_location(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """A delivered message is in Kafka with its key, headers and id, where the row says."""
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(
            conn,
            topic,
            {"order": 42, "total": "9.50"},
            key="customer-7",
            headers=[("trace", b"abc"), ("source", "orders")],
        )
    totals = publish_until_idle(database_url, kafka_bootstrap)
    assert totals.delivered == 1

    records = read_topic(kafka_bootstrap, topic)
    assert len(records) == 1
    record = records[0]
    assert record.key == b"customer-7"
    assert json.loads(record.value) == {"order": 42, "total": "9.50"}
    assert record.header("trace") == b"abc"
    assert record.header("source") == b"orders"
    assert record.header("content-type") == b"application/json"
    assert record.outbox_id == message_id
    assert record.partition == partition_for(b"customer-7", message_id, 3)

    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT state, kafka_partition, kafka_offset, delivered_at IS NOT NULL, fence, "
            "attempts, lease_owner FROM outbox.message_status WHERE id = %s",
            (message_id,),
        ).fetchone()
        attempts = conn.execute(
            "SELECT outcome FROM outbox.attempts WHERE message_id = %s", (message_id,)
        ).fetchall()
        # The delivery's record is its batch, closed, naming the message.
        batch = conn.execute(
            "SELECT b.settled_at IS NOT NULL, b.send_began_at IS NOT NULL, "
            "b.message_ids = ARRAY[m.id] "
            "FROM outbox.messages AS m JOIN outbox.batches AS b ON b.id = m.batch_id "
            "WHERE m.id = %s",
            (message_id,),
        ).fetchone()
    assert row == ("delivered", record.partition, record.offset, True, 1, 1, None)
    assert attempts == []
    assert batch == (True, True, True)


def test_rolled_back_intent_is_never_published(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """An intent whose transaction rolled back is never stored nor sent; a committed one is."""
    with psycopg.connect(database_url) as conn:
        rolled_back = outbox.enqueue(conn, topic, b"rolled back", key="k")
        conn.rollback()
        committed = outbox.enqueue(conn, topic, b"committed", key="k")
        conn.commit()

    publish_until_idle(database_url, kafka_bootstrap)

    records = read_topic(kafka_bootstrap, topic)
    assert [r.value for r in records] == [b"committed"]
    assert [r.outbox_id for r in records] == [committed]
    assert rolled_back not in {r.outbox_id for r in records}
    assert count_by_state(database_url) == {"delivered": 1}


def test_many_messages_keep_per_key_order_and_every_offset_matches(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """A few thousand messages over many batches: each delivered once, at its stored offset."""
    messages = [outbox.Message(topic, f"value-{i}", key=f"key-{i % 17}") for i in range(3_000)]
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(conn, messages)
    totals = publish_until_idle(database_url, kafka_bootstrap, batch_size=250)
    assert totals.delivered == 3_000
    assert totals.batches >= 12

    records = read_topic(kafka_bootstrap, topic)
    assert sorted(r.outbox_id for r in records) == sorted(ids)
    with psycopg.connect(database_url) as conn:
        stored = {
            mid: (p, o)
            for mid, p, o in conn.execute(
                "SELECT id, kafka_partition, kafka_offset FROM outbox.messages"
            )
        }
    assert {r.outbox_id: (r.partition, r.offset) for r in records} == stored
    # One key's values appear in the order they were enqueued.
    by_key: dict[bytes | None, list[int]] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        by_key.setdefault(r.key, []).append(int(r.value.split(b"-")[1]))
    assert all(values == sorted(values) for values in by_key.values())


def test_unkeyed_messages_spread_over_partitions_by_id(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Unkeyed records go to the partition their id hashes to, and use every partition."""
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(conn, [outbox.Message(topic, b"x") for _ in range(60)])
    publish_until_idle(database_url, kafka_bootstrap)
    records = read_topic(kafka_bootstrap, topic)
    assert {r.outbox_id: r.partition for r in records} == {
        i: partition_for(None, i, 3) for i in ids
    }
    assert {r.partition for r in records} == {0, 1, 2}
    assert all(isinstance(r.outbox_id, uuid.UUID) for r in records)


@pytest.mark.parametrize("sink", SINKS)
def test_the_largest_message_the_defaults_accept_is_delivered(
    database_url: str, kafka_bootstrap: str, topic: str, sink: str
) -> None:
    """Value, key and headers each at their default ceiling, the headers as thousands of
    tiny ones (each stored after two lengths), a JSON value's content-type and the
    publisher's id header on top: within a broker's default message.max.bytes, so it is
    delivered, not refused as too large."""
    value = {"blob": "x" * (DEFAULT_MAX_VALUE_BYTES - len('{"blob":""}'))}
    key = b"k" * DEFAULT_MAX_KEY_BYTES
    headers = [("a", b"")] * (DEFAULT_MAX_HEADER_BYTES // header_bytes(b"a", b""))
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, topic, value, key=key, headers=headers)
    totals = publish_until_idle(database_url, kafka_bootstrap, sink=sink)
    assert (totals.delivered, totals.quarantined) == (1, 0)
    [record] = read_topic(kafka_bootstrap, topic)
    assert record.outbox_id == message_id
    assert len(record.value) == DEFAULT_MAX_VALUE_BYTES
    assert (record.key, len(record.headers)) == (key, len(headers) + 2)
    with pytest.raises(outbox.HeadersTooLarge):  # one more tiny header is refused at once
        outbox.enqueue(object(), topic, value, key=key, headers=[*headers, ("a", b"")])
