"""Decisions an operator takes by hand (resolve, retry, discard), each recorded with its reason.

Every decision moves one message by a conditional update on its current
state and writes a row to ``outbox.decisions`` saying who decided what, when
and why, in the same transaction.
"""

from __future__ import annotations

import getpass
import socket
import uuid
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from outbox.errors import OutboxError
from outbox.queries import query
from outbox.states import State


class Resolution(StrEnum):
    """What ``outbox resolve`` can decide about an uncertain message."""

    #: The record is in Kafka (the operator checked): stop worrying about it.
    DELIVERED = "delivered"
    #: The record is not in Kafka: send it (again).
    PENDING = "pending"
    #: Do not deliver it at all.
    DISCARD = "discarded"


#: The states an operator may resolve a message from.
RESOLVABLE = (State.UNCERTAIN, State.QUARANTINED)


class DecisionRefused(OutboxError):
    """The message does not exist or is not in a state this decision applies to."""


def operator_name() -> str:
    """Who is deciding, as recorded in ``outbox.decisions.decided_by``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"operator {user}@{socket.gethostname()}"


def resolve(
    conn: psycopg.Connection[Any],
    message_id: uuid.UUID,
    resolution: Resolution,
    reason: str,
    *,
    partition: int | None = None,
    offset: int | None = None,
    decided_by: str | None = None,
) -> State:
    """Move an uncertain (or quarantined) message as the operator decided; return its old state.

    Raises ``DecisionRefused`` naming the message's actual state when it is
    not one of ``RESOLVABLE``, and ``ValueError`` for an empty reason.
    """
    if resolution is not Resolution.DELIVERED and (partition is not None or offset is not None):
        raise ValueError("--partition and --offset only go with --delivered")
    return _decide(
        conn,
        message_id,
        State(resolution.value),
        RESOLVABLE,
        reason,
        partition=partition,
        offset=offset,
        decided_by=decided_by,
        action="resolved",
    )


def retry(
    conn: psycopg.Connection[Any],
    message_id: uuid.UUID,
    reason: str = "retried by an operator",
    *,
    decided_by: str | None = None,
) -> State:
    """Send a quarantined message again, with a fresh retry budget; return its old state."""
    return _decide(
        conn,
        message_id,
        State.PENDING,
        (State.QUARANTINED,),
        reason,
        decided_by=decided_by,
        action="retried",
    )


def retry_quarantined(
    conn: psycopg.Connection[Any],
    *,
    topic: str | None = None,
    reason: str = "retried by an operator",
    decided_by: str | None = None,
) -> list[uuid.UUID]:
    """Send every quarantined message (of ``topic``, or all) again; return their ids."""
    if not reason.strip():
        raise ValueError("a decision needs a reason (--reason)")
    with conn.transaction():
        rows = conn.execute(
            query("retry_quarantined"),
            {"topic": topic, "reason": reason, "decided_by": decided_by or operator_name()},
        ).fetchall()
    return [row[0] for row in rows]


#: The states an operator may discard a message from.
DISCARDABLE = (State.PENDING, State.QUARANTINED, State.UNCERTAIN)


def discard(
    conn: psycopg.Connection[Any],
    message_id: uuid.UUID,
    reason: str,
    *,
    decided_by: str | None = None,
) -> State:
    """Decide that a message will never be delivered; return its old state.

    This releases its key: later messages of the key go on without it.
    """
    return _decide(
        conn,
        message_id,
        State.DISCARDED,
        DISCARDABLE,
        reason,
        decided_by=decided_by,
        action="discarded",
    )


def _decide(
    conn: psycopg.Connection[Any],
    message_id: uuid.UUID,
    to_state: State,
    from_states: tuple[State, ...],
    reason: str,
    *,
    partition: int | None = None,
    offset: int | None = None,
    decided_by: str | None = None,
    action: str,
) -> State:
    if not reason.strip():
        raise ValueError("a decision needs a reason (--reason)")
    evidence: Mapping[str, Any] = {
        k: v for k, v in (("partition", partition), ("offset", offset)) if v is not None
    }
    with conn.transaction():
        # Waits for a claim of the message's lane in progress (see resolve_lock).
        conn.execute(query("resolve_lock"), {"id": message_id})
        row = conn.execute(
            query("resolve_message"),
            {
                "id": message_id,
                "to_state": to_state.value,
                "from_states": [s.value for s in from_states],
                "partition": partition,
                "offset": offset,
                "reason": reason,
                "decided_by": decided_by or operator_name(),
                "evidence": Jsonb(dict(evidence)),
            },
        ).fetchone()
    if row is None or row[0] is None:
        raise DecisionRefused(f"no message {message_id}")
    state, moved = State(row[0]), bool(row[1])
    if not moved:
        raise DecisionRefused(
            f"message {message_id} is {state.value}; only "
            f"{' or '.join(s.value for s in from_states)} messages can be {action}"
        )
    return state
