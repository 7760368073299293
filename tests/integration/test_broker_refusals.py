"""What the broker refuses is quarantined with its reason; the rest of the batch goes on.

Each case is provoked with the real broker: a record larger than its topic
accepts, a topic that does not exist while the publisher may not create
topics, and a topic the publisher is not allowed to write (an ACL denies it).
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from kafka import KafkaAdminClient
from kafka.admin import ACLOperation, ACLResourcePatternType, NewTopic, ResourceType

import outbox
from outbox.operator import discard
from publisher.app import build_publisher
from publisher.testing import config_for_tests
from tests.support import (
    SINKS,
    allow_again,
    deny,
    fetch_rows,
    publish_until_idle,
    read_topic,
    small_topic,
    wait_until,
)

pytestmark = pytest.mark.integration


#: No topic creation; short send timeouts, so that the shared refusals' write
#: deadline passes and reconciliation decides them within seconds.
_FAST = {
    "auto_create_topics": False,
    "delivery_timeout_ms": 3_000,
    "request_timeout_ms": 1_000,
    "reconcile_interval": 0.5,
}


def _admin(bootstrap: str) -> KafkaAdminClient:
    return KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-tests")


def _forbidden_topic(bootstrap: str) -> str:
    """An existing topic on which an ACL denies writes to this (anonymous) client."""
    name = f"outbox-forbidden-{uuid.uuid4().hex[:8]}"
    admin = _admin(bootstrap)
    try:
        admin.create_topics([NewTopic(name, 1, 1)])
    finally:
        admin.close()
    deny(bootstrap, ResourceType.TOPIC, name, ACLOperation.WRITE)
    return name


def _rows(database_url: str) -> dict[uuid.UUID, tuple[str, str | None]]:
    with psycopg.connect(database_url) as conn:
        return {
            mid: (state, error)
            for mid, state, error in conn.execute(
                "SELECT id, state, last_error FROM outbox.messages"
            )
        }


@pytest.mark.parametrize("sink", SINKS)
def test_refused_records_are_quarantined_and_everything_else_is_delivered(
    database_url: str, kafka_bootstrap: str, topic: str, sink: str
) -> None:
    """Too large, missing topic, forbidden topic: quarantined with reasons; other keys delivered."""
    small = small_topic(kafka_bootstrap)
    forbidden = _forbidden_topic(kafka_bootstrap)
    missing = f"outbox-missing-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url) as conn:
        too_large = outbox.enqueue(conn, small, b"x" * 5_000, key="big")
        fits = outbox.enqueue(conn, small, b"small enough", key="fits")
        lost = outbox.enqueue(conn, missing, b"nowhere", key="m")
        denied = outbox.enqueue(conn, forbidden, b"not allowed", key="f")
        behind = outbox.enqueue(conn, small, b"after the big one", key="big")
        fine = outbox.enqueue_many(
            conn, [outbox.Message(topic, f"ok-{i}", key=f"k{i}") for i in range(20)]
        )
    publish_until_idle(database_url, kafka_bootstrap, **_FAST, max_block_ms=2_000, sink=sink)

    rows = _rows(database_url)
    assert rows[too_large][0] == "quarantined"
    assert "MessageSizeTooLargeError" in (rows[too_large][1] or "")
    assert rows[lost][0] == "quarantined"
    assert "TopicMissing" in (rows[lost][1] or "")
    assert missing in (rows[lost][1] or "")
    assert rows[denied][0] == "quarantined"
    assert "TopicAuthorizationFailedError" in (rows[denied][1] or "")
    # Every other topic and key went through.
    assert all(rows[i][0] == "delivered" for i in fine)
    assert {r.outbox_id for r in read_topic(kafka_bootstrap, topic)} == set(fine)
    # kafka-python fails every record its idempotent producer still had in
    # flight for that partition with the same error, and librdkafka every
    # record of the message set the broker refused; such a shared refusal is
    # uncertain, reconciled (nothing was written), and sent again alone, so
    # the record that fits is delivered and only the big one stays refused.
    # The message behind the big one of its key waits for an operator.
    assert rows[fits][0] == "delivered"
    assert rows[behind][0] == "pending"
    assert [r.outbox_id for r in read_topic(kafka_bootstrap, small)] == [fits]

    # The operator way out: discard the record that can never fit; its key
    # goes on without it.
    with psycopg.connect(database_url) as conn:
        discard(conn, too_large, "larger than the topic accepts")
    publish_until_idle(database_url, kafka_bootstrap, **_FAST, sink=sink)
    assert _rows(database_url)[behind][0] == "delivered"
    assert [r.value for r in read_topic(kafka_bootstrap, small)] == [
        b"small enough",
        b"after the big one",
    ]


def _attempts(database_url: str) -> list[tuple[str, int, int, str | None]]:
    return fetch_rows(
        database_url,
        "SELECT state, attempts, failures, last_error FROM outbox.message_status",
    )


def test_a_publisher_refused_its_transactional_id_quarantines_nothing(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """No right to its TransactionalIds says nothing about the messages: however many
    batches fail for it, none counts toward --max-attempts (none is quarantined), each
    message's last_error names the refusal, /readyz says kafka_refused, and once the ACL is
    granted they go out."""
    publisher_id = uuid.uuid4()
    acl = deny(
        kafka_bootstrap,
        ResourceType.TRANSACTIONAL_ID,
        f"outbox-{publisher_id}",
        ACLOperation.WRITE,
        ACLResourcePatternType.PREFIXED,
    )
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(
            conn, [outbox.Message(topic, f"m{i}", key=f"k{i}") for i in range(3)]
        )
    config = config_for_tests(
        database_url,
        kafka_bootstrap,
        delivery="transactional",
        max_attempts=2,
        retry_base_seconds=0.05,
        retry_cap_seconds=0.2,
        exit_when_idle=False,
    )
    publisher = build_publisher(config, publisher_id)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(publisher.run)
        try:
            # More tries than --max-attempts allows a message's own failures.
            wait_until(
                lambda: all(attempt > 3 for _, attempt, _, _ in _attempts(database_url)),
                timeout=60,
                what="the messages tried more often than --max-attempts",
            )
            # The broker is up, but the publisher cannot deliver: not ready, and the
            # probe's cluster description does not make it so.
            assert publisher.health.readiness().checks["kafka"] == "kafka_refused"
            publisher.health.kafka.answered()
            assert publisher.health.readiness().checks["kafka"] == "kafka_refused"
        finally:
            publisher.request_stop()
            running.result(timeout=60)
    rows = _attempts(database_url)
    assert {state for state, _, _, _ in rows} == {"pending"}, rows
    assert all(failures <= 1 for _, _, failures, _ in rows), rows
    assert all("TransactionalIdAuthorizationFailedError" in (e or "") for *_, e in rows), rows

    allow_again(kafka_bootstrap, acl)
    publish_until_idle(database_url, kafka_bootstrap, delivery="transactional")
    assert {state for state, _, _, _ in _attempts(database_url)} == {"delivered"}
    assert {r.outbox_id for r in read_topic(kafka_bootstrap, topic, committed=True)} == set(ids)


@pytest.mark.parametrize("sink", SINKS)
def test_a_topic_refused_to_the_publisher_does_not_make_kafka_look_down(
    database_url: str, kafka_bootstrap: str, sink: str
) -> None:
    """A record refused for its topic (an ACL) is the broker answering: the message is
    quarantined, and Kafka's contact (/readyz, outbox_kafka_up) stays up."""
    forbidden = _forbidden_topic(kafka_bootstrap)
    with psycopg.connect(database_url) as conn:
        denied = outbox.enqueue(conn, forbidden, b"not allowed", key="f")
    publisher = build_publisher(config_for_tests(database_url, kafka_bootstrap, **_FAST, sink=sink))
    publisher.run()
    assert _rows(database_url)[denied][0] == "quarantined"
    assert publisher.health.kafka.ok is True
    assert publisher.health.kafka.problem() is None
