"""Decisions an operator takes by hand (resolve, retry, discard), each recorded with its reason.

Every decision moves one message by a conditional update on its current
state and writes a row to ``outbox.decisions`` saying who decided what, when
and why, in the same transaction. Who decided is ``decided_by`` (the
caller's words, by default ``operator_name()``) followed by "(database user
<login>)", added by the database: the login it authenticated.

A decision is checked before it takes any lock (``decision_check``): one that
will be refused holds nothing, even in a transaction its caller keeps open.
Only a decision that will apply takes the message's lane lock
(``resolve_lock``, an advisory lock): it waits for a claim of the lane in
progress, so it never races one, and until its transaction ends claims skip
that lane (only that lane: the publisher's other lanes and its heartbeat go
on). If the message changed in between, the decision is refused and its
transaction (or savepoint) rolled back, which releases the lock. Decisions run
only at READ COMMITTED: after waiting for a claim, a decision must see the
batch that claim committed, which a snapshot taken before the wait (REPEATABLE
READ, SERIALIZABLE) would not.

A decision names the fence it was made from (``outbox inspect`` and
``outbox list`` show it) and applies only while the message is still at that
fence: every settle, recovery, reconciler and operator decision raises it, so
a decision made from a stale reading (another operator acted, or a publisher
or the reconciler moved the message) is refused, naming what changed. ``resolve --pending`` and
``--delivered`` require it; the other decisions take it when given.
"""

from __future__ import annotations

import getpass
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from outbox.errors import OutboxError
from outbox.holds import release_held_of
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


class StaleDecision(DecisionRefused):
    """The message changed since the fence the decision was made from."""


class BeforeWriteDeadline(DecisionRefused):
    """Moving the uncertain message to pending now could send it twice, and discarding it
    could let its record land after later messages of its key: the record may still be
    written by the producer that sent it (before its write deadline, or, in transactional
    delivery, until its session is fenced)."""


@dataclass(frozen=True, slots=True)
class _Seen:
    """What ``decision_check`` read about a message."""

    state: str
    fence: int
    attempts: int
    checked_at: datetime
    #: The partition an uncertain message's record was sent to, when known.
    sent_to_partition: int | None
    #: Until when the producer that sent an uncertain message may still write it.
    write_deadline: datetime | None
    #: The Kafka transaction session of an uncertain message, not fenced yet.
    unfenced_session: str | None
    decided_at: datetime | None
    decided_by: str | None
    from_state: str | None
    to_state: str | None


def operator_name() -> str:
    """Who is deciding, as the command's user and host say it; ``outbox.decisions.decided_by``
    records it followed by the database user the decision was taken as."""
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
    fence: int | None = None,
    partition: int | None = None,
    offset: int | None = None,
    force_before_deadline: bool = False,
    decided_by: str | None = None,
) -> State:
    """Move an uncertain (or quarantined) message as the operator decided; return its old state.

    ``fence`` is the message's fence the decision was made from (as ``outbox
    inspect`` showed it); it is required for ``DELIVERED`` and ``PENDING``,
    which act on what the operator saw, and checked when given for
    ``DISCARD``. Raises ``DecisionRefused`` naming the message's actual state
    when it is not one of ``RESOLVABLE``, or when ``partition`` is not the one an
    uncertain message's record was sent to (when its row records one: not after a
    recovery from an expired lease); ``StaleDecision`` naming what
    changed when it is no longer at ``fence``; ``BeforeWriteDeadline`` for
    ``PENDING`` or ``DISCARD`` while the record of an uncertain message may
    still be written (unless ``force_before_deadline``, which risks sending it
    twice, or, discarded, writing it after later messages of its key); and
    ``ValueError`` for an empty reason, a missing fence, or a location that
    is half given or negative.
    """
    check_resolution(
        message_id,
        resolution,
        fence=fence,
        partition=partition,
        offset=offset,
        force_before_deadline=force_before_deadline,
    )
    return _decide(
        conn,
        message_id,
        State(resolution.value),
        RESOLVABLE,
        reason,
        fence=fence,
        partition=partition,
        offset=offset,
        force_before_deadline=force_before_deadline,
        decided_by=decided_by,
        action="resolved",
    )


def check_resolution(
    message_id: uuid.UUID,
    resolution: Resolution,
    *,
    fence: int | None = None,
    partition: int | None = None,
    offset: int | None = None,
    force_before_deadline: bool = False,
) -> None:
    """Raise ``ValueError`` naming what ``resolve`` would refuse in these arguments
    themselves, before it reads anything: a location half given, negative or not
    with ``DELIVERED``, a missing fence, an override that goes with nothing."""
    if resolution is not Resolution.DELIVERED and (partition is not None or offset is not None):
        raise ValueError("--partition and --offset only go with --delivered")
    if (partition is None) is not (offset is None):
        raise ValueError("--partition and --offset go together: where the record is")
    if (partition is not None and partition < 0) or (offset is not None and offset < 0):
        raise ValueError(
            f"--partition and --offset must be 0 or more, got partition {partition}, "
            f"offset {offset}"
        )
    if fence is None and resolution is not Resolution.DISCARD:
        raise ValueError(
            f"--{resolution.value} needs --fence N, the fence `outbox inspect {message_id}` "
            "shows: the decision applies only if the message has not changed since"
        )
    if force_before_deadline and resolution not in (Resolution.PENDING, Resolution.DISCARD):
        raise ValueError("--force-before-deadline only goes with --pending or --discard")


def retry(
    conn: psycopg.Connection[Any],
    message_id: uuid.UUID,
    reason: str = "retried by an operator",
    *,
    fence: int | None = None,
    decided_by: str | None = None,
) -> State:
    """Send a quarantined message again, with a fresh retry budget; return its old state.

    With ``fence``, only if the message is still at that fence (else ``StaleDecision``).
    """
    return _decide(
        conn,
        message_id,
        State.PENDING,
        (State.QUARANTINED,),
        reason,
        fence=fence,
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
        moved = [row[0] for row in rows]
        release_held_of(conn, moved)
    return moved


#: The states an operator may discard a message from.
DISCARDABLE = (State.PENDING, State.QUARANTINED, State.UNCERTAIN)


def discard(
    conn: psycopg.Connection[Any],
    message_id: uuid.UUID,
    reason: str,
    *,
    fence: int | None = None,
    decided_by: str | None = None,
) -> State:
    """Decide that a message will never be delivered; return its old state.

    This releases its key: later messages of the key go on without it. With
    ``fence``, only if the message is still at that fence (else ``StaleDecision``).
    """
    return _decide(
        conn,
        message_id,
        State.DISCARDED,
        DISCARDABLE,
        reason,
        fence=fence,
        decided_by=decided_by,
        action="discarded",
    )


@dataclass(frozen=True, slots=True)
class _Decision:
    """One decision as asked, for checking it against what the message is now."""

    message_id: uuid.UUID
    to_state: State
    from_states: tuple[State, ...]
    action: str
    fence: int | None
    force_before_deadline: bool
    #: Where the operator found the record (``resolve --delivered --partition``).
    partition: int | None = None


def _decide(
    conn: psycopg.Connection[Any],
    message_id: uuid.UUID,
    to_state: State,
    from_states: tuple[State, ...],
    reason: str,
    *,
    fence: int | None = None,
    partition: int | None = None,
    offset: int | None = None,
    force_before_deadline: bool = False,
    decided_by: str | None = None,
    action: str,
) -> State:
    if not reason.strip():
        raise ValueError("a decision needs a reason (--reason)")
    decision = _Decision(
        message_id, to_state, from_states, action, fence, force_before_deadline, partition
    )
    evidence: Mapping[str, Any] = {
        k: v for k, v in (("partition", partition), ("offset", offset)) if v is not None
    }
    # A decision the override let through says so in its evidence (resolve_message).

    def refuse_unless_allowed() -> None:
        # Raised inside the transaction block, a refusal rolls it (or its
        # savepoint) back: a lock taken by resolve_lock is released with it.
        with conn.cursor(row_factory=class_row(_Seen)) as cur:
            seen = cur.execute(query("decision_check"), {"id": message_id}).fetchone()
        refusal = _refusal(decision, seen)
        if refusal is not None:
            raise refusal

    with conn.transaction():
        _require_read_committed(conn)
        # Checked first without a lock: a refused decision never holds one.
        refuse_unless_allowed()
        # Waits for a claim of the message's lane in progress (see resolve_lock).
        conn.execute(query("resolve_lock"), {"id": message_id})
        row = conn.execute(
            query("resolve_message"),
            {
                "id": message_id,
                "to_state": to_state.value,
                "from_states": [s.value for s in from_states],
                "fence": fence,
                "force_before_deadline": force_before_deadline,
                "partition": partition,
                "offset": offset,
                "reason": reason,
                "decided_by": decided_by or operator_name(),
                "evidence": Jsonb(dict(evidence)),
            },
        ).fetchone()
        if row is None or row[0] is None or not row[1]:
            # It changed between the check and the lock: say how, now.
            refuse_unless_allowed()
            raise DecisionRefused(f"message {message_id} changed while the decision was taken")
        # What waited behind it goes on with it (see outbox.holds).
        release_held_of(conn, [message_id])
    return State(row[0])


def _require_read_committed(conn: psycopg.Connection[Any]) -> None:
    """Refuse a decision in a transaction whose snapshot would not see a claim it waited for."""
    row = conn.execute(query("transaction_isolation")).fetchone()
    isolation = row[0] if row is not None else None
    if isolation != "read committed":
        raise DecisionRefused(
            f"operator decisions run at READ COMMITTED, and this transaction is {isolation}: "
            "its snapshot would not see a claim the decision waits for, so it could move a "
            "message that is being sent. Use a connection at READ COMMITTED "
            "(psycopg: conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED)"
        )


def _refusal(decision: _Decision, seen: _Seen | None) -> DecisionRefused | None:
    """Why ``decision`` must not apply to the message as ``seen``, or None when it may."""
    message_id, fence = decision.message_id, decision.fence
    if seen is None:
        return DecisionRefused(f"no message {message_id}")
    changed = fence is not None and seen.fence != fence
    never = fence is not None and fence > seen.fence  # a fence it never had: a typo
    if seen.state not in decision.from_states:
        since = (
            f" (it was never at fence {fence}: {_what_changed(seen)})"
            if never
            else f" (it changed since fence {fence}: {_what_changed(seen)})"
            if changed
            else ""
        )
        return DecisionRefused(
            f"message {message_id} is {seen.state}; only "
            f"{' or '.join(s.value for s in decision.from_states)} messages can be "
            f"{decision.action}{since}"
        )
    if changed:
        made_from = (
            f"was never at fence {fence}, the fence this decision names"
            if never
            else f"changed since fence {fence}, the fence this decision was made from"
        )
        return StaleDecision(
            f"message {message_id} {made_from}: {_what_changed(seen)}; run "
            f"`outbox inspect {message_id}` and decide again from what it shows now"
        )
    if (
        decision.partition is not None
        and seen.sent_to_partition is not None
        and decision.partition != seen.sent_to_partition
    ):
        return DecisionRefused(
            f"message {message_id} was sent to partition {seen.sent_to_partition}: the send "
            f"it is uncertain from wrote its record there or nowhere, not in partition "
            f"{decision.partition}. Look for its outbox-id header in partition "
            f"{seen.sent_to_partition}; a copy you wrote elsewhere yourself (the topic was "
            "recreated) is recorded by --delivered without --partition and --offset, with "
            "where it is in --reason"
        )
    if (
        decision.to_state in _WAITS_FOR_THE_WRITE_DEADLINE
        and seen.state == State.UNCERTAIN
        and not decision.force_before_deadline
    ):
        return _before_write_deadline(message_id, seen, decision.to_state)
    return None


#: What an uncertain message may become only once its record can no longer be
#: written, what doing it sooner risks (sent again, a second copy; discarded, its
#: key released while the record may still land after later messages of the key),
#: and the command that overrides the check.
_WAITS_FOR_THE_WRITE_DEADLINE = {
    State.PENDING: ("sending it again now may deliver it twice", "--force-before-deadline"),
    State.DISCARDED: (
        "discarding it now releases its key while its record may still be written, after "
        "later messages of the key (and a discarded message would then be delivered)",
        "`outbox resolve {id} --discard --force-before-deadline --reason TEXT`",
    ),
}


def _before_write_deadline(
    message_id: uuid.UUID, seen: _Seen, to_state: State
) -> BeforeWriteDeadline | None:
    """Refuse moving an uncertain message on while its record may still be written."""
    risk, override = _WAITS_FOR_THE_WRITE_DEADLINE[to_state]
    override = override.format(id=message_id)
    if seen.unfenced_session is not None:
        return BeforeWriteDeadline(
            f"message {message_id} was sent in the Kafka transaction of producer session "
            f"{seen.unfenced_session}, which has not been fenced: that session may still "
            f"commit its record, and {risk}. Run `outbox-publisher reconcile`: it fences the "
            f"session and decides the message from what Kafka committed ({override} overrides "
            "this check, unsafely)"
        )
    if seen.write_deadline is not None and seen.write_deadline > seen.checked_at:
        return BeforeWriteDeadline(
            f"message {message_id} may still be written by the producer that sent it until "
            f"{seen.write_deadline.isoformat()} (its write deadline): {risk}. Decide it from "
            "then on (`outbox-publisher reconcile` decides it from Kafka once the deadline has "
            f"passed); {override} overrides this check, unsafely"
        )
    return None


def _what_changed(seen: _Seen) -> str:
    """The message as it is now, and the last decision taken on it."""
    now = f"it is {seen.state} at fence {seen.fence}, after {seen.attempts} attempt(s)"
    if seen.decided_at is None:
        return now
    decision = (
        "escalated"  # the reconciler's: it could not decide
        if seen.from_state == seen.to_state == State.UNCERTAIN
        else f"{seen.from_state} -> {seen.to_state}"
    )
    return f"{now}; last decision {decision} by {seen.decided_by} at {seen.decided_at.isoformat()}"
