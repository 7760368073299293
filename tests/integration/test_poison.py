"""A message that kills its publisher is isolated, then quarantined; its neighbours are not."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

import outbox
from outbox.states import State
from publisher.app import build_publisher
from publisher.config import PublisherConfig
from publisher.outcomes import AttemptOutcome
from publisher.sink import InFlight, OutgoingRecord, SendWindow, Sink
from publisher.store import Settlement
from tests.support import (
    DELIVERY_MODES,
    claiming_store,
    create_topic,
    fetch_rows,
    publisher_config,
    read_topic,
    reads_committed,
    wait_until,
)

pytestmark = pytest.mark.integration


class PublisherKilled(BaseException):
    """What a poison does to the publisher holding it: nothing of the loop survives it."""


class PoisonedSink:
    """A real sink, except that the publisher dies when it handles the poison.

    ``at="describe"``: when it looks up the poison's topic, before its batch
    begins sending (recovery returns the batch to pending); ``at="send"``:
    when it hands the poison's record over (recovery makes it uncertain).
    """

    def __init__(self, sink: Sink, poison: uuid.UUID, topic: str, at: str) -> None:
        self._sink = sink
        self._poison = poison
        self._topic = topic
        self._at = at

    def partition_count(self, topic: str) -> int:
        if self._at == "describe" and topic == self._topic:
            raise PublisherKilled
        return self._sink.partition_count(topic)

    def send(self, records: Sequence[OutgoingRecord], *, window: SendWindow | None = None) -> Any:
        if self._at == "send" and any(r.message_id == self._poison for r in records):
            raise PublisherKilled
        return self._sink.send(records, window=window)

    def complete(self, in_flight: InFlight) -> Any:
        return self._sink.complete(in_flight)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)


def _config(database_url: str, kafka_bootstrap: str, **overrides: Any) -> PublisherConfig:
    """Leases that expire within seconds of a death, and passes that notice it at once."""
    settings: dict[str, Any] = {
        "batch_size": 10,
        "linger_ms": 0,
        "delivery_timeout_ms": 2000,
        "request_timeout_ms": 1000,
        "max_block_ms": 1000,
        "lease_seconds": 4.0,
        "heartbeat_interval": 1.0,
        "recovery_interval": 0.2,
        "reconcile_interval": 0.5,
        **overrides,
    }
    return publisher_config(database_url, kafka_bootstrap, **settings)


def _row(database_url: str, message_id: uuid.UUID) -> tuple[Any, ...]:
    [row] = fetch_rows(
        database_url,
        "SELECT state, failures, send_alone, last_error FROM outbox.messages WHERE id = %s",
        message_id,
    )
    return row


@pytest.mark.parametrize("delivery", DELIVERY_MODES)
@pytest.mark.parametrize("at", ["describe", "send"])
def test_a_message_that_kills_every_publisher_is_quarantined_and_its_neighbours_delivered(
    database_url: str, kafka_bootstrap: str, topic: str, at: str, delivery: str
) -> None:
    """A poison that kills each publisher claiming it ends quarantined after --max-attempts
    claims alone; the messages claimed with it are delivered once (in transactional
    delivery, as a read_committed consumer reads), and its key's later message waits
    behind it."""
    committed = reads_committed(delivery)
    poison_topic = f"outbox-poison-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, poison_topic, partitions=1)
    with psycopg.connect(database_url) as conn:
        before = outbox.enqueue_many(conn, [outbox.Message(topic, f"b{i}") for i in range(3)])
        poison = outbox.enqueue(conn, poison_topic, "poison", key="k")
        behind = outbox.enqueue(conn, poison_topic, "behind the poison", key="k")
        after = outbox.enqueue_many(conn, [outbox.Message(topic, f"a{i}") for i in range(3)])
    config = _config(database_url, kafka_bootstrap, max_attempts=2, delivery=delivery)

    deaths = 0
    deadline = time.monotonic() + 120
    while _row(database_url, poison)[0] != "quarantined":
        assert time.monotonic() < deadline, (
            f"the poison is still {_row(database_url, poison)[:3]} after {deaths} deaths"
        )
        publisher = build_publisher(config)
        publisher.sink = PoisonedSink(publisher.sink, poison, poison_topic, at)
        try:
            publisher.run()
        except PublisherKilled:
            deaths += 1

    state, failures, send_alone, last_error = _row(database_url, poison)
    assert (state, failures, send_alone) == ("quarantined", 2, True)
    assert "ended its publisher's claims" in last_error
    assert "--max-attempts 2" in last_error
    # Twice with its neighbours (no failure counted; suspect after the second),
    # then twice alone (two failures).
    assert deaths == 4
    neighbours = [*before, *after]
    assert fetch_rows(
        database_url,
        "SELECT count(*) FROM outbox.messages WHERE id = ANY(%s) AND state = 'delivered' "
        "AND failures = 0 AND NOT send_alone",
        neighbours,
    ) == [(len(neighbours),)]
    assert sorted(
        r.outbox_id for r in read_topic(kafka_bootstrap, topic, committed=committed)
    ) == sorted(neighbours)
    # Its key's later message is held behind it, never sent ahead of it.
    assert _row(database_url, behind)[0] == "pending"
    records = read_topic(kafka_bootstrap, poison_topic, committed=committed)
    assert behind not in {r.outbox_id for r in records}


def _expire_and_recover(database_url: str, store: Any, expected: int) -> None:
    """Wait for the open batches' short leases to run out, as a killed publisher's do."""
    wait_until(
        lambda: fetch_rows(
            database_url, "SELECT bool_and(lease_expires_at < now()) FROM outbox.in_flight"
        )[0][0],
        timeout=10,
        what="the leases to expire",
    )
    assert len(store.recover_expired_leases()) == expected


def test_a_batch_given_back_unsent_then_recovered_once_is_not_suspect(
    database_url: str, topic: str
) -> None:
    """A publisher gave its batch back unsent (it was stopping: an 'abandoned' attempt); the
    next claim's publisher is killed. One recovery: the messages are not suspect (after a
    rolling restart and one crash, a backlog would otherwise go out one message per batch).
    Recovery's attempts are 'recovered'."""
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(conn, [outbox.Message(topic, f"m{i}") for i in range(3)])
    store = claiming_store(database_url)
    try:
        released = store.claim(10, lease_seconds=30)
        assert released is not None
        store.settle(
            released,
            [
                Settlement(
                    message_id=m.id,
                    fence=m.fence,
                    state=State.PENDING,
                    attempt_outcome=AttemptOutcome.ABANDONED,
                    error="not sent: the publisher is stopping",
                    send_began=False,
                )
                for m in released.messages
            ],
        )
        crashed = store.claim(10, lease_seconds=0.3)
        assert crashed is not None
        assert [m.id for m in crashed.messages] == ids
        _expire_and_recover(database_url, store, 3)
    finally:
        store.close()
    rows = fetch_rows(
        database_url,
        "SELECT id, state, failures, send_alone, last_error FROM outbox.messages ORDER BY seq",
    )
    assert [r[:4] for r in rows] == [(m, "pending", 0, False) for m in ids]
    assert all(r[4].endswith("no failure is counted") for r in rows), rows
    assert fetch_rows(
        database_url, "SELECT outcome, count(*) FROM outbox.attempts GROUP BY 1 ORDER BY 1"
    ) == [("abandoned", 3), ("recovered", 3)]


def test_publishers_killed_with_healthy_messages_quarantine_none(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Healthy messages whose publishers were killed three times (a batch of several and a
    lone message; all of them again in one batch, which makes them suspect; then each alone)
    are charged only the claim they had alone, are claimed one at a time in key order once
    suspect, and are all delivered. One kill alone marks nothing."""
    with psycopg.connect(database_url) as conn:
        company = outbox.enqueue_many(
            conn,
            [
                outbox.Message(topic, "k1", key="k"),
                outbox.Message(topic, "other"),
                outbox.Message(topic, "k2", key="k"),
            ],
        )
        [lone] = outbox.enqueue_many(conn, [outbox.Message(topic, "lone")])
    store = claiming_store(database_url)
    try:
        # First death: a batch of three and, claimed next, a batch of one.
        first = store.claim(3, lease_seconds=0.3)
        second = store.claim(10, lease_seconds=0.3)
        assert first is not None
        assert [m.id for m in first.messages] == company
        assert second is not None
        assert [m.id for m in second.messages] == [lone]
        _expire_and_recover(database_url, store, 4)
        rows = fetch_rows(
            database_url,
            "SELECT id, state, failures, send_alone, last_error FROM outbox.messages ORDER BY seq",
        )
        # One recovery: no failure, and not suspect; claimed together again.
        assert [r[:4] for r in rows] == [(m, "pending", 0, False) for m in [*company, lone]]
        assert all(r[4].endswith("no failure is counted") for r in rows)
        again = store.claim(10, lease_seconds=0.3)
        assert again is not None
        assert [m.id for m in again.messages] == [*company, lone]

        # Second death in a row: suspect now, still no failure counted.
        _expire_and_recover(database_url, store, 4)
        rows = fetch_rows(
            database_url,
            "SELECT id, state, failures, send_alone, last_error FROM outbox.messages ORDER BY seq",
        )
        assert [r[:4] for r in rows] == [(m, "pending", 0, True) for m in [*company, lone]]
        assert all("twice in a row" in r[4] for r in rows)

        # Suspects are claimed alone, oldest first; the key's second waits behind its first.
        claims = [store.claim(10, lease_seconds=0.3) for _ in range(4)]
        assert [[m.id for m in b.messages] if b else None for b in claims] == [
            [company[0]],
            [company[1]],
            [lone],
            None,
        ]
        # Third death, each alone: one failure each, and only for those.
        _expire_and_recover(database_url, store, 3)
    finally:
        store.close()
    assert fetch_rows(database_url, "SELECT id, failures FROM outbox.messages ORDER BY seq") == [
        (company[0], 1),
        (company[1], 1),
        (company[2], 0),
        (lone, 1),
    ]

    totals = build_publisher(_config(database_url, kafka_bootstrap, max_attempts=2)).run()
    assert (totals.delivered, totals.quarantined) == (4, 0)
    assert (
        fetch_rows(database_url, "SELECT state, send_alone FROM outbox.messages ORDER BY seq")
        == [("delivered", False)] * 4
    )
    keyed = [r.outbox_id for r in read_topic(kafka_bootstrap, topic) if r.key == b"k"]
    assert keyed == [company[0], company[2]]
