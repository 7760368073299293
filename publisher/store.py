"""The database seam of the publisher: claim, settle, register.

``PublisherStore`` is the only code of the publisher that sends SQL; every
statement comes from ``outbox/queries.sql``. Each method is one statement in
its own transaction (the connection is in autocommit mode), so a lease is
visible to other publishers as soon as it is taken.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from outbox.queries import query
from outbox.states import State


@dataclass(frozen=True, slots=True)
class ClaimedMessage:
    """A message leased to this publisher under ``fence``."""

    id: uuid.UUID
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]
    fence: int
    attempt: int


@dataclass(frozen=True, slots=True)
class Batch:
    """The messages of one claim, in claim order, and when the claim happened."""

    messages: list[ClaimedMessage]
    claimed_at: datetime


@dataclass(frozen=True, slots=True)
class Settlement:
    """The outcome to record for one claimed message."""

    message_id: uuid.UUID
    fence: int
    state: State
    attempt_outcome: str
    partition: int | None = None
    offset: int | None = None
    retry_after: float = 0.0
    error: str | None = None
    send_began: bool = True


class PublisherStore:
    """One publisher's connection to the outbox tables."""

    def __init__(self, conninfo: str, publisher_id: uuid.UUID) -> None:
        self.conninfo = conninfo
        self.publisher_id = publisher_id
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def conn(self) -> psycopg.Connection[Any]:
        """The open connection, reopened if it was closed or broken."""
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.conninfo,
                autocommit=True,
                row_factory=tuple_row,
                application_name=f"outbox-publisher {self.publisher_id}",
            )
        return self._conn

    def close(self) -> None:
        """Close the connection (a later call reopens it)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def register(self, version: str, pid: int) -> None:
        """Record this publisher process in ``outbox.publishers``."""
        self.conn.execute(
            query("register_publisher"),
            {"id": self.publisher_id, "host": socket.gethostname(), "pid": pid, "version": version},
        )

    def heartbeat(self) -> None:
        """Say this publisher is alive."""
        self.conn.execute(query("heartbeat_publisher"), {"id": self.publisher_id})

    def mark_stopped(self) -> None:
        """Record a clean stop."""
        self.conn.execute(query("stop_publisher"), {"id": self.publisher_id})

    def claim(self, limit: int, lease_seconds: float) -> Batch | None:
        """Lease up to ``limit`` pending messages in one statement; ``None`` if none."""
        rows = self.conn.execute(
            query("claim_batch"),
            {"limit": limit, "owner": self.publisher_id, "lease_seconds": lease_seconds},
        ).fetchall()
        if not rows:
            return None
        messages = [
            ClaimedMessage(
                id=row[0],
                topic=row[1],
                key=row[2],
                value=row[3],
                headers=list(zip(row[4], row[5], strict=True)),
                fence=row[6],
                attempt=row[7],
            )
            for row in rows
        ]
        return Batch(messages, claimed_at=rows[0][8])

    def settle(self, batch: Batch, settlements: Sequence[Settlement]) -> set[uuid.UUID]:
        """Record every outcome of a batch in one statement; return the ids it changed.

        A message missing from the result was not in flight under the given
        fence any more: its lease was lost, and this publisher's word on it
        does not count.
        """
        rows = self.conn.execute(
            query("settle_batch"),
            {
                "ids": [s.message_id for s in settlements],
                "fences": [s.fence for s in settlements],
                "states": [s.state.value for s in settlements],
                "outcomes": [s.attempt_outcome for s in settlements],
                "partitions": [s.partition for s in settlements],
                "offsets": [s.offset for s in settlements],
                "retry_after": [float(s.retry_after) for s in settlements],
                "errors": [s.error for s in settlements],
                "send_began": [s.send_began for s in settlements],
                "publisher": self.publisher_id,
                "started_at": batch.claimed_at,
            },
        ).fetchall()
        return {row[0] for row in rows}

    def seconds_until_available(self) -> float | None:
        """Seconds until a pending message becomes claimable; ``None`` if none is pending."""
        row = self.conn.execute(query("seconds_until_available")).fetchone()
        return None if row is None or row[0] is None else float(row[0])
