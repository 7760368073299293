"""The operator's ``outbox`` command (status, list, inspect) on a database in every state.

One scene is built against the real services: delivered messages, a record
Kafka refused (quarantined) with a later message of its key held behind it,
an uncertain message, an in-flight message whose publisher died, and a
pending message with no publisher running. Then the real CLI reads it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

import outbox
from tests.support import (
    claiming_store,
    failed_for_retry,
    fetch_rows,
    make_uncertain,
    publish_until_idle,
    read_topic,
    run_outbox_cli,
    small_topic,
    wait_until,
)

pytestmark = pytest.mark.acceptance


@dataclass(frozen=True)
class Scene:
    url: str
    topic: str
    small: str
    delivered: list[uuid.UUID]
    quarantined: uuid.UUID
    held: uuid.UUID
    uncertain: uuid.UUID
    retrying: uuid.UUID
    in_flight: uuid.UUID
    dead_publisher: uuid.UUID
    pending: uuid.UUID


def _enqueue(url: str, topic: str, key: str, value: bytes = b"v") -> uuid.UUID:
    with psycopg.connect(url) as conn:
        return outbox.enqueue(conn, topic=topic, key=key, value=value)


@pytest.fixture
def scene(database_url: str, kafka_bootstrap: str, topic: str) -> Scene:
    small = small_topic(kafka_bootstrap)
    delivered = [_enqueue(database_url, topic, f"d{i}") for i in range(5)]
    totals = publish_until_idle(database_url, kafka_bootstrap)
    assert (totals.delivered, totals.quarantined) == (5, 0)
    # Sent on its own: a refusal that kafka-python reports for a batch with
    # records of other partitions in flight is not pinned on any one of them
    # (docs/design.md), and the story below is of a message refused alone.
    quarantined = _enqueue(database_url, small, "big", b"x" * 5000)
    totals = publish_until_idle(database_url, kafka_bootstrap)
    assert (totals.delivered, totals.quarantined) == (0, 1)
    held = _enqueue(database_url, small, "big", b"small")  # behind the refused record

    uncertain = _enqueue(database_url, topic, "u")
    # Sent, then the broker went silent; its producer may write for an hour.
    make_uncertain(database_url, write_deadline_seconds=3600)

    retrying = _enqueue(database_url, topic, "r")
    in_flight = _enqueue(database_url, topic, "f")
    store = claiming_store(database_url)
    batch = store.claim(1, lease_seconds=0.5)
    assert batch is not None
    assert [m.id for m in batch.messages] == [retrying]
    # The broker was away for the first: it waits out a long retry delay.
    failed = failed_for_retry(
        batch.messages[0], retry_after=3600, error="KafkaConnectionError: broker away"
    )
    assert store.settle(batch, [failed]) == {retrying}
    # The second is claimed, and never settled.
    batch = store.claim(10, lease_seconds=0.5)
    assert batch is not None
    assert [m.id for m in batch.messages] == [in_flight]
    dead_publisher = store.publisher_id
    store.close()  # the publisher "dies": its lanes go, its lease runs out

    pending = _enqueue(database_url, topic, "p")
    wait_until(
        lambda: fetch_rows(
            database_url,
            "SELECT 1 FROM outbox.message_status "
            "WHERE state = 'in_flight' AND lease_expires_at < now()",
        ),
        timeout=10,
        what="the in-flight lease to expire",
    )
    return Scene(
        database_url,
        topic,
        small,
        delivered,
        quarantined,
        held,
        uncertain,
        retrying,
        in_flight,
        dead_publisher,
        pending,
    )


def _json(scene: Scene, *args: str, code: int) -> Any:
    result = run_outbox_cli(scene.url, *args, "--json")
    assert result.returncode == code, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def test_status_shows_every_state_per_topic_and_overall_with_the_next_action(
    scene: Scene,
) -> None:
    """Every line of the view: counts, ages, leases, retries, held keys, health and action."""
    report = _json(scene, "status", code=1)
    assert report["healthy"] is False
    assert report["live_publishers"] == 0
    assert report["counts"] == {
        "pending": 3,
        "in_flight": 1,
        "delivered": 5,
        "uncertain": 1,
        "quarantined": 1,
        "discarded": 0,
    }
    lines = {line["state"]: line for line in report["states"]}
    assert all(line["topic"] is None for line in report["states"])

    pending = lines["pending"]
    assert pending["healthy"] is False
    assert (pending["waiting_retry"], pending["retrying"], pending["max_failures"]) == (1, 1, 1)
    assert "no publisher is running" in pending["next_action"]
    assert pending["oldest_age_seconds"] > 0

    in_flight = lines["in_flight"]
    assert in_flight["lease_owners"] == [str(scene.dead_publisher)]
    assert in_flight["leases_expired"] == 1
    assert in_flight["next_lease_expiry"] is not None
    assert in_flight["healthy"] is False
    assert in_flight["next_action"] == (
        "1 lease(s) expired and no publisher is running to recover them: start "
        "outbox-publisher, or run outbox-publisher reconcile"
    )

    uncertain = lines["uncertain"]
    assert (uncertain["messages"], uncertain["escalated"], uncertain["healthy"]) == (1, 0, False)
    assert "outbox-publisher reconcile" in uncertain["next_action"]

    quarantined = lines["quarantined"]
    assert quarantined["held_keys"] == 1
    assert quarantined["attempts"] == 1
    assert quarantined["retrying"] == 0  # refused for what it is: not retried
    assert "outbox retry ID" in quarantined["next_action"]

    assert lines["delivered"]["healthy"] is True
    assert lines["delivered"]["next_action"] == "none"
    assert lines["discarded"]["messages"] == 0

    # Per topic: the states that have messages, with the same figures.
    assert {line["state"]: line["messages"] for line in report["topics"][scene.topic]} == {
        "pending": 2,
        "in_flight": 1,
        "delivered": 5,
        "uncertain": 1,
    }
    assert {line["state"]: line["messages"] for line in report["topics"][scene.small]} == {
        "pending": 1,
        "quarantined": 1,
    }
    [held] = report["held_keys"]
    assert (held["topic"], held["key"], held["held_by"], held["waiting"]) == (
        scene.small,
        "big",
        str(scene.quarantined),
        1,
    )

    # The same through plain SQL: one query answers it.
    with psycopg.connect(scene.url) as conn:
        rows = conn.execute(
            "SELECT state, messages, healthy FROM outbox.status WHERE topic IS NULL"
        ).fetchall()
    assert {state: (n, ok) for state, n, ok in rows} == {
        state: (line["messages"], line["healthy"]) for state, line in lines.items()
    }

    table = run_outbox_cli(scene.url, "status")
    assert table.returncode == 1
    assert table.stdout.startswith("outbox: ACTION NEEDED; 0 publisher(s) holding lanes")
    assert f"IN FLIGHT: 1 message(s) leased by {scene.dead_publisher}" in table.stdout
    assert f"{scene.small} / big: held by {scene.quarantined} (quarantined), 1 waiting" in (
        table.stdout
    )
    assert "BY TOPIC" in table.stdout

    only = _json(scene, "status", "--topic", scene.small, code=1)
    assert only["topic"] == scene.small
    assert only["topics"].keys() == {scene.small}
    # Every state, as over all topics, so that a script reads counts["in_flight"] either way.
    assert only["counts"] == {
        "pending": 1,
        "in_flight": 0,
        "delivered": 0,
        "uncertain": 0,
        "quarantined": 1,
        "discarded": 0,
    }
    assert [h["topic"] for h in only["held_keys"]] == [scene.small]
    one = run_outbox_cli(scene.url, "status", "--topic", scene.topic)
    assert f"TOPIC {scene.topic}" in one.stdout
    assert f"IN FLIGHT: 1 message(s) leased by {scene.dead_publisher}" in one.stdout
    assert "HELD KEYS (" not in one.stdout  # the held key is in the other topic


def test_with_a_publisher_running_waiting_is_healthy_until_it_is_not(scene: Scene) -> None:
    """With a live publisher, pending and fresh uncertain are healthy; overdue or escalated not."""
    store = claiming_store(scene.url)  # a live publisher: it holds every lane
    try:
        report = _json(scene, "status", code=1)  # the expired lease and quarantined remain
        assert report["live_publishers"] == 1
        lines = {line["state"]: line for line in report["states"]}
        assert lines["pending"]["healthy"] is True
        assert lines["pending"]["next_action"] == "none: a publisher will claim them"
        assert lines["uncertain"]["healthy"] is True
        assert lines["uncertain"]["next_action"].startswith("wait: the reconciler decides")

        with psycopg.connect(scene.url) as conn:
            conn.execute(
                "UPDATE outbox.messages SET available_at = now() - interval '10 minutes' "
                "WHERE id = %s",
                (scene.uncertain,),
            )
        overdue = {line["state"]: line for line in _json(scene, "status", code=1)["states"]}
        assert (overdue["uncertain"]["overdue"], overdue["uncertain"]["healthy"]) == (1, False)
        assert (
            "undecided 5 minutes past their write deadline" in (overdue["uncertain"]["next_action"])
        )

        with psycopg.connect(scene.url) as conn:
            conn.execute(
                "UPDATE outbox.messages SET escalated_at = now(), last_error = 'topic deleted' "
                "WHERE id = %s",
                (scene.uncertain,),
            )
        escalated = {line["state"]: line for line in _json(scene, "status", code=1)["states"]}
        assert (escalated["uncertain"]["escalated"], escalated["uncertain"]["healthy"]) == (
            1,
            False,
        )
        assert "1 escalated" in escalated["uncertain"]["next_action"]
        story = _json(scene, "inspect", str(scene.uncertain), code=1)
        assert "outbox resolve ID" in story["next_action"]
    finally:
        store.close()


def test_list_shows_the_messages_of_a_state_oldest_first(scene: Scene) -> None:
    """list --state gives ids with what matters for that state, and says when there are more."""
    listing = _json(scene, "list", "--state", "quarantined", code=0)
    [q] = listing["messages"]
    assert q["id"] == str(scene.quarantined)
    assert "MessageSizeTooLarge" in q["last_error"]
    assert listing["more"] is False

    first = _json(scene, "list", "--state", "delivered", "--limit", "2", code=0)
    assert [m["id"] for m in first["messages"]] == [str(i) for i in scene.delivered[:2]]
    assert first["more"] is True
    assert all(m["kafka_offset"] is not None for m in first["messages"])

    pending = _json(scene, "list", "--state", "pending", "--topic", scene.topic, code=0)
    assert [m["id"] for m in pending["messages"]] == [str(scene.retrying), str(scene.pending)]
    assert pending["messages"][0]["failures"] == 1

    table = run_outbox_cli(scene.url, "list", "--state", "in_flight")
    assert table.returncode == 0
    assert f"leased by {scene.dead_publisher}" in table.stdout

    wrong = run_outbox_cli(scene.url, "list", "--state", "stuck")
    assert wrong.returncode == 2
    assert "invalid State value: 'stuck'" in wrong.stderr or "stuck" in wrong.stderr


def _assert_inspect_agrees_with_status(scene: Scene) -> None:
    """inspect needs action for a message exactly when status calls its state's line
    unhealthy (the scene has one open message a state, or only pending ones)."""
    healthy = {
        line["state"]: line["healthy"]
        for line in _json(scene, "status", code=1)["states"]  # quarantined: always 1
    }
    for message_id in (scene.quarantined, scene.held, scene.uncertain, scene.retrying,
                       scene.in_flight, scene.pending, scene.delivered[0]):  # fmt: skip
        result = run_outbox_cli(scene.url, "inspect", str(message_id), "--json")
        story = json.loads(result.stdout)
        assert story["needs_action"] is (not healthy[story["state"]]), story["next_action"]
        assert result.returncode == (1 if story["needs_action"] else 0)


def test_inspect_tells_each_message_story_and_the_next_safe_action(
    scene: Scene, kafka_bootstrap: str
) -> None:
    """inspect: enqueue, attempts with publisher and fence, outcome, decisions; exit 1 if needed."""
    quarantined = _json(scene, "inspect", str(scene.quarantined), code=1)
    assert quarantined["state"] == "quarantined"
    assert quarantined["needs_action"] is True
    [attempt] = quarantined["attempts"]
    assert attempt["outcome"] == "failed"
    assert "MessageSizeTooLarge" in attempt["error"]
    assert attempt["fence"] == 1
    assert attempt["publisher_id"] is not None
    assert attempt["host"]
    events = [e["event"] for e in quarantined["timeline"]]
    assert events[0] == "enqueued"
    assert "attempt 1 claimed" in events
    assert events[-1] == "attempt 1 failed"

    # No publisher runs in the scene: a pending message needs one started (exit 1).
    held = _json(scene, "inspect", str(scene.held), code=1)
    assert held["held_behind"]["held_by"] == str(scene.quarantined)
    assert f"waits behind message {scene.quarantined}" in held["next_action"]
    assert held["next_action"].endswith("; and no publisher is running: start one")

    uncertain = _json(scene, "inspect", str(scene.uncertain), code=1)
    assert uncertain["current_claim"]["send_began_at"] is not None
    assert uncertain["attempts"][0]["outcome"] == "uncertain"
    assert uncertain["next_action"] == (
        "no publisher is running to reconcile it: start outbox-publisher, "
        "or run outbox-publisher reconcile"
    )

    in_flight = _json(scene, "inspect", str(scene.in_flight), code=1)  # its lease expired
    assert in_flight["current_claim"]["publisher_id"] == str(scene.dead_publisher)
    assert any("(in flight)" in e["event"] for e in in_flight["timeline"])
    assert in_flight["next_action"] == (
        "its lease expired and no publisher is running to recover it: start "
        "outbox-publisher, or run outbox-publisher reconcile"
    )
    pending = _json(scene, "inspect", str(scene.pending), code=1)
    assert pending["next_action"] == ("no publisher is running to claim it: start outbox-publisher")
    _assert_inspect_agrees_with_status(scene)

    # With a publisher running, waiting for it needs nobody (exit 0), as in outbox status;
    # an expired lease still does, until it is recovered, and so does an overdue message.
    store = claiming_store(scene.url)  # a live publisher: it holds every lane
    try:
        running = {
            name: _json(scene, "inspect", str(message_id), code=code)["next_action"]
            for name, message_id, code in (
                ("uncertain", scene.uncertain, 0),
                ("in_flight", scene.in_flight, 1),
                ("pending", scene.pending, 0),
                ("held", scene.held, 0),
            )
        }
        _assert_inspect_agrees_with_status(scene)
        for minutes, code in ((4, 0), (6, 1)):  # the view's overdue: 5 minutes past
            with psycopg.connect(scene.url) as conn:
                conn.execute(
                    "UPDATE outbox.messages SET available_at = now() - make_interval(mins => %s) "
                    "WHERE id = %s",
                    (minutes, scene.uncertain),
                )
            late = _json(scene, "inspect", str(scene.uncertain), code=code)
            _assert_inspect_agrees_with_status(scene)
    finally:
        store.close()
    assert running["uncertain"].startswith("wait: the reconciler decides it")
    assert running["in_flight"] == (
        "its lease expired: its publisher died or stalled; a running publisher recovers it "
        "from its evidence, or run outbox-publisher reconcile"
    )
    assert running["pending"] == "none: a publisher will claim it"
    assert running["held"].endswith("act on that one")
    assert late["next_action"] == (
        "undecided 5 minutes past its write deadline: check that publishers reconcile "
        "(--reconcile-interval above 0) and reach Kafka, or run outbox-publisher reconcile"
    )

    delivered = _json(scene, "inspect", str(scene.delivered[0]), code=0)
    records = read_topic(kafka_bootstrap, scene.topic)
    [record] = [r for r in records if r.outbox_id == scene.delivered[0]]
    assert delivered["held_behind"] is None
    # A delivery writes no attempt row; inspect tells it from its batch, as an attempt.
    [attempt] = delivered["attempts"]
    assert (attempt["outcome"], attempt["kafka_partition"], attempt["kafka_offset"]) == (
        "delivered",
        record.partition,
        record.offset,
    )
    assert (attempt["attempt"], attempt["fence"], attempt["transactional_id"]) == (1, 1, None)
    assert attempt["publisher_id"] is not None
    assert attempt["batch_id"] is not None
    assert [e["event"] for e in delivered["timeline"]][-1] == "attempt 1 delivered"

    # An operator decision joins the timeline with its reason.
    decided = run_outbox_cli(scene.url, "discard", str(scene.quarantined), "--reason", "too big")
    assert decided.returncode == 0, decided.stderr
    after = _json(scene, "inspect", str(scene.quarantined), code=0)
    last = after["timeline"][-1]
    assert last["event"] == "decided quarantined -> discarded"
    assert last["reason"] == "too big"
    assert last["by"].startswith("operator ")
    text = run_outbox_cli(scene.url, "inspect", str(scene.quarantined))
    assert "decided quarantined -> discarded" in text.stdout
    assert "next: none: an operator decided not to deliver it" in text.stdout

    unknown = run_outbox_cli(scene.url, "inspect", str(uuid.uuid4()))
    assert unknown.returncode == 2
    assert "no message" in unknown.stderr
