"""Reading the ``outbox.status`` view: counts by state and the next safe action."""

from __future__ import annotations

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
