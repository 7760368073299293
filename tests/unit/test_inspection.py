"""When ``outbox inspect`` says a message needs a person, and its next action (no database).

The rules are the status view's health, one message at a time: ``inspect``
exits 1 exactly when ``outbox status`` would call the message's line
unhealthy.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from outbox.inspection import OVERDUE_AFTER, Timeline
from outbox.states import OVERTAKEN_NOTE

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
SECOND = timedelta(seconds=1)


def _timeline(
    state: str,
    *,
    running: bool = True,
    available_at: datetime = NOW,
    lease_expires_at: datetime | None = None,
    escalated: bool = False,
    held_by: uuid.UUID | None = None,
    last_error: str | None = None,
) -> Timeline:
    message = {
        "state": state,
        "fence": 3,
        "available_at": available_at,
        "lease_expires_at": lease_expires_at,
        "escalated_at": NOW if escalated else None,
        "last_error": last_error,
    }
    held = None if held_by is None else {"held_by": held_by, "state": "quarantined"}
    return Timeline(
        uuid.UUID(int=1),
        message,
        [],
        [],
        None,
        held,
        [],
        publisher_running=running,
        read_at=NOW,
    )


@pytest.mark.parametrize(
    ("timeline", "needs_action"),
    [
        (_timeline("quarantined"), True),
        (_timeline("quarantined", running=False), True),
        (_timeline("delivered", running=False), False),
        (_timeline("discarded", running=False), False),
        # Pending: a running publisher claims it; with none, someone must start one.
        (_timeline("pending"), False),
        (_timeline("pending", available_at=NOW + timedelta(hours=1)), False),  # a retry
        (_timeline("pending", running=False), True),
        (_timeline("pending", held_by=uuid.UUID(int=2)), False),  # its holder needs one
        # In flight: only once its lease expired.
        (_timeline("in_flight", lease_expires_at=NOW + SECOND), False),
        (_timeline("in_flight", lease_expires_at=NOW + SECOND, running=False), False),
        (_timeline("in_flight", lease_expires_at=NOW - SECOND), True),
        # Uncertain: the reconciler decides it while one runs, until it is overdue.
        (_timeline("uncertain", available_at=NOW + timedelta(hours=1)), False),
        (_timeline("uncertain", available_at=NOW - OVERDUE_AFTER + SECOND), False),
        (_timeline("uncertain", available_at=NOW - OVERDUE_AFTER - SECOND), True),
        (_timeline("uncertain", escalated=True), True),
        (_timeline("uncertain", running=False), True),
    ],
)
def test_a_message_needs_a_person_when_its_status_line_would_be_unhealthy(
    timeline: Timeline, needs_action: bool
) -> None:
    assert timeline.needs_action is needs_action


def test_a_purged_message_needs_nobody() -> None:
    purged = Timeline(uuid.UUID(int=1), None, [], [], None, None, [], publisher_running=False)
    assert purged.needs_action is False
    assert purged.next_action.startswith("none: delivered and purged")


@pytest.mark.parametrize(
    ("state", "running_action", "stopped_action"),
    [
        ("pending", "none: a publisher will claim it", "no publisher is running to claim it"),
        ("in_flight", "none while its lease is live", "no publisher is running to recover it"),
        ("uncertain", "wait: the reconciler decides it", "no publisher is running to reconcile"),
    ],
)
def test_the_next_action_of_a_message_waiting_for_a_publisher_says_whether_one_runs(
    state: str, running_action: str, stopped_action: str
) -> None:
    assert _timeline(state).next_action.startswith(running_action)
    assert _timeline(state, running=False).next_action.startswith(stopped_action)


def test_an_uncertain_message_next_action_in_the_status_view_order() -> None:
    """Escalated (only a person decides it), then no publisher, then the reconciler's note
    that it waits on Kafka, then overdue, then wait: the order of the status view's line."""
    note = "reconciliation waits: the producer session ..."
    late = NOW - OVERDUE_AFTER - SECOND
    escalated = _timeline("uncertain", escalated=True, running=False, last_error=note)
    assert escalated.next_action.startswith("the reconciler could not decide it from Kafka")
    assert "--fence 3" in escalated.next_action
    overtaken = _timeline(
        "uncertain", escalated=True, last_error=f"{OVERTAKEN_NOTE}1 (first: ...), written ..."
    )
    assert overtaken.next_action.startswith("its record was never written")
    assert "--delivered would lose it" in overtaken.next_action
    assert "resolve ID --pending --out-of-order --fence 3" in overtaken.next_action
    stopped = _timeline("uncertain", running=False, last_error=note, available_at=late)
    assert stopped.next_action.startswith("no publisher is running to reconcile it")
    waiting = _timeline("uncertain", last_error=note, available_at=late)
    assert waiting.next_action.startswith("do what its last error says")
    overdue = _timeline("uncertain", available_at=late)
    assert overdue.next_action.startswith("undecided 5 minutes past its write deadline")
    assert _timeline("uncertain").next_action.startswith("wait: the reconciler decides it")


def test_an_expired_lease_says_so_whether_or_not_a_publisher_runs() -> None:
    expired = NOW - SECOND
    assert _timeline("in_flight", lease_expires_at=expired).next_action.startswith(
        "its lease expired: its publisher died or stalled; a running publisher recovers it"
    )
    assert _timeline("in_flight", lease_expires_at=expired, running=False).next_action == (
        "its lease expired and no publisher is running to recover it: start "
        "outbox-publisher, or run outbox-publisher reconcile"
    )


def test_a_held_message_points_to_its_holder_and_to_a_missing_publisher() -> None:
    holder = uuid.UUID(int=2)
    running = _timeline("pending", held_by=holder)
    assert running.next_action == (
        f"none here: its key waits behind message {holder} (quarantined); act on that one"
    )
    stopped = _timeline("pending", held_by=holder, running=False)
    assert stopped.next_action == (running.next_action + "; and no publisher is running: start one")
