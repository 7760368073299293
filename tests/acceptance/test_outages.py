"""The broker or the database goes away in the middle of a run and comes back.

These tests stop and restart the local services that ``services/up`` runs,
so they are skipped when the tests use services started some other way. A
test that stops a service starts it again, and waits until it answers, even
when it fails. The outages run in both delivery modes; in transactional
delivery the consumers read ``read_committed`` and the publishers wait out
no absence grace.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections import Counter
from datetime import datetime
from typing import Any

import psycopg
import pytest

import outbox
from publisher.app import build_publisher
from publisher.faults import Faults
from tests.support import (
    DELIVERY_MODES,
    LONG_ABSENCE_GRACE,
    DrainedPublisher,
    assert_each_read_once,
    broker_answers,
    count_by_state,
    delivery_flags,
    fast_publisher_flags,
    local_service,
    local_services_running,
    publisher_config,
    read_topic,
    reads_committed,
    start_broker_again,
    wait_until,
)

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(
        not local_services_running(), reason="needs the services that services/up runs"
    ),
]

TOTAL = 4_000
FAST = fast_publisher_flags(100)


def _enqueue(database_url: str, topic: str, first: int, count: int) -> None:
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(
            conn,
            [outbox.Message(topic, f"m{i}", key=f"k{i % 11}") for i in range(first, first + count)],
        )


def _failed_attempts(database_url: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM outbox.attempts WHERE outcome <> 'delivered'"
        ).fetchone()
    return row[0] if row else 0


def _wait_all_delivered(database_url: str, publisher: DrainedPublisher) -> None:
    try:
        wait_until(
            lambda: count_by_state(database_url) == {"delivered": TOTAL},
            timeout=240,
            interval=0.5,
            what="every message to be delivered after the restart",
        )
    except AssertionError as timed_out:
        with psycopg.connect(database_url) as conn:
            batches = conn.execute(
                "SELECT id, publisher_id, send_began_at, lease_expires_at, transactional_id,"
                " cardinality(message_ids) FROM outbox.batches"
                " WHERE settled_at IS NULL ORDER BY id"
            ).fetchall()
        raise AssertionError(
            f"{timed_out}: states {count_by_state(database_url)}, open batches {batches};"
            f" the publisher's last lines:\n{publisher.stderr_tail()}"
        ) from None


def _assert_exactly_once(
    database_url: str, kafka_bootstrap: str, topic: str, *, committed: bool
) -> None:
    with psycopg.connect(database_url) as conn:
        ids = [mid for (mid,) in conn.execute("SELECT id FROM outbox.messages")]
    assert len(ids) == TOTAL
    assert_each_read_once(database_url, kafka_bootstrap, topic, ids, committed=committed)
    with psycopg.connect(database_url) as conn:
        # A delivery's record is the batch that carried it: closed, naming it.
        recorded = conn.execute(
            "SELECT count(*) FROM outbox.messages AS m "
            "JOIN outbox.batches AS b ON b.id = m.batch_id "
            "WHERE m.state = 'delivered' AND b.settled_at IS NOT NULL "
            "AND m.id = ANY(b.message_ids)"
        ).fetchone()
    assert recorded == (TOTAL,)


@pytest.mark.parametrize("delivery", DELIVERY_MODES)
def test_broker_restart_mid_run_ends_with_each_message_delivered_once(
    database_url: str, kafka_bootstrap: str, topic: str, delivery: str
) -> None:
    """Kafka stops and restarts: failed sends retry or are reconciled, none is duplicated."""
    _enqueue(database_url, topic, 0, TOTAL // 2)
    publisher = DrainedPublisher(database_url, kafka_bootstrap, *FAST, *delivery_flags(delivery))
    try:
        wait_until(
            lambda: count_by_state(database_url) == {"delivered": TOTAL // 2},
            timeout=60,
            what="the first half to be delivered",
        )
        local_service("down", "kafka")
        try:
            # Committed while the broker is away: the publisher tries and fails.
            _enqueue(database_url, topic, TOTAL // 2, TOTAL // 2)
            wait_until(
                lambda: _failed_attempts(database_url) > 0,
                timeout=60,
                what="a failed attempt while Kafka is down",
            )
        finally:
            start_broker_again(kafka_bootstrap)
        _wait_all_delivered(database_url, publisher)
    finally:
        stderr = publisher.stop(signal.SIGTERM, timeout=60)
    assert publisher.returncode == 0, stderr
    _assert_exactly_once(database_url, kafka_bootstrap, topic, committed=reads_committed(delivery))
    with psycopg.connect(database_url) as conn:
        outcomes: dict[str, int] = dict(
            conn.execute(
                "SELECT outcome, count(*) FROM outbox.attempts GROUP BY outcome"
            ).fetchall()
        )
        decided = conn.execute("SELECT count(*) FROM outbox.decisions").fetchone()
    assert "delivered" not in outcomes  # a delivery is recorded by its batch alone
    # Each uncertain outcome was reconciled from Kafka rather than resent blindly.
    assert (decided or (0,))[0] == outcomes.get("uncertain", 0)


@pytest.mark.parametrize("delivery", DELIVERY_MODES)
def test_database_restart_mid_run_reconnects_without_breaking_a_fence(
    database_url: str, kafka_bootstrap: str, topic: str, delivery: str
) -> None:
    """PostgreSQL restarts: the publisher reconnects and every outcome lands under its fence."""
    _enqueue(database_url, topic, 0, TOTAL)
    publisher = DrainedPublisher(database_url, kafka_bootstrap, *FAST, *delivery_flags(delivery))
    try:
        wait_until(
            lambda: count_by_state(database_url).get("delivered", 0) >= 300,
            timeout=60,
            what="the first deliveries",
        )
        local_service("down", "postgres")
        local_service("up", "postgres")
        _wait_all_delivered(database_url, publisher)
    finally:
        stderr = publisher.stop(signal.SIGTERM, timeout=60)
    assert publisher.returncode == 0, stderr
    assert "database unavailable" in stderr or "recording a batch failed" in stderr
    _assert_exactly_once(database_url, kafka_bootstrap, topic, committed=reads_committed(delivery))
    with psycopg.connect(database_url) as conn:
        # No delivery was settled on a batch that recovery had closed (its lease
        # lost while the database was away); one recovered is decided from Kafka.
        stale = conn.execute(
            "SELECT count(*) FROM outbox.messages AS m JOIN outbox.attempts AS a "
            "ON a.message_id = m.id AND a.batch_id = m.batch_id AND a.outcome = 'recovered' "
            "WHERE m.state = 'delivered' "
            "AND NOT EXISTS (SELECT 1 FROM outbox.decisions AS d WHERE d.message_id = m.id)"
        ).fetchone()
    assert stale == (0,)


class _BrokerLostBeforeTheCommit(Faults):
    """At the first batch's send, once the broker has acknowledged every record (they
    are in the log, uncommitted), stop the broker: the commit that follows finds no one.

    The publisher runs in this process so that the cut can wait for the
    acknowledgements; a frozen process could not.
    """

    def __init__(self, kafka_bootstrap: str, topic: str, count: int) -> None:
        super().__init__()
        self.kafka_bootstrap = kafka_bootstrap
        self.topic = topic
        self.count = count
        self.stopped = threading.Event()

    def reached(self, cut: str) -> None:
        """Stop the broker at the first ``after_send``; every other cut passes."""
        if cut != "after_send" or self.stopped.is_set():
            return
        self.stopped.set()
        wait_until(
            lambda: len(read_topic(self.kafka_bootstrap, self.topic)) == self.count,
            timeout=30,
            interval=0.1,
            what="the broker to acknowledge every record of the batch",
        )
        local_service("down", "kafka")


def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in list(caplog.records))


def _attempts(database_url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url) as conn:
        return conn.execute(
            "SELECT outcome, error FROM outbox.attempts ORDER BY message_id, attempt"
        ).fetchall()


def _decisions(database_url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url) as conn:
        return conn.execute(
            "SELECT message_id, decided_at, decided_by, from_state, to_state, reason, evidence "
            "FROM outbox.decisions ORDER BY id"
        ).fetchall()


def _database_now(database_url: str) -> datetime:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    now: datetime = row[0]
    return now


def test_broker_lost_during_a_commit_leaves_the_batch_uncertain_until_fenced(
    database_url: str, kafka_bootstrap: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Transactional delivery only (an idempotent batch has no commit to lose).

    The broker acknowledges every record of the batch and stops before the
    transaction's commit reaches it: the commit's answer is unknown, so the
    batch is uncertain, and nothing decides it while the broker is away (its
    session cannot be fenced). Once the broker is back, the reconciler fences
    the session, which aborts the transaction, proves the records absent from
    the committed log at once (with an absence grace of an hour), and they
    are sent again: a read_committed consumer reads each once; a
    read_uncommitted one also reads the aborted copies.
    """
    count = 50
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(
            conn, [outbox.Message(topic, f"m{i}", key=f"k{i % 7}") for i in range(count)]
        )
    config = publisher_config(
        database_url,
        kafka_bootstrap,
        delivery="transactional",
        absence_grace=LONG_ABSENCE_GRACE,
        batch_size=100,
        delivery_timeout_ms=3000,
        request_timeout_ms=1000,
        max_block_ms=2000,
        lease_seconds=5,
        heartbeat_interval=1,
        recovery_interval=0.5,
        reconcile_interval=0.5,
    )
    faults = _BrokerLostBeforeTheCommit(kafka_bootstrap, topic, count)
    publisher = build_publisher(config, faults=faults)
    seen: dict[str, Any] = {}

    def while_the_broker_is_away() -> None:
        try:
            wait_until(
                lambda: count_by_state(database_url) == {"uncertain": count},
                timeout=60,
                what="the batch to be settled uncertain",
            )
            seen["attempts"] = _attempts(database_url)
            seen["decisions"] = _decisions(database_url)
            seen["away_until"] = _database_now(database_url)
        except BaseException as exc:  # noqa: BLE001 - reported by the test once the broker is back
            seen["error"] = exc
            publisher.request_stop()
        finally:
            start_broker_again(kafka_bootstrap)

    watcher = threading.Thread(target=while_the_broker_is_away)
    try:
        with caplog.at_level(logging.INFO):
            watcher.start()
            publisher.run()
    finally:
        watcher.join(timeout=240)
        if not broker_answers(kafka_bootstrap):
            start_broker_again(kafka_bootstrap)
    assert "error" not in seen, seen.get("error")
    assert faults.stopped.is_set()

    # The commit went unanswered: every record acknowledged, the batch uncertain,
    # and nothing decided yet.
    assert _logged(caplog, "no answer to the transaction's committed in time")
    assert [outcome for outcome, _ in seen["attempts"]] == ["uncertain"] * count
    assert all("its transaction was unknown" in error for _, error in seen["attempts"])
    assert seen["decisions"] == []

    # Back: fenced, proven absent from the committed log at once, sent again.
    with psycopg.connect(database_url) as conn:
        sessions = [tid for (tid,) in conn.execute(
            "SELECT transactional_id FROM outbox.batches ORDER BY id"
        )]  # fmt: skip
    assert len(sessions) == 2
    assert sessions[0] != sessions[1]
    assert _logged(caplog, f"fenced producer session {sessions[0]}")
    decisions = _decisions(database_url)
    assert sorted(d[0] for d in decisions) == sorted(ids)
    for _, decided_at, decided_by, from_state, to_state, reason, evidence in decisions:
        assert decided_at > seen["away_until"]  # decided only once the broker was back
        assert decided_by == f"reconciler {publisher.publisher_id}"
        assert (from_state, to_state) == ("uncertain", "pending")
        assert reason.startswith("proven absent")
        assert evidence["topic"] == topic
        assert evidence["scan_to"] > evidence["scan_from"]  # the aborted records were read past
    assert count_by_state(database_url) == {"delivered": count}
    assert_each_read_once(database_url, kafka_bootstrap, topic, ids, committed=True)
    # The aborted transaction's records stay in the log: a read_uncommitted
    # consumer reads each message twice at least.
    copies = Counter(r.outbox_id for r in read_topic(kafka_bootstrap, topic))
    assert set(copies) == set(ids)
    assert min(copies.values()) >= 2
