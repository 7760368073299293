"""Reading the status views: counts by state, held keys, and the next safe action."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from outbox.queries import query


@dataclass(frozen=True, slots=True)
class StateCount:
    """One line of the status view."""

    state: str
    messages: int
    oldest_created_at: datetime | None
    healthy: bool
    next_action: str


def read_status(conn: psycopg.Connection[Any]) -> list[StateCount]:
    """Return one line per state, in lifecycle order, including states with no messages."""
    with conn.cursor() as cur:
        cur.execute(query("status"))
        return [StateCount(*row) for row in cur.fetchall()]


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
