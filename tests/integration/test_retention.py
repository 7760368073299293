"""``outbox purge``: delivered messages go after one window, their evidence after another.

Messages "from ten days ago" are enqueued with ids made ten days ago (ids are
UUIDv7 and purge walks them in id order), delivered by a real publisher, and
their delivery times moved back; so every row is as it would be after ten days.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

import outbox
import outbox.ids
from outbox.retention import PURGE_LOCK_KEY, purge
from publisher.app import build_publisher
from tests.support import (
    fetch_rows,
    make_uncertain,
    publish_until_idle,
    publisher_config,
    run_outbox_cli,
    small_topic,
    wait_until,
)

pytestmark = pytest.mark.integration

DAY_NS = 86_400 * 10**9


def _enqueue(
    url: str, monkeypatch: pytest.MonkeyPatch, messages: list[outbox.Message], *, days_ago: int
) -> list[uuid.UUID]:
    """Enqueue ``messages`` with ids made ``days_ago`` days ago."""
    then = time.time_ns() - days_ago * DAY_NS
    with monkeypatch.context() as m:
        m.setattr(outbox.ids, "time", SimpleNamespace(time_ns=lambda: then))
        m.setattr(outbox.ids, "_last_ms", 0)
        with psycopg.connect(url) as conn:
            return outbox.enqueue_many(conn, messages)


def _purge(url: str, *args: str) -> dict[str, Any]:
    result = run_outbox_cli(url, "purge", *args, "--json")
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def _count(url: str, sql: str, *params: object) -> int:
    return int(fetch_rows(url, sql, *params)[0][0])


def test_purge_deletes_only_old_delivered_messages_then_their_evidence(
    database_url: str, kafka_bootstrap: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Undelivered rows and recent deliveries stay; evidence outlives its message by a window."""
    small = small_topic(kafka_bootstrap)
    # Sent on its own: a refusal kafka-python reports for a request that also carried
    # records of other partitions is pinned on none of them (they go uncertain), and the
    # story here is of a message refused alone.
    [quarantined] = _enqueue(
        database_url, monkeypatch, [outbox.Message(small, b"x" * 5000, key="q")], days_ago=10
    )
    totals = publish_until_idle(database_url, kafka_bootstrap)
    assert (totals.delivered, totals.quarantined) == (0, 1)
    old = _enqueue(
        database_url,
        monkeypatch,
        [outbox.Message(topic, b"v", key=f"k{i}") for i in range(30)],
        days_ago=10,
    )
    with psycopg.connect(database_url) as conn:
        recent = outbox.enqueue_many(conn, [outbox.Message(topic, b"v") for _ in range(5)])
    totals = publish_until_idle(database_url, kafka_bootstrap)
    assert (totals.delivered, totals.quarantined) == (35, 0)
    [uncertain] = _enqueue(database_url, monkeypatch, [outbox.Message(topic, b"u")], days_ago=10)
    make_uncertain(database_url, write_deadline_seconds=3600)
    stuck = old[-1]  # enqueued ten days ago like the others, but delivered just now
    with psycopg.connect(database_url) as conn:
        # Ten days pass: every delivery, attempt and claim is that old now.
        conn.execute(
            "UPDATE outbox.messages SET delivered_at = delivered_at - interval '10 days' "
            "WHERE state = 'delivered' AND id <> %s",
            (stuck,),
        )
        conn.execute(
            "UPDATE outbox.attempts SET started_at = started_at - interval '10 days', "
            "finished_at = finished_at - interval '10 days' WHERE message_id <> %s",
            (stuck,),
        )
        conn.execute("UPDATE outbox.batches SET claimed_at = claimed_at - interval '10 days'")
    batches = _count(database_url, "SELECT count(*) FROM outbox.batches")
    assert batches >= 2

    dry = _purge(database_url, "--delivered-older-than", "7d", "--dry-run")
    assert (dry["dry_run"], dry["messages"], dry["attempts"], dry["batches"]) == (True, 29, 0, 0)
    assert _count(database_url, "SELECT count(*) FROM outbox.messages") == 37

    first = _purge(database_url, "--delivered-older-than", "7d", "--batch-size", "7")
    # Evidence is kept 30 days by default: only the messages go.
    assert (first["messages"], first["attempts"], first["decisions"], first["batches"]) == (
        29,
        0,
        0,
        0,
    )
    assert first["steps"] >= 29 // 7
    left = {
        row[0]: row[1] for row in fetch_rows(database_url, "SELECT id, state FROM outbox.messages")
    }
    # Recent ids stay even though their delivery time was moved back, and the
    # old message delivered just now stays: purge needs both the enqueue (id)
    # and the delivery to be older than the window.
    assert left == {
        **dict.fromkeys(recent, "delivered"),
        stuck: "delivered",
        quarantined: "quarantined",
        uncertain: "uncertain",
    }
    # A delivery's record is its batch (no attempt row): those stay for the
    # evidence window, and the purged message's story is told from them.
    assert (
        _count(database_url, "SELECT count(*) FROM outbox.attempts WHERE message_id = ANY(%s)", old)
        == 0
    )
    assert (
        _count(database_url, "SELECT count(*) FROM outbox.batches WHERE message_ids && %s", old)
        >= 1
    )

    purged = run_outbox_cli(database_url, "inspect", str(old[0]), "--json")
    assert purged.returncode == 0, purged.stderr
    story = json.loads(purged.stdout)
    assert story["state"] == "purged"
    assert story["message"] is None
    assert [a["outcome"] for a in story["attempts"]] == ["delivered"]

    second = _purge(
        database_url,
        "--delivered-older-than",
        "5d",
        "--evidence-older-than",
        "5d",
        "--batch-size",
        "4",
    )
    assert (second["messages"], second["attempts"]) == (0, 0)  # deliveries have no attempt row
    # Every batch went except the ones the uncertain message still needs (for
    # reconciliation) and the quarantined one names (what was sent with it).
    assert second["batches"] == batches - 2
    for still_needed in (uncertain, quarantined):
        [(kept_batch,)] = fetch_rows(
            database_url,
            "SELECT b.id FROM outbox.batches AS b JOIN outbox.messages AS m "
            "ON m.batch_id = b.id WHERE m.id = %s",
            still_needed,
        )
        assert kept_batch is not None
    # The evidence of messages that still exist is never touched.
    assert (
        _count(
            database_url,
            "SELECT count(*) FROM outbox.attempts WHERE message_id = ANY(%s)",
            [quarantined, uncertain, stuck, *recent],
        )
        == 2  # the quarantined and the uncertain attempt; deliveries have none
    )
    gone = run_outbox_cli(database_url, "inspect", str(old[0]))
    assert gone.returncode == 2
    assert "no message" in gone.stderr

    again = _purge(database_url, "--delivered-older-than", "5d", "--evidence-older-than", "5d")
    assert (again["messages"], again["attempts"], again["decisions"], again["batches"]) == (
        0,
        0,
        0,
        0,
    )


def test_purge_refuses_a_bad_age_and_deletes_nothing(database_url: str, topic: str) -> None:
    """A malformed or zero period is a usage error naming the problem."""
    with psycopg.connect(database_url) as conn:
        outbox.enqueue(conn, topic=topic, value=b"v")
    for args, says in (
        (["7"], "is not a duration"),
        (["0d"], "longer than zero"),
        (["299s"], "shorter than the minimum, 5 minutes"),
        (["7y"], "unit"),
        (["7d", "--evidence-older-than", "1d"], "must be at least the delivered window"),
    ):
        result = run_outbox_cli(database_url, "purge", "--delivered-older-than", *args)
        assert result.returncode == 2, args
        assert says in result.stderr
    assert _count(database_url, "SELECT count(*) FROM outbox.messages") == 1


def test_one_purge_at_a_time(database_url: str) -> None:
    """While a purge holds its lock, another one says so and deletes nothing."""
    with psycopg.connect(database_url, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (PURGE_LOCK_KEY,))
        busy = run_outbox_cli(database_url, "purge", "--delivered-older-than", "1d")
        assert busy.returncode == 2
        assert "another purge is running" in busy.stderr
        other.execute("SELECT pg_advisory_unlock(%s)", (PURGE_LOCK_KEY,))
    done = run_outbox_cli(database_url, "purge", "--delivered-older-than", "1d")
    assert done.returncode == 0, done.stderr


def test_a_publisher_purges_at_its_interval(
    database_url: str, kafka_bootstrap: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --purge-delivered-after, the publisher deletes what it delivered once old enough."""
    ids = _enqueue(
        database_url, monkeypatch, [outbox.Message(topic, b"v") for _ in range(20)], days_ago=1
    )
    config = publisher_config(
        database_url,
        kafka_bootstrap,
        exit_when_idle=False,
        purge_delivered_after="5m",
        purge_evidence_after="5m",
        purge_interval=0.3,
    )
    publisher = build_publisher(config)
    runner = threading.Thread(target=publisher.run)
    runner.start()
    try:
        wait_until(
            lambda: (
                _count(
                    database_url, "SELECT count(*) FROM outbox.messages WHERE state = 'delivered'"
                )
                == len(ids)
            ),
            timeout=30,
            what="every message to be delivered",
        )
        # A day passes: the deliveries and their batches are older than the windows now.
        with psycopg.connect(database_url) as conn:
            conn.execute(
                "UPDATE outbox.messages SET delivered_at = delivered_at - interval '1 day'"
            )
            conn.execute("UPDATE outbox.batches SET claimed_at = claimed_at - interval '1 day'")
        wait_until(
            lambda: (
                _count(database_url, "SELECT count(*) FROM outbox.messages") == 0
                and _count(database_url, "SELECT count(*) FROM outbox.batches") == 0
            ),
            timeout=30,
            what="the delivered messages and their evidence to be purged",
        )
    finally:
        publisher.request_stop()
        runner.join(timeout=30)
    assert not runner.is_alive()
    assert publisher.totals.delivered == len(ids)
    registry = publisher.metrics.registry
    purged = {
        table: registry.get_sample_value("outbox_purged_rows_total", {"table": table})
        for table in ("messages", "attempts", "batches")
    }
    # The deliveries' records were their batches: no attempt rows to purge.
    assert purged["messages"] == len(ids)
    assert purged["attempts"] == 0
    assert purged["batches"] is not None
    assert purged["batches"] >= 1


def _settle_by_hand(url: str, states: dict[uuid.UUID, str]) -> None:
    """Put messages in the given states as a publisher and reconciler would leave them; a
    delivered one was delivered ten days ago."""
    with psycopg.connect(url) as conn:
        for message_id, state in states.items():
            conn.execute(
                "UPDATE outbox.messages SET state = %s, failures = 1,"
                " kafka_partition = CASE WHEN %s = 'delivered' THEN 0 END,"
                " kafka_offset = CASE WHEN %s = 'delivered' THEN seq END,"
                " delivered_at = CASE WHEN %s = 'delivered' THEN now() - interval '10 days' END"
                " WHERE id = %s",
                (state, state, state, state, message_id),
            )


@pytest.mark.parametrize("earlier", ["uncertain", "pending", "quarantined"])
def test_purge_keeps_a_delivered_message_while_an_earlier_one_of_its_key_is_open(
    database_url: str, topic: str, monkeypatch: pytest.MonkeyPatch, earlier: str
) -> None:
    """A delivered message stays while an earlier message of its key (same topic and key) is
    uncertain, pending or quarantined, so the reconciler still sees that the key moved on;
    once the earlier one is decided, both go."""
    first, later, other_key, other_topic = _enqueue(
        database_url,
        monkeypatch,
        [
            outbox.Message(topic, b"1", key="k"),
            outbox.Message(topic, b"2", key="k"),
            outbox.Message(topic, b"3", key="k2"),
            outbox.Message(f"{topic}.other", b"4", key="k"),
        ],
        days_ago=10,
    )
    _settle_by_hand(
        database_url,
        {first: earlier, later: "delivered", other_key: "delivered", other_topic: "delivered"},
    )

    with psycopg.connect(database_url) as conn:
        dry = purge(conn, delivered_older_than=timedelta(days=7), dry_run=True)
        report = purge(conn, delivered_older_than=timedelta(days=7))
    # Another key, or the same key on another topic, is not held by the open message.
    assert dry.messages == report.messages == 2
    left = dict(fetch_rows(database_url, "SELECT id, state FROM outbox.messages"))
    assert left == {first: earlier, later: "delivered"}

    _settle_by_hand(database_url, {first: "delivered"})
    with psycopg.connect(database_url) as conn:
        assert purge(conn, delivered_older_than=timedelta(days=7)).messages == 2
    assert _count(database_url, "SELECT count(*) FROM outbox.messages") == 0


def test_purge_lets_a_discarded_earlier_message_go_unheeded(
    database_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A discarded earlier message is final: it holds nothing, its later delivered one goes."""
    first, later = _enqueue(
        database_url,
        monkeypatch,
        [outbox.Message(topic, b"1", key="k"), outbox.Message(topic, b"2", key="k")],
        days_ago=10,
    )
    _settle_by_hand(database_url, {first: "discarded", later: "delivered"})
    with psycopg.connect(database_url) as conn:
        assert purge(conn, delivered_older_than=timedelta(days=7)).messages == 1
    assert dict(fetch_rows(database_url, "SELECT id, state FROM outbox.messages")) == {
        first: "discarded"
    }


def test_a_dry_run_counts_the_evidence_of_the_messages_it_would_delete(
    database_url: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The evidence of a message the same purge deletes goes in that purge: a dry run counts
    it, and says what the purge then deletes, table by table."""
    [message_id] = _enqueue(database_url, monkeypatch, [outbox.Message(topic, b"v")], days_ago=10)
    _settle_by_hand(database_url, {message_id: "delivered"})
    with psycopg.connect(database_url) as conn:
        # A first attempt that failed and an operator's decision, both ten days ago.
        conn.execute(
            "INSERT INTO outbox.attempts (message_id, attempt, publisher_id, fence, started_at,"
            " finished_at, outcome, error) VALUES (%s, 1, gen_random_uuid(), 1,"
            " now() - interval '10 days', now() - interval '10 days', 'failed', 'refused')",
            (message_id,),
        )
        conn.execute(
            "INSERT INTO outbox.decisions (message_id, decided_at, decided_by, from_state,"
            " to_state, reason) VALUES (%s, now() - interval '10 days', 'ops', 'quarantined',"
            " 'pending', 'fixed')",
            (message_id,),
        )
    week = timedelta(days=7)

    with psycopg.connect(database_url) as conn:
        dry = purge(conn, delivered_older_than=week, evidence_older_than=week, dry_run=True)
        done = purge(conn, delivered_older_than=week, evidence_older_than=week)

    assert (done.messages, done.attempts, done.decisions) == (1, 1, 1)
    assert (dry.messages, dry.attempts, dry.decisions, dry.batches) == (
        done.messages,
        done.attempts,
        done.decisions,
        done.batches,
    )
