"""Per-key order in commit order, and holds that stall only their own key.

Tests that publish run in both delivery modes (in transactional delivery the
consumer reads ``read_committed``); tests of the claim and of the operator's
commands alone send nothing, and run once.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC

import psycopg
import pytest

import outbox
from outbox.states import State
from publisher.app import build_publisher
from publisher.outcomes import AttemptOutcome
from publisher.store import Settlement
from publisher.testing import config_for_tests
from tests.support import (
    DELIVERY_MODES,
    claiming_store,
    count_by_state,
    failed_for_retry,
    fetch_rows,
    make_uncertain,
    publish_until_idle,
    read_topic,
    reads_committed,
    run_outbox_cli,
    submit_until_waiting,
    wait_until,
)

pytestmark = pytest.mark.integration


def _values_by_key(
    kafka_bootstrap: str, topic: str, delivery: str = "idempotent"
) -> dict[bytes | None, list[bytes]]:
    """Each key's values in the order a consumer reads them (read_committed in
    transactional delivery)."""
    records = read_topic(kafka_bootstrap, topic, committed=reads_committed(delivery))
    by_key: dict[bytes | None, list[bytes]] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        by_key.setdefault(r.key, []).append(r.value)
    return by_key


def _outbox(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_outbox_cli(url, *args)


@pytest.mark.parametrize("delivery", DELIVERY_MODES)
def test_same_key_reaches_kafka_in_commit_order_not_allocation_order(
    database_url: str, kafka_bootstrap: str, topic: str, delivery: str
) -> None:
    """The transaction that enqueues a key second waits for the first, so order is commit order.

    Without the per-key lock, the second transaction would take its id after
    the first and could commit before it; a publisher reading in id order
    would then send them in the wrong order, or skip the later commit.
    """
    name = f"second-{uuid.uuid4().hex[:8]}"
    first = psycopg.connect(database_url)
    second = psycopg.connect(database_url, application_name=name)
    try:
        outbox.enqueue(first, topic, b"first", key="account-1")
        outbox.enqueue(second, topic, b"other key", key="account-2")  # no wait: another key
        with ThreadPoolExecutor(1) as pool:
            late = submit_until_waiting(
                pool,
                database_url,
                name,
                "the second transaction to wait for the first",
                outbox.enqueue,
                second,
                topic,
                b"second",
                key="account-1",
            )
            first.commit()
            late.result(timeout=10)
        second.commit()
    finally:
        first.close()
        second.close()
    publish_until_idle(database_url, kafka_bootstrap, delivery=delivery)
    assert _values_by_key(kafka_bootstrap, topic, delivery)[b"account-1"] == [b"first", b"second"]


@pytest.mark.parametrize("delivery", DELIVERY_MODES)
def test_concurrent_writers_keep_each_keys_order(
    database_url: str, kafka_bootstrap: str, topic: str, delivery: str
) -> None:
    """Eight writers on three hot keys: each key's records are in the order they committed."""
    committed: dict[str, list[int]] = {"hot-0": [], "hot-1": [], "hot-2": []}

    def writer(w: int) -> None:
        with psycopg.connect(database_url) as conn:
            for i in range(60):
                key = f"hot-{(w + i) % 3}"
                with conn.transaction():
                    outbox.enqueue(conn, topic, json.dumps([w, i]), key=key)
                    # Taken while the key's enqueue lock is held, so this list
                    # is in the key's commit order.
                    committed[key].append(w * 1000 + i)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(writer, range(8)))
    publish_until_idle(database_url, kafka_bootstrap, batch_size=50, delivery=delivery)
    by_key = _values_by_key(kafka_bootstrap, topic, delivery)
    for key, order in committed.items():
        read = [w * 1000 + i for w, i in (json.loads(v) for v in by_key[key.encode()])]
        assert read == order, key


def _quarantine_head(database_url: str, topic: str, key: str) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """Enqueue three messages of ``key`` and quarantine the first, as the publisher would."""
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(
            conn, [outbox.Message(topic, f"{key}-{i}", key=key) for i in range(3)]
        )
    store = claiming_store(database_url)
    batch = store.claim(1, lease_seconds=30)
    assert batch is not None
    assert [m.id for m in batch.messages] == ids[:1]
    store.settle(
        batch,
        [
            Settlement(
                ids[0],
                batch.messages[0].fence,
                State.QUARANTINED,
                AttemptOutcome.FAILED,
                error="MessageSizeTooLargeError: too big",
                send_began=True,
            )
        ],
    )
    store.close()
    return ids[0], ids[1:]


@pytest.mark.parametrize("delivery", DELIVERY_MODES)
def test_quarantined_message_holds_its_key_only_until_retried(
    database_url: str, kafka_bootstrap: str, topic: str, delivery: str
) -> None:
    """Later messages of a quarantined one's key wait, every other key flows; retry releases it."""
    held_by, waiting = _quarantine_head(database_url, topic, "stuck")
    with psycopg.connect(database_url) as conn:
        free = outbox.enqueue_many(
            conn,
            [outbox.Message(topic, f"free-{i}", key=f"free-{i % 2}") for i in range(4)]
            + [outbox.Message(topic, b"unkeyed") for _ in range(2)],
        )
    publisher = build_publisher(config_for_tests(database_url, kafka_bootstrap, delivery=delivery))
    publisher.run()
    assert count_by_state(database_url) == {"quarantined": 1, "pending": 2, "delivered": 6}
    # The publisher's hold pass took the two waiting messages out of its claims' way.
    assert fetch_rows(database_url, "SELECT id FROM outbox.messages WHERE held ORDER BY seq") == [
        (i,) for i in waiting
    ]
    counted = {
        event: publisher.metrics.registry.get_sample_value(
            "outbox_held_messages_total", {"event": event}
        )
        for event in ("held", "released")
    }
    assert counted == {"held": 2, "released": 0}
    committed = reads_committed(delivery)
    assert {r.outbox_id for r in read_topic(kafka_bootstrap, topic, committed=committed)} == set(
        free
    )

    running = claiming_store(database_url)  # a publisher holding lanes: one is running
    try:
        only_held = _outbox(database_url, "status", "--json")
        with psycopg.connect(database_url) as conn:
            outbox.enqueue(conn, topic, b"enqueued after the run")
        status = _outbox(database_url, "status", "--json")
    finally:
        running.close()
    [pending] = [s for s in json.loads(only_held.stdout)["states"] if s["state"] == "pending"]
    assert pending["next_action"] == (
        "2 of them marked held behind an uncertain or quarantined message of their key "
        "(outbox.held_keys; that state's line says what to do)"
    )
    assert status.returncode == 1
    [pending] = [s for s in json.loads(status.stdout)["states"] if s["state"] == "pending"]
    assert (pending["messages"], pending["healthy"]) == (3, True)
    assert pending["next_action"] == (
        "2 of them marked held behind an uncertain or quarantined message of their key "
        "(outbox.held_keys; that state's line says what to do); the others: none, a "
        "publisher will claim them"
    )
    [held] = json.loads(status.stdout)["held_keys"]
    assert held["key"] == "stuck"
    assert held["held_by"] == str(held_by)
    assert held["waiting"] == 2
    assert "MessageSizeTooLargeError" in held["reason"]
    assert "outbox retry" in held["next_action"]
    assert "HELD KEYS (1)" in _outbox(database_url, "status").stdout

    retried = _outbox(database_url, "retry", str(held_by), "--reason", "topic limit raised")
    assert retried.returncode == 0, retried.stderr
    publish_until_idle(database_url, kafka_bootstrap, delivery=delivery)
    assert _values_by_key(kafka_bootstrap, topic, delivery)[b"stuck"] == [
        b"stuck-0",
        b"stuck-1",
        b"stuck-2",
    ]
    with psycopg.connect(database_url) as conn:
        decision = conn.execute(
            "SELECT from_state, to_state, reason FROM outbox.decisions WHERE message_id = %s",
            (held_by,),
        ).fetchall()
    assert decision == [("quarantined", "pending", "topic limit raised")]
    assert waiting
    assert count_by_state(database_url) == {"delivered": 10}  # and the one enqueued after the run


@pytest.mark.parametrize("delivery", DELIVERY_MODES)
def test_discarding_the_holder_lets_its_key_go_on_without_it(
    database_url: str, kafka_bootstrap: str, topic: str, delivery: str
) -> None:
    """An operator discards the quarantined head: the rest of its key is delivered, in order."""
    held_by, _ = _quarantine_head(database_url, topic, "stuck")
    result = _outbox(database_url, "discard", str(held_by), "--reason", "obsolete event")
    assert result.returncode == 0, result.stderr
    publish_until_idle(database_url, kafka_bootstrap, delivery=delivery)
    assert _values_by_key(kafka_bootstrap, topic, delivery)[b"stuck"] == [b"stuck-1", b"stuck-2"]
    assert count_by_state(database_url) == {"discarded": 1, "delivered": 2}
    refused = _outbox(database_url, "discard", str(held_by), "--reason", "again")
    assert refused.returncode == 2
    assert "is discarded" in refused.stderr


# One mode: the claim alone is checked, and nothing is sent.
def test_retry_backoff_holds_its_key_and_nothing_else(database_url: str) -> None:
    """A message waiting out a retry is not overtaken by later messages of its key."""
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(
            conn,
            [outbox.Message("t", b"a1", key="a"), outbox.Message("t", b"a2", key="a"),
             outbox.Message("t", b"b1", key="b")],
        )  # fmt: skip
    store = claiming_store(database_url)
    first = store.claim(1, lease_seconds=30)
    assert first is not None
    failed = failed_for_retry(
        first.messages[0], retry_after=60, error="KafkaTimeoutError", send_began=False
    )
    store.settle(first, [failed])
    second = store.claim(10, lease_seconds=30)
    store.close()
    assert second is not None
    assert [m.id for m in second.messages] == [ids[2]]  # b1 only: a2 waits behind a1


# One mode: the views alone are read; nothing is sent.
def test_held_keys_give_times_in_utc_and_say_when_no_publisher_runs(database_url: str) -> None:
    """A key held by a retry or an expired lease: the reason gives the time to the second in
    UTC whatever the session's time zone, and the next action says to start a publisher
    while none runs (waiting would wait for ever)."""
    topic = f"held-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(
            conn, [outbox.Message(topic, b"r", key="r"), outbox.Message(topic, b"f", key="f")]
        )
    store = claiming_store(database_url)
    retrying = store.claim(1, lease_seconds=30)
    assert retrying is not None
    assert [m.id for m in retrying.messages] == ids[:1]
    failed = failed_for_retry(
        retrying.messages[0], retry_after=3600, error="KafkaConnectionError: broker away"
    )
    assert store.settle(retrying, [failed]) == {ids[0]}
    in_flight = store.claim(1, lease_seconds=0.2)  # claimed, never settled
    assert in_flight is not None
    assert [m.id for m in in_flight.messages] == ids[1:]
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(
            conn, [outbox.Message(topic, b"r2", key="r"), outbox.Message(topic, b"f2", key="f")]
        )
    held = (
        "SELECT key, reason, next_action, "
        "       (SELECT available_at FROM outbox.messages WHERE id = %s), "
        "       (SELECT lease_expires_at FROM outbox.batches WHERE id = %s) "
        "FROM outbox.held_keys WHERE topic = %s ORDER BY key"
    )

    def read() -> list[tuple[bytes, str, str, str]]:
        with psycopg.connect(database_url) as conn:
            conn.execute("SET TIME ZONE 'Asia/Tokyo'")
            rows = conn.execute(held, (ids[0], in_flight.id, topic)).fetchall()
        utc = "%Y-%m-%d %H:%M:%S UTC"
        return [
            (key, reason, action, (retry if key == b"r" else lease).astimezone(UTC).strftime(utc))
            for key, reason, action, retry, lease in rows
        ]

    def both_held() -> list[tuple[bytes, str, str, str]] | None:
        rows = read()
        return rows if len(rows) == 2 else None  # "f" once its lease has expired

    def status_in_flight() -> str:
        # The status view's in_flight line for the topic says the same as the key.
        [(action,)] = fetch_rows(
            database_url,
            "SELECT next_action FROM outbox.status WHERE topic = %s AND state = 'in_flight'",
            topic,
        )
        return str(action)

    try:
        rows = wait_until(both_held, timeout=10, what="the in-flight lease to expire")
        running = status_in_flight()
    finally:
        store.close()
    assert running == (
        "1 lease(s) expired: their publisher died or stalled; a running publisher recovers "
        "them from their evidence, or run outbox-publisher reconcile"
    )
    assert rows is not None
    [(_, f_reason, f_action, f_at), (_, r_reason, r_action, r_at)] = rows
    assert f_reason == f"in flight, lease expired at {f_at}"
    assert f_action == "wait for recovery, or run outbox-publisher reconcile"
    assert r_reason == f"retry 2 at {r_at}: KafkaConnectionError: broker away"
    assert r_action == "wait for the retry, or outbox discard ID --fence N --reason TEXT"

    # The store gave its lanes back: no publisher runs now.
    [(_, _, f_action, _), (_, _, r_action, _)] = read()
    assert f_action == (
        "no publisher is running to recover it: start outbox-publisher, "
        "or run outbox-publisher reconcile"
    )
    assert r_action == (
        "no publisher is running to retry it: start outbox-publisher; "
        "or outbox discard ID --fence N --reason TEXT"
    )
    assert status_in_flight() == (
        "1 lease(s) expired and no publisher is running to recover them: start "
        "outbox-publisher, or run outbox-publisher reconcile"
    )


# One mode: the views alone are read; nothing is sent.
def test_held_keys_name_an_uncertain_holders_next_action_in_the_status_views_order(
    database_url: str,
) -> None:
    """Escalated first, then no publisher, then the reconciler's note, then overdue, then
    wait: the order of the status view's uncertain line, so the two never disagree."""
    topic = f"held-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url) as conn:
        [holder] = outbox.enqueue_many(conn, [outbox.Message(topic, b"u1", key="u")])
    make_uncertain(database_url, write_deadline_seconds=3600)
    with psycopg.connect(database_url) as conn:
        outbox.enqueue(conn, topic, b"u2", key="u")

    def action(change: str = "") -> str:
        with psycopg.connect(database_url) as conn:
            if change:
                conn.execute(f"UPDATE outbox.messages SET {change} WHERE id = %s", (holder,))
            [(next_action,)] = conn.execute(
                "SELECT next_action FROM outbox.held_keys WHERE topic = %s", (topic,)
            ).fetchall()
            return str(next_action)

    store = claiming_store(database_url)  # a publisher holding lanes: one is running
    try:
        waiting = action()
        overdue = action("available_at = now() - interval '6 minutes'")
        noted = action("last_error = 'reconciliation waits: the producer session s could not'")
    finally:
        store.close()
    stopped = action()
    escalated = action("escalated_at = now()")
    assert waiting == "wait for reconciliation, or run outbox-publisher reconcile"
    assert overdue.startswith("undecided 5 minutes past its write deadline: check that publ")
    assert noted.startswith("do what the reason says: ")
    assert stopped.startswith("no publisher is running to reconcile it: ")
    assert escalated.startswith("decide with outbox resolve ID --fence N")


# One mode: an operator's command on the database; nothing is sent.
def test_retry_quarantined_by_topic_moves_only_that_topic(database_url: str) -> None:
    """retry --quarantined --topic T sends T's quarantined messages again, and no others."""
    held_t, _ = _quarantine_head(database_url, "t1", "k")
    held_u, _ = _quarantine_head(database_url, "t2", "k")
    result = _outbox(database_url, "retry", "--quarantined", "--topic", "t1")
    assert result.returncode == 0, result.stderr
    assert "1 quarantined message(s) of topic t1 -> pending" in result.stdout
    with psycopg.connect(database_url) as conn:
        states: dict[uuid.UUID, str] = dict(conn.execute(
            "SELECT id, state FROM outbox.messages WHERE id = ANY(%s)", ([held_t, held_u],)
        ).fetchall())  # fmt: skip
    assert states == {held_t: "pending", held_u: "quarantined"}
    [(decided_by, login)] = fetch_rows(
        database_url, "SELECT decided_by, session_user FROM outbox.decisions"
    )
    assert decided_by.startswith("operator ")
    assert decided_by.endswith(f" (database user {login})")


# One mode: an operator's command on the database; nothing is sent.
def test_retry_quarantined_needs_a_reason_and_changes_nothing_without_one(
    database_url: str,
) -> None:
    """An empty --reason is refused (exit 2), as for one message; nothing moves."""
    held, _ = _quarantine_head(database_url, "t1", "k")
    result = _outbox(database_url, "retry", "--quarantined", "--reason", " ")
    assert result.returncode == 2
    assert "a decision needs a reason (--reason)" in result.stderr
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT state FROM outbox.messages WHERE id = %s", (held,)).fetchone()
        decisions = conn.execute("SELECT count(*) FROM outbox.decisions").fetchone()
    assert row == ("quarantined",)
    assert decisions == (0,)
