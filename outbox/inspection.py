"""One message's whole story (``outbox inspect``) and messages by state (``outbox list``).

The timeline is assembled from what the tables keep: the message row, its
attempt records (with the publisher, fence and batch evidence of each), the
claim it is in now, and every decision taken on it. After retention purged a
delivered message, its attempts, decisions and batches stay for the evidence
window and the timeline is told from them alone. A delivery writes no attempt
row: a purged message's delivering batch is found by reading the batches
claimed since the message was made, for at most ``DELIVERY_SEARCH_TIMEOUT``
(an operator's question must not read the whole table, nor hold back vacuum
while it does).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from outbox.errors import OutboxError
from outbox.ids import created_at
from outbox.queries import query
from outbox.states import OVERTAKEN_NOTE, WAITING_NOTE, State

#: How far a writer's clock (which dates a message id) may run ahead of the
#: database's (which dates claims) for the search of a purged message's
#: delivering batch to start early enough.
CLOCK_ALLOWANCE = timedelta(minutes=15)
#: The longest the search of the batches for a purged message's delivery reads.
DELIVERY_SEARCH_TIMEOUT = timedelta(seconds=10)

#: What to do next about a message in each state that needs a person, or may.
_NEXT_ACTION = {
    State.PENDING: "none: a publisher will claim it",
    State.IN_FLIGHT: "none while its lease is live; after that a publisher recovers it from "
    "its evidence (or run outbox-publisher reconcile)",
    State.DELIVERED: "none",
    State.UNCERTAIN: "wait: the reconciler decides it from Kafka once the producer that sent "
    "it can no longer write (or run outbox-publisher reconcile)",
    State.QUARANTINED: "read the error, fix the cause, then outbox retry ID --fence {fence}, "
    "or outbox discard ID --fence {fence} --reason TEXT",
    State.DISCARDED: "none: an operator decided not to deliver it",
}
_ESCALATED_ACTION = (
    "the reconciler could not decide it from Kafka: its last error says why. Check, then "
    "decide with outbox resolve ID --delivered|--pending|--discard --fence {fence} "
    "--reason TEXT (refused if the message changed since fence {fence})"
)
#: Escalated because later messages of its key are in Kafka while its record is not.
_OVERTAKEN_ACTION = (
    "its record was never written, and later messages of its key were: "
    "outbox resolve ID --pending --out-of-order --fence {fence} --reason TEXT sends it after "
    "them, "
    "outbox resolve ID --discard --fence {fence} --reason TEXT never sends it "
    "(--delivered would lose it and is refused; each refused if the message changed since "
    "fence {fence})"
)
#: An uncertain message whose last error is the reconciler's note that it waits on Kafka.
_WAITING_ACTION = (
    "do what its last error says: reconciliation goes on once Kafka lets it "
    "(outbox-publisher reconcile tries now)"
)
#: What to do next about a message that waits for a publisher while none runs.
_NO_PUBLISHER_ACTION = {
    State.PENDING: "no publisher is running to claim it: start outbox-publisher",
    State.IN_FLIGHT: "no publisher is running to recover it once its lease expires: start "
    "outbox-publisher, or run outbox-publisher reconcile",
    State.UNCERTAIN: "no publisher is running to reconcile it: start outbox-publisher, "
    "or run outbox-publisher reconcile",
}
#: In flight under an expired lease (the status view's in_flight line says the same).
_LEASE_EXPIRED_ACTION = (
    "its lease expired: its publisher died or stalled; a running publisher recovers it from "
    "its evidence, or run outbox-publisher reconcile"
)
_LEASE_EXPIRED_NO_PUBLISHER_ACTION = (
    "its lease expired and no publisher is running to recover it: start outbox-publisher, "
    "or run outbox-publisher reconcile"
)
#: Uncertain and overdue (the status view's uncertain line says the same).
_OVERDUE_ACTION = (
    "undecided 5 minutes past its write deadline: check that publishers reconcile "
    "(--reconcile-interval above 0) and reach Kafka, or run outbox-publisher reconcile"
)
#: How long an uncertain message may stay undecided past its write deadline
#: before it needs a person: the status view's ``overdue`` (schema/0014).
OVERDUE_AFTER = timedelta(minutes=5)


@dataclass(frozen=True, slots=True)
class Event:
    """One line of a timeline."""

    at: datetime
    event: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Timeline:
    """A message as the tables know it; ``message`` is None once retention purged it."""

    message_id: uuid.UUID
    message: dict[str, Any] | None
    attempts: list[dict[str, Any]]
    decisions: list[dict[str, Any]]
    #: The claim the message is in now (in flight, or uncertain from it).
    claim: dict[str, Any] | None
    #: The message holding back this message's key, if any.
    held_behind: dict[str, Any] | None
    events: list[Event]
    #: What the timeline may lack, in words (a search that was stopped).
    notes: tuple[str, ...] = ()
    #: Whether a publisher holds a lane's lease now (as ``outbox.status`` counts them).
    publisher_running: bool = True
    #: The database's time when the timeline was read; leases and deadlines are its.
    read_at: datetime | None = None

    @property
    def state(self) -> str:
        """The message's state, or ``purged``."""
        return "purged" if self.message is None else str(self.message["state"])

    @property
    def needs_action(self) -> bool:
        """Whether a person should act on this message, as the status view judges its
        state's line: quarantined; uncertain and escalated, overdue, or with no publisher
        running to reconcile it; in flight under an expired lease; pending with no
        publisher running. Waiting for a retry, a claim or the reconciler is not."""
        if self.message is None:
            return False
        state = State(self.message["state"])
        if state is State.QUARANTINED:
            return True
        if state is State.UNCERTAIN:
            escalated = self.message["escalated_at"] is not None
            return escalated or self._overdue or not self.publisher_running
        if state is State.IN_FLIGHT:
            return self._lease_expired
        if state is State.PENDING:
            return not self.publisher_running
        return False

    @property
    def _overdue(self) -> bool:
        """Uncertain, and undecided ``OVERDUE_AFTER`` past its write deadline."""
        now, message = self.read_at, self.message
        return (
            now is not None
            and message is not None
            and message["escalated_at"] is None
            and message["available_at"] < now - OVERDUE_AFTER
        )

    @property
    def _lease_expired(self) -> bool:
        """In flight under a lease that has expired."""
        now, message = self.read_at, self.message
        expiry = None if message is None else message["lease_expires_at"]
        return now is not None and expiry is not None and expiry < now

    @property
    def next_action(self) -> str:
        """The next safe action, in words."""
        if self.message is None:
            return "none: delivered and purged by retention; only its evidence is kept"
        state = State(self.message["state"])
        running = self.publisher_running
        if state is State.UNCERTAIN:
            return self._uncertain_action(self.message)
        if state is State.IN_FLIGHT and self._lease_expired:
            return _LEASE_EXPIRED_ACTION if running else _LEASE_EXPIRED_NO_PUBLISHER_ACTION
        if state is State.PENDING and self.held_behind is not None:
            return (
                f"none here: its key waits behind message {self.held_behind['held_by']} "
                f"({self.held_behind['state']}); act on that one"
                + ("" if running else "; and no publisher is running: start one")
            )
        if not running and state in _NO_PUBLISHER_ACTION:
            return _NO_PUBLISHER_ACTION[state]
        # A decision names the fence it was made from: the one shown here.
        return _NEXT_ACTION[state].format(fence=self.message["fence"])

    def _uncertain_action(self, message: dict[str, Any]) -> str:
        """In the order of the status view's uncertain line: what only a person can do
        first (escalated), then no publisher, the reconciler's note, overdue, wait."""
        if message["escalated_at"] is not None:
            overtaken = (message["last_error"] or "").startswith(OVERTAKEN_NOTE)
            action = _OVERTAKEN_ACTION if overtaken else _ESCALATED_ACTION
            return action.format(fence=message["fence"])
        if not self.publisher_running:
            return _NO_PUBLISHER_ACTION[State.UNCERTAIN]
        if (message["last_error"] or "").startswith(WAITING_NOTE):
            return _WAITING_ACTION
        if self._overdue:
            return _OVERDUE_ACTION
        return _NEXT_ACTION[State.UNCERTAIN]


class DeliverySearchStopped(OutboxError):
    """Nothing is known of a message but its delivery was not searched to the end."""


def read_timeline(
    conn: psycopg.Connection[Any],
    message_id: uuid.UUID,
    *,
    search_timeout: timedelta = DELIVERY_SEARCH_TIMEOUT,
) -> Timeline | None:
    """Everything known about one message, or None when nothing is (never existed, or purged).

    Raises ``DeliverySearchStopped`` when nothing is known but the search of the
    batches for a purged message's delivery took longer than ``search_timeout``.
    """
    params = {"id": message_id}
    notes: tuple[str, ...] = ()
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query("message"), params)
        message = cur.fetchone()
        cur.execute(query("message_attempts"), params)
        attempts = cur.fetchall()
        cur.execute(query("message_decisions"), params)
        decisions = cur.fetchall()
        claim = held = None
        running, read_at = True, None
        if message is not None:
            cur.execute(query("message_claim"), params)
            claim = cur.fetchone()
            cur.execute(query("message_holder"), params)
            held = cur.fetchone()
            cur.execute(query("read_context"))
            context = cur.fetchone() or {}
            running, read_at = bool(context.get("running")), context.get("now")
        elif not _delivery_recorded(attempts, decisions):
            start = _search_start(cur, message_id, attempts)
            if start is not None:
                try:
                    delivery = _purged_delivery(cur, message_id, start, search_timeout)
                except psycopg.errors.QueryCanceled:
                    stopped = (
                        f"the search of outbox.batches for its delivery was stopped after "
                        f"{search_timeout.total_seconds():g}s (from batch {start} on)"
                    )
                    if not attempts and not decisions:
                        raise DeliverySearchStopped(
                            f"no message {message_id}, and no attempt or decision of one; "
                            f"{stopped}: it was purged, or the id is mistyped"
                        ) from None
                    notes = (stopped,)
                else:
                    if delivery is not None:
                        attempts.append(delivery)
    if message is None and not attempts and not decisions:
        return None
    events = _events(message, attempts, decisions, claim)
    return Timeline(
        message_id, message, attempts, decisions, claim, held, events, notes, running, read_at
    )


def _delivery_recorded(attempts: list[dict[str, Any]], decisions: list[dict[str, Any]]) -> bool:
    """Whether a purged message's delivery is on record without its batch: reconciled (an
    attempt that ended delivered) or decided by an operator."""
    return any(a["outcome"] == State.DELIVERED for a in attempts) or any(
        d["to_state"] == State.DELIVERED for d in decisions
    )


def _search_start(
    cur: psycopg.Cursor[dict[str, Any]], message_id: uuid.UUID, attempts: list[dict[str, Any]]
) -> int | None:
    """The first batch that may have delivered a purged message, or None when none can.

    After its last attempt's batch, if it has one; otherwise the first batch
    claimed since the message was made (less ``CLOCK_ALLOWANCE``), found by
    bisecting the primary key, as batch ids grow with their claim time.
    """
    claimed = [a["batch_id"] for a in attempts if a["batch_id"] is not None]
    if claimed:
        return int(max(claimed)) + 1
    made = created_at(message_id)
    if made is None:
        return None  # message ids are UUIDv7: this one names no message
    cur.execute(query("batch_id_range"))
    ends = cur.fetchone()
    if ends is None or ends["low"] is None:
        return None
    since = made - CLOCK_ALLOWANCE
    low, high = int(ends["low"]), int(ends["high"]) + 1
    while low < high:
        middle = (low + high) // 2
        cur.execute(query("batch_at_or_after"), {"id": middle})
        found = cur.fetchone()
        if found is None or found["claimed_at"] >= since:
            high = middle
        else:
            low = int(found["id"]) + 1
    return low


def _purged_delivery(
    cur: psycopg.Cursor[dict[str, Any]],
    message_id: uuid.UUID,
    start: int,
    timeout: timedelta,
) -> dict[str, Any] | None:
    """The delivering batch of a purged message, as an attempt row; ``QueryCanceled`` when
    the search took longer than ``timeout`` (the search alone is then undone)."""
    milliseconds = max(1, round(timeout.total_seconds() * 1000))
    with cur.connection.transaction():
        cur.execute(query("statement_timeout"), {"timeout": f"{milliseconds}ms"})
        before = cur.fetchone()
        cur.execute(query("purged_delivery"), {"id": message_id, "from": start})
        delivery = cur.fetchone()
        if before is not None:
            cur.execute(query("statement_timeout"), {"timeout": before["previous"]})
    return delivery


def _events(
    message: dict[str, Any] | None,
    attempts: list[dict[str, Any]],
    decisions: list[dict[str, Any]],
    claim: dict[str, Any] | None,
) -> list[Event]:
    events: list[Event] = []
    if message is not None:
        enqueued = {"topic": message["topic"], "seq": message["seq"]}
        events.append(Event(message["created_at"], "enqueued", enqueued))
    for a in attempts:
        claimed = _claimed(a["publisher_id"], a["host"], a["pid"], a["fence"], a["batch_id"])
        _add_transaction(claimed, a["transactional_id"])
        events.append(Event(a["started_at"], f"attempt {a['attempt']} claimed", claimed))
        if a["send_began_at"] is not None and a["send_began"]:
            events.append(
                Event(
                    a["send_began_at"],
                    f"attempt {a['attempt']} sending",
                    {"write_deadline": a["write_deadline"]},
                )
            )
        if a["finished_at"] is not None:
            detail: dict[str, Any] = {"outcome": a["outcome"], "fence": a["fence"]}
            if a["kafka_partition"] is not None:
                detail["partition"] = a["kafka_partition"]
            if a["kafka_offset"] is not None:
                detail["offset"] = a["kafka_offset"]
            if a["error"]:
                detail["error"] = a["error"]
            events.append(Event(a["finished_at"], f"attempt {a['attempt']} {a['outcome']}", detail))
    if claim is not None and message is not None and message["state"] == State.IN_FLIGHT:
        # The claim wrote only its batch: this attempt's number and fence are
        # the row's plus one, written when it settles.
        n = message["attempts"] + 1
        in_flight = _claimed(
            claim["publisher_id"], claim["host"], claim["pid"], message["fence"] + 1, claim["id"]
        )
        in_flight["lease_expires_at"] = message["lease_expires_at"]
        _add_transaction(in_flight, claim["transactional_id"])
        events.append(Event(claim["claimed_at"], f"attempt {n} claimed (in flight)", in_flight))
        if claim["send_began_at"] is not None:
            events.append(
                Event(
                    claim["send_began_at"],
                    f"attempt {n} sending",
                    {"write_deadline": claim["write_deadline"]},
                )
            )
    for d in decisions:
        events.append(
            Event(
                d["decided_at"],
                f"decided {d['from_state']} -> {d['to_state']}",
                {"by": d["decided_by"], "reason": d["reason"], "evidence": d["evidence"]},
            )
        )
    delivered_by_attempt = any(a["outcome"] == "delivered" for a in attempts)
    if message is not None and message["delivered_at"] is not None and not delivered_by_attempt:
        events.append(
            Event(
                message["delivered_at"],
                "delivered",
                {"partition": message["kafka_partition"], "offset": message["kafka_offset"]},
            )
        )
    # Stable: events at the same instant keep the order they were added in.
    events.sort(key=lambda e: e.at)
    return events


def _claimed(publisher: Any, host: Any, pid: Any, fence: Any, batch: Any) -> dict[str, Any]:
    """What a claim event says: who claimed, under which fence, in which batch."""
    return {"publisher": publisher, "host": host, "pid": pid, "fence": fence, "batch": batch}


def _add_transaction(detail: dict[str, Any], transactional_id: str | None) -> None:
    """Name the Kafka transaction's session of an attempt sent in one."""
    if transactional_id is not None:
        detail["transaction"] = transactional_id


@dataclass(frozen=True, slots=True)
class Listing:
    """Messages of one state, oldest first, and whether more matched than were shown."""

    messages: list[dict[str, Any]]
    more: bool


def list_messages(
    conn: psycopg.Connection[Any], state: State, *, topic: str | None = None, limit: int = 50
) -> Listing:
    """The oldest ``limit`` messages in ``state`` (of ``topic``, if given)."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            query("list_messages"), {"state": state.value, "topic": topic, "limit": limit + 1}
        )
        rows = cur.fetchall()
    return Listing(rows[:limit], len(rows) > limit)
