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

A decision resolves names in pg_catalog only, for its transaction
(``pin_search_path``): a function another role planted in a schema on the
caller's path (public) never runs as the operator.

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
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from outbox.connection import PsycopgExecutor, search_path_pinned
from outbox.errors import OutboxError
from outbox.holds import release_held_of
from outbox.queries import query
from outbox.states import ABSENCE_GRACE_SECONDS, State


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


class OutOfOrder(DecisionRefused):
    """Sending the message again would write it after later messages of its key that may
    already be in Kafka (``overtaken_by``); allowed only when the decision says so
    (``out_of_order``)."""


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
    #: The reconciler could not decide it (it read Kafka after its own absence grace).
    escalated: bool
    #: The reconciler proved its record absent, later messages of its key present.
    proven_absent: bool


@dataclass(frozen=True, slots=True)
class Overtaken:
    """A later message of a stuck message's key that may already be in Kafka, or (no
    ``later_id``, state ``unknown``) no telling: retention purged the record of the batch
    that last sent the message, which said what was sent with it."""

    message_id: uuid.UUID
    later_id: uuid.UUID | None
    #: ``delivered`` (sent in the batch of the message's last send), ``uncertain``, or
    #: ``unknown``.
    later_state: str


def overtaken_words(later: list[Overtaken]) -> str:
    """What a list of ``overtaken_by`` says, in words: the first few later messages, or
    that none can be told."""
    known = [o for o in later if o.later_id is not None]
    words = []
    if known:
        shown = ", ".join(f"{o.later_id} ({o.later_state})" for o in known[:5])
        more = f" and {len(known) - 5} more" if len(known) > 5 else ""
        words.append(f"later messages of its key may already be in Kafka: {shown}{more}")
    if len(known) < len(later):
        words.append(
            "whether later messages of its key were sent with it cannot be told: retention "
            "purged the record of the batch that last sent it (look for them in its "
            "partition)"
        )
    return "; ".join(words)


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
    out_of_order: bool = False,
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
    changed when it is no longer at ``fence``; ``BeforeWriteDeadline`` when
    it is too soon for an uncertain message (unless ``force_before_deadline``,
    unsafe): ``PENDING`` or ``DISCARD`` while its record may still be written
    (sent again, a second copy; discarded, its record may land after later
    messages of its key), ``PENDING`` until ``ABSENCE_GRACE_SECONDS`` after
    its write deadline (a record written by then may not be readable yet),
    ``DELIVERED`` while its Kafka transaction session is unfenced (a record
    seen there may yet be aborted); ``DecisionRefused`` for ``DELIVERED`` of a
    message the reconciler proved absent; ``OutOfOrder`` for ``PENDING`` when
    later messages of its key may already be in Kafka, unless
    ``out_of_order``; and ``ValueError`` for an empty reason, a missing fence,
    or a location that is half given or negative.
    """
    check_resolution(
        message_id,
        resolution,
        fence=fence,
        partition=partition,
        offset=offset,
        force_before_deadline=force_before_deadline,
        out_of_order=out_of_order,
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
        out_of_order=out_of_order,
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
    out_of_order: bool = False,
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
    if out_of_order and resolution is not Resolution.PENDING:
        raise ValueError("--out-of-order only goes with --pending")


def retry(
    conn: psycopg.Connection[Any],
    message_id: uuid.UUID,
    reason: str = "retried by an operator",
    *,
    fence: int | None = None,
    out_of_order: bool = False,
    decided_by: str | None = None,
) -> State:
    """Send a quarantined message again, with a fresh retry budget; return its old state.

    With ``fence``, only if the message is still at that fence (else
    ``StaleDecision``). ``OutOfOrder`` when later messages of its key may
    already be in Kafka, unless ``out_of_order``.
    """
    return _decide(
        conn,
        message_id,
        State.PENDING,
        (State.QUARANTINED,),
        reason,
        fence=fence,
        out_of_order=out_of_order,
        decided_by=decided_by,
        action="retried",
    )


@dataclass(frozen=True, slots=True)
class Retried:
    """What ``retry_quarantined`` did."""

    #: The messages sent again, in seq order.
    moved: list[uuid.UUID]
    #: The messages left quarantined, each with the later messages of its key that may
    #: already be in Kafka: retry each by itself, with ``out_of_order``, or discard it.
    overtaken: dict[uuid.UUID, list[Overtaken]]


def retry_quarantined(
    conn: psycopg.Connection[Any],
    *,
    topic: str | None = None,
    reason: str = "retried by an operator",
    decided_by: str | None = None,
) -> Retried:
    """Send every quarantined message (of ``topic``, or all) again, but those that later
    messages of their key may have overtaken in Kafka (``Retried.overtaken``)."""
    if not reason.strip():
        raise ValueError("a decision needs a reason (--reason)")
    with conn.transaction(), search_path_pinned(PsycopgExecutor(conn).fetchall):
        ids = [row[0] for row in conn.execute(query("quarantined_ids"), {"topic": topic})]
        overtaken = overtaken_by(conn, ids)
        rows = conn.execute(
            query("retry_quarantined"),
            {
                "ids": [i for i in ids if i not in overtaken],
                "reason": reason,
                "decided_by": decided_by or operator_name(),
            },
        ).fetchall()
        moved = [row[0] for row in rows]
        release_held_of(conn, moved)
    return Retried(moved, overtaken)


def overtaken_by(
    conn: psycopg.Connection[Any], message_ids: Collection[uuid.UUID]
) -> dict[uuid.UUID, list[Overtaken]]:
    """Of these uncertain or quarantined messages, those that later messages of their key
    may have overtaken in Kafka, each with those messages in seq order (``overtaken_by``)."""
    found: dict[uuid.UUID, list[Overtaken]] = {}
    if not message_ids:
        return found
    with conn.cursor(row_factory=class_row(Overtaken)) as cur:
        for row in cur.execute(query("overtaken_by"), {"ids": list(message_ids)}):
            found.setdefault(row.message_id, []).append(row)
    return found


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
    #: Sent again even after later messages of its key (``--out-of-order``).
    out_of_order: bool = False


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
    out_of_order: bool = False,
    decided_by: str | None = None,
    action: str,
) -> State:
    if not reason.strip():
        raise ValueError("a decision needs a reason (--reason)")
    decision = _Decision(
        message_id,
        to_state,
        from_states,
        action,
        fence,
        force_before_deadline,
        partition,
        out_of_order,
    )
    evidence: dict[str, Any] = {
        k: v for k, v in (("partition", partition), ("offset", offset)) if v is not None
    }
    # A decision the override let through says so in its evidence (resolve_message).

    def refuse_unless_allowed() -> None:
        # Raised inside the transaction block, a refusal rolls it (or its
        # savepoint) back: a lock taken by resolve_lock is released with it.
        with conn.cursor(row_factory=class_row(_Seen)) as cur:
            seen = cur.execute(query("decision_check"), {"id": message_id}).fetchone()
        # Only a decision that sends it again can put it after later ones.
        later = (
            overtaken_by(conn, [message_id]).get(message_id, [])
            if to_state is State.PENDING
            else []
        )
        refusal = _refusal(decision, seen, later)
        if refusal is not None:
            raise refusal
        if later:
            # Let through by out_of_order: the decision says after which.
            after = [str(o.later_id) for o in later if o.later_id is not None]
            evidence["sent_after"] = after[:10]
            evidence["sent_after_count"] = len(after)

    with conn.transaction(), search_path_pinned(PsycopgExecutor(conn).fetchall):
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
                "absence_grace": ABSENCE_GRACE_SECONDS,
                "partition": partition,
                "offset": offset,
                "reason": reason,
                "decided_by": decided_by or operator_name(),
                "evidence": Jsonb(evidence),
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


def _refusal(
    decision: _Decision, seen: _Seen | None, later: list[Overtaken]
) -> DecisionRefused | None:
    """Why ``decision`` must not apply to the message as ``seen``, or None when it may.

    ``later``: the later messages of its key that may already be in Kafka
    (``overtaken_by``), read for a decision that would send it again.
    """
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
    return _risk(decision, seen, later)


def _risk(decision: _Decision, seen: _Seen, later: list[Overtaken]) -> DecisionRefused | None:
    """What the decision would risk on a message in a state and at a fence it applies to:
    a record looked for in the wrong partition, one proven absent recorded delivered, a
    decision taken too soon, a message sent after later ones of its key."""
    message_id = decision.message_id
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
    if decision.to_state is State.DELIVERED and seen.proven_absent:
        return DecisionRefused(
            f"message {message_id}: the reconciler proved its record absent from the "
            "partition it was sent to, while later messages of its key are there (`outbox "
            f"inspect {message_id}` shows its evidence): recorded delivered, it would never "
            "reach consumers. Decide --pending --out-of-order (sent after them) or --discard"
        )
    if seen.state == State.UNCERTAIN and not decision.force_before_deadline:
        too_soon = _too_soon(message_id, seen, decision.to_state)
        if too_soon is not None:
            return too_soon
    if later and not decision.out_of_order:
        return _out_of_order(decision, later)
    return None


#: What an uncertain message may become only once its record can no longer be
#: written, what doing it sooner risks (sent again, a second copy; discarded, its
#: key released while the record may still land after later messages of the key;
#: delivered, a record seen in a transaction that may yet be aborted), and the
#: command that overrides the check.
_TOO_SOON = {
    State.PENDING: ("sending it again now may deliver it twice", "--force-before-deadline"),
    State.DISCARDED: (
        "discarding it now releases its key while its record may still be written, after "
        "later messages of the key (and a discarded message would then be delivered)",
        "`outbox resolve {id} --discard --force-before-deadline --reason TEXT`",
    ),
    State.DELIVERED: (
        "a record of it that you read there may yet be aborted with that transaction (a "
        "reader that shows uncommitted records shows it), and recorded delivered it would "
        "never reach read_committed consumers",
        "--force-before-deadline, once a read_committed reader shows the record,",
    ),
}


def _too_soon(message_id: uuid.UUID, seen: _Seen, to_state: State) -> BeforeWriteDeadline | None:
    """Refuse moving an uncertain message on while its record may still be written, or
    may be written and not be readable yet, or (delivered) may yet be aborted."""
    risk, override = _TOO_SOON[to_state]
    override = override.format(id=message_id)
    if seen.unfenced_session is not None:
        return BeforeWriteDeadline(
            f"message {message_id} was sent in the Kafka transaction of producer session "
            f"{seen.unfenced_session}, which has not been fenced: that session may still "
            f"commit or abort its record, and {risk}. Run `outbox-publisher reconcile`: it "
            f"fences the session and decides the message from what Kafka committed "
            f"({override} overrides this check, unsafely)"
        )
    if seen.write_deadline is None or to_state is State.DELIVERED:
        return None
    # Sent again, it waits the absence grace too: a record written by the
    # deadline may be unreadable that long, so not finding it proves nothing
    # (escalated, the reconciler has read Kafka after its own grace).
    grace = ABSENCE_GRACE_SECONDS if to_state is State.PENDING and not seen.escalated else 0.0
    decidable = seen.write_deadline + timedelta(seconds=grace)
    if decidable <= seen.checked_at:
        return None
    deadline = seen.write_deadline.isoformat()
    if seen.write_deadline > seen.checked_at:
        why = f"may still be written by the producer that sent it until {deadline} (its deadline)"
    else:
        why = (
            f"may have been written by its write deadline ({deadline}) and not be readable "
            f"yet: a partition leader shows a record once its in-sync followers copied it, "
            f"up to {grace:g} s later"
        )
    return BeforeWriteDeadline(
        f"message {message_id} {why}: {risk}. Decide it from {decidable.isoformat()} on "
        f"(`outbox-publisher reconcile` decides it from Kafka then); {override} overrides "
        "this check, unsafely"
    )


def _out_of_order(decision: _Decision, later: list[Overtaken]) -> OutOfOrder:
    """Refuse sending a message again after later messages of its key that may be in Kafka."""
    message_id = decision.message_id
    command = (
        f"outbox resolve {message_id} --pending --out-of-order"
        if decision.action == "resolved"
        else f"outbox retry {message_id} --out-of-order"
    )
    return OutOfOrder(
        f"message {message_id}: {overtaken_words(later)}. Sent again now, it would reach "
        f"consumers after them. If its key's consumers can take that, `{command}` sends it "
        f"anyway; else discard it (`outbox discard {message_id} --reason TEXT`)"
    )


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
