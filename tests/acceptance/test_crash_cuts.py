"""The real publisher killed at each cut of the crash timeline, then a fresh one takes over.

Each test enqueues a few hundred messages, runs ``outbox-publisher`` with
``OUTBOX_CRASH_AT=<cut>:2`` (it dies with ``os._exit`` at that cut of its
second batch), checks what the database says at that moment, then runs a
fresh publisher until nothing is left and checks the end state: every message
delivered exactly once in Kafka, at the offset stored for it, and a second
recovery and reconciliation pass changes nothing.
"""

from __future__ import annotations

import uuid
from collections import Counter

import psycopg
import pytest

import outbox
from publisher.faults import CRASH_EXIT_CODE
from publisher.reconciler import Reconciler
from publisher.scanner import KafkaLogScanner
from publisher.store import PublisherStore
from tests.support import (
    assert_each_delivered_once,
    count_by_state,
    fast_publisher_flags,
    read_topic,
    start_publisher,
)

pytestmark = pytest.mark.acceptance

TOTAL = 300
BATCH = 100
FAST = fast_publisher_flags(BATCH)


def _second_batch(database_url: str) -> tuple[int, list[tuple[object, ...]]]:
    """The messages of the crashed publisher's second batch and whether it began sending."""
    with psycopg.connect(database_url) as conn:
        batch_id, began = conn.execute(
            "SELECT id, send_began_at IS NOT NULL FROM outbox.batches ORDER BY id OFFSET 1 LIMIT 1"
        ).fetchone() or (None, None)
        rows = conn.execute(
            "SELECT state, lease_owner IS NOT NULL, lease_expires_at > now() "
            "FROM outbox.message_status WHERE batch_id = %s",
            (batch_id,),
        ).fetchall()
    return int(bool(began)), rows


def _crash(database_url: str, kafka_bootstrap: str, cut: str) -> str:
    process = start_publisher(
        database_url, kafka_bootstrap, *FAST, env={"OUTBOX_CRASH_AT": f"{cut}:2"}
    )
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == CRASH_EXIT_CODE, stderr
    assert f"injected crash at {cut} (batch 2)" in stderr
    return stderr


def _finish(
    database_url: str, kafka_bootstrap: str, topic: str, ids: list[uuid.UUID]
) -> list[tuple[object, ...]]:
    """Run a fresh publisher until idle; check every message delivered once; the evidence.

    Returns the attempts that did not deliver, as (outcome, send_began, count).
    """
    finisher = start_publisher(database_url, kafka_bootstrap, *FAST, "--exit-when-idle")
    _, stderr = finisher.communicate(timeout=180)
    assert finisher.returncode == 0, stderr
    assert count_by_state(database_url) == {"delivered": TOTAL}
    assert_each_delivered_once(database_url, kafka_bootstrap, topic, ids)
    with psycopg.connect(database_url) as conn:
        return conn.execute(
            "SELECT a.outcome, a.send_began, count(*) FROM outbox.attempts a "
            "WHERE a.outcome <> 'delivered' GROUP BY 1, 2"
        ).fetchall()


def _ids_in_kafka(kafka_bootstrap: str, topic: str) -> Counter[uuid.UUID]:
    return Counter(r.outbox_id for r in read_topic(kafka_bootstrap, topic))


@pytest.mark.parametrize("cut", ["after_claim", "after_send", "after_ack", "after_confirm"])
def test_crash_at_each_cut_ends_with_every_message_delivered_exactly_once(
    database_url: str, kafka_bootstrap: str, topic: str, cut: str
) -> None:
    """Whatever the cut, the database says what happened and nothing is lost or duplicated."""
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(
            conn, [outbox.Message(topic, f"m{i}", key=f"k{i % 13}") for i in range(TOTAL)]
        )
    _crash(database_url, kafka_bootstrap, cut)

    # What the database knows at the moment of the crash (docs/guarantees.md).
    counts = count_by_state(database_url)
    began, second = _second_batch(database_url)
    in_kafka = _ids_in_kafka(kafka_bootstrap, topic)
    if cut == "after_confirm":
        assert counts == {"delivered": 2 * BATCH, "pending": TOTAL - 2 * BATCH}
        assert sum(in_kafka.values()) == 2 * BATCH
    else:
        assert counts == {"delivered": BATCH, "in_flight": BATCH, "pending": TOTAL - 2 * BATCH}
        assert all(row == ("in_flight", True, True) for row in second), second
        assert began == (0 if cut == "after_claim" else 1)
        if cut == "after_claim":
            assert sum(in_kafka.values()) == BATCH
        if cut == "after_ack":
            assert sum(in_kafka.values()) == 2 * BATCH  # acknowledged, but not recorded

    # A fresh publisher recovers, reconciles and delivers the rest.
    evidence = _finish(database_url, kafka_bootstrap, topic, ids)
    with psycopg.connect(database_url) as conn:
        decisions: dict[str, int] = dict(
            conn.execute(
                "SELECT to_state, count(*) FROM outbox.decisions GROUP BY to_state"
            ).fetchall()
        )

    # The crashed batch left its evidence: an abandoned attempt per message,
    # saying whether sending had begun; uncertain ones were decided from Kafka.
    if cut == "after_confirm":
        assert evidence == []
        assert decisions == {}
    else:
        assert evidence == [("abandoned", cut != "after_claim", BATCH)]
    if cut == "after_claim":
        assert decisions == {}
    if cut == "after_ack":
        assert decisions == {"delivered": BATCH}  # all found in Kafka, none resent
    if cut == "after_send":
        assert sum(decisions.values()) == BATCH
        assert set(decisions) <= {"delivered", "pending"}

    # A second pass of recovery and reconciliation finds nothing to do.
    store = PublisherStore(database_url, uuid.uuid4())
    scanner = KafkaLogScanner(kafka_bootstrap)
    try:
        assert store.recover_expired_leases() == []
        assert Reconciler(store, scanner, "test", absence_grace=0).run_once().decided == 0
    finally:
        scanner.close()
        store.close()
    assert count_by_state(database_url) == {"delivered": TOTAL}


def test_a_crash_with_a_batch_claimed_ahead_returns_it_unsent(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Every message its own key: batch 3 is claimed ahead while 2 is sent, then the crash."""
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(
            conn, [outbox.Message(topic, f"m{i}", key=f"k{i}") for i in range(TOTAL)]
        )
    process = start_publisher(
        database_url, kafka_bootstrap, *FAST, env={"OUTBOX_CRASH_AT": "after_claim:3"}
    )
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == CRASH_EXIT_CODE, stderr

    # Batches 1 and 2 delivered; batch 3 in flight under a live lease, never sent.
    assert count_by_state(database_url) == {"delivered": 2 * BATCH, "in_flight": BATCH}
    with psycopg.connect(database_url) as conn:
        third = conn.execute(
            "SELECT send_began_at, settled_at FROM outbox.batches ORDER BY id OFFSET 2"
        ).fetchall()
    assert third == [(None, None)]

    evidence = _finish(database_url, kafka_bootstrap, topic, ids)
    with psycopg.connect(database_url) as conn:
        decisions = conn.execute("SELECT count(*) FROM outbox.decisions").fetchone()
    # Recovered as never sent: back to pending, nothing to reconcile.
    assert evidence == [("abandoned", False, BATCH)]
    assert decisions == (0,)
