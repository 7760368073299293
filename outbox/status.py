"""Reading the status view: per topic and overall, counts by state and the next safe action.

``outbox.status`` reads the open messages through their partial indexes, so
it answers in milliseconds however many delivered messages retention keeps;
on a large table it estimates the delivered ones (``StatusLine.exact`` is
false on that line). docs/operations.md says which figures are exact.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from outbox.queries import query


@dataclass(frozen=True, slots=True)
class StatusLine:
    """One line of ``outbox.status``: a state, over all topics (``topic`` None) or in one."""

    topic: str | None
    state: str
    messages: int
    oldest_created_at: datetime | None
    #: Seconds since the oldest of these messages was enqueued.
    oldest_age_seconds: float | None
    #: Pending messages waiting out a retry delay.
    waiting_retry: int
    #: Messages that failed at least once since the last operator decision.
    retrying: int
    #: Attempts made on these messages, all told; ``None`` on an estimated line.
    attempts: int | None
    max_failures: int
    #: Publishers holding the in-flight leases.
    lease_owners: list[uuid.UUID]
    next_lease_expiry: datetime | None
    leases_expired: int
    #: Uncertain messages the reconciler could not decide: an operator must.
    escalated: int
    #: Uncertain messages still undecided 5 minutes after they became decidable.
    overdue: int
    #: Keys held back by a message in this state.
    held_keys: int
    live_publishers: int
    #: False when an operator should act on this line.
    healthy: bool
    next_action: str
    #: False when ``messages`` is an estimate: delivered messages on a large table.
    exact: bool = True


def read_status(conn: psycopg.Connection[Any]) -> list[StatusLine]:
    """Every line of ``outbox.status``: first each state over all topics, then per topic.

    Its cost follows the open messages, not the delivered ones: on a large
    table the delivered line is an estimate (``exact`` false).
    """
    with conn.cursor() as cur:
        cur.execute(query("status"))
        return [StatusLine(*row) for row in cur.fetchall()]


@dataclass(frozen=True, slots=True)
class OpenCount:
    """How many messages of one topic are in one open state, the oldest one's age, and
    how many of them are stuck (as ``outbox.status`` counts them)."""

    topic: str
    state: str
    messages: int
    oldest_age_seconds: float | None
    #: Uncertain ones an operator must decide (the reconciler could not).
    escalated: int = 0
    #: Uncertain ones still undecided 5 minutes after they became decidable.
    overdue: int = 0
    #: In-flight ones whose lease expired: recovery has not moved them yet.
    leases_expired: int = 0


def read_open_status(conn: psycopg.Connection[Any]) -> list[OpenCount]:
    """Counts of the open states per topic, read through their partial indexes.

    Cheap enough for every metrics scrape however many delivered messages
    retention keeps; ``read_status`` reads the same, and more: every state,
    held keys, health and the next action.
    """
    with conn.cursor() as cur:
        cur.execute(query("open_status"))
        return [OpenCount(*row) for row in cur.fetchall()]


@dataclass(frozen=True, slots=True)
class HeldKey:
    """A key whose oldest open message cannot move on by itself (``outbox.held_keys``)."""

    topic: str
    key: bytes
    held_by: uuid.UUID
    state: str
    waiting: int
    reason: str
    next_action: str


def read_held_keys(conn: psycopg.Connection[Any]) -> list[HeldKey]:
    """Every held key, the message that holds it, why, and how many messages wait behind it."""
    with conn.cursor() as cur:
        cur.execute(query("held_keys"))
        return [HeldKey(*row) for row in cur.fetchall()]
