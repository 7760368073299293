"""The database seam of the publisher: claim, mark, settle, recover, reconcile.

``PublisherStore`` is the only code of the publisher that sends SQL; every
statement comes from ``outbox/queries.sql``. Each method is one statement in
its own transaction (the connection is in autocommit mode), except
``mark_sending``, whose two statements share one, so a claim is visible to
other publishers as soon as it is made.

A claim writes one row, its batch, which names its messages and holds their
lease; the settle closes the batch and writes each message row once. While
its batch is open a message is in flight (``outbox.message_status``).
"""

from __future__ import annotations

import functools
import math
import socket
import uuid
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from outbox.holds import hold_behind_stuck, release_held_of, release_stale_holds
from outbox.migrations import require_current_schema
from outbox.queries import query
from outbox.states import WAITING_NOTE, State
from publisher.connector import connect, limit_idle_transactions
from publisher.outcomes import AttemptOutcome


# Not frozen: one is built per message, and a frozen dataclass's __init__
# costs about four times as much (it sets each field through object.__setattr__).
@dataclass(slots=True)
class ClaimedMessage:
    """A message of a batch this publisher claimed: its attempt ``attempt`` under ``fence``.

    The claim wrote neither: the settle writes both to the message row, and
    only if the row still holds the fence before this one (nothing else moved
    it since the claim).
    """

    id: uuid.UUID
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]
    fence: int
    attempt: int
    #: Attempts that ended "not written" since the last operator decision.
    failures: int = 0
    #: Send it on its own: its last refusal was shared with other records.
    send_alone: bool = False
    #: The enqueuing transaction's timestamp (PostgreSQL ``now()``: when it began).
    created_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Batch:
    """The messages of one claim, in claim order, and the claim's record."""

    id: int
    messages: list[ClaimedMessage]
    claimed_at: datetime


# Not frozen: one is built per message, and a frozen dataclass's __init__
# costs about four times as much (it sets each field through object.__setattr__).
@dataclass(slots=True)
class Settlement:
    """The outcome to record for one claimed message."""

    message_id: uuid.UUID
    fence: int
    state: State
    attempt_outcome: AttemptOutcome
    partition: int | None = None
    offset: int | None = None
    retry_after: float = 0.0
    error: str | None = None
    send_began: bool = True
    #: Adds one to the message's failures (its retry budget).
    counts_as_failure: bool = False
    #: Its next attempt goes alone (see ``ClaimedMessage.send_alone``).
    send_alone: bool = False


@dataclass(frozen=True, slots=True)
class Recovered:
    """A message of a batch that recovery closed after the batch's lease expired."""

    message_id: uuid.UUID
    #: Where it went: pending (nothing was sent) or uncertain.
    state: State
    #: The attempt and fence of the claim whose lease expired.
    attempt: int
    fence: int
    #: That claim's batch.
    batch_id: int
    #: The publisher whose lease expired.
    previous_owner: uuid.UUID


@dataclass(frozen=True, slots=True)
class UncertainMessage:
    """An uncertain message the reconciler may decide, with its batch's evidence."""

    id: uuid.UUID
    topic: str
    key: bytes | None
    fence: int
    #: Where it was sent, if known; else derived from ``partition_counts``.
    partition: int | None
    #: ``{topic: partition count}`` when the batch began sending (None: unknown).
    partition_counts: Mapping[str, int] | None
    #: ``{topic: {partition: offset}}`` confirmed before the batch began sending.
    confirmed_offsets: Mapping[str, Mapping[str, int]] | None
    #: Its place in its key's order.
    seq: int = 0
    #: Whether the grace after its write deadline has passed: only then is
    #: its record's absence proof (see ``Reconciler``).
    absence_due: bool = True
    #: The transactional.id its batch was sent under (transactional delivery):
    #: fenced before the log is read, read_committed. ``None``: idempotent.
    transactional_id: str | None = None
    #: Seconds since its batch began sending, by the database's clock, when it was
    #: read (``None``: not recorded). Its record, if any, is younger.
    sent_ago: float | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """What the reconciler concluded about one uncertain message, and on what evidence."""

    message_id: uuid.UUID
    fence: int
    #: ``delivered`` (found), ``pending`` (proven absent) or ``uncertain`` (escalated).
    to_state: State
    reason: str
    partition: int | None = None
    offset: int | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)


#: Seconds a transaction of the store may stay idle before the server ends its
#: session (``idle_transaction_limit``). Its transactions run two statements
#: back to back (``mark_sending``, ``renew_lanes``): one idle this long belongs
#: to a process stopped between them (SIGSTOP, a paused container or VM), whose
#: locks would keep recovery from its batch, and other publishers from its
#: lanes once their leases ran out, for as long as it stays stopped; the TCP
#: keepalives of a stopped process are still answered by its kernel.
IDLE_TRANSACTION_LIMIT = 10.0


class PublisherStore:
    """One publisher's connection to the outbox tables."""

    def __init__(
        self,
        conninfo: str,
        publisher_id: uuid.UUID,
        *,
        statements: Mapping[str, str] | None = None,
        idle_transaction_limit: float = IDLE_TRANSACTION_LIMIT,
    ) -> None:
        self.conninfo = conninfo
        self.publisher_id = publisher_id
        self.idle_transaction_limit = idle_transaction_limit
        self._conn: psycopg.Connection[Any] | None = None
        #: Statements used instead of the named queries of the same name (the
        #: throughput benchmark measures an older cycle side by side with this one).
        self._statements = statements or {}

    def _sql(self, name: str) -> str:
        return self._statements.get(name) or query(name)

    @property
    def conn(self) -> psycopg.Connection[Any]:
        """The open connection, reopened if it was closed or broken.

        Statements are not prepared server-side, except the claim: the batch
        statements take arrays whose length the planner must see, and the
        generic plan PostgreSQL switches a prepared statement to after five
        runs made a 1,000-row settle about ten times slower. The claim is
        the exception: planning its branch per lane (10 to 25 ms) costs more
        than running it (a few milliseconds), and it takes no array. It is
        prepared and takes no parameters (claim_statement writes its values
        into its text), so PostgreSQL plans it once, at its first run on the
        connection, and reuses that plan: with parameters it would plan each
        of the first five runs anew. The plan cannot depend on a value it
        was not given (the lanes owned are read by the statement itself).

        JIT compilation is off: the claim's estimated cost is far above
        ``jit_above_cost`` (the hold check is estimated per candidate), so
        PostgreSQL compiled it at every run, about 24 ms of a 60 ms claim,
        for a plan that runs in a few milliseconds.
        """
        if self._conn is None or self._conn.closed:
            conn = connect(
                self.conninfo,
                autocommit=True,
                row_factory=tuple_row,
                application_name=f"outbox-publisher {self.publisher_id}",
                # Never prepared by count; the claim asks for it (prepare=True),
                # which a threshold of None would refuse.
                prepare_threshold=_NEVER_BY_COUNT,
            )
            try:
                conn.execute(query("jit_off"))
                limit_idle_transactions(conn, self.idle_transaction_limit)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """One of the store's transactions of two statements, on its connection.

        A session the server ended because the transaction stayed idle
        (``idle_transaction_limit``: this process was stopped between the two)
        raises as the connection lost that it is (``OperationalError``, which
        the callers retry), not as the internal error psycopg names it.
        """
        conn = self.conn
        try:
            with conn.transaction():
                yield conn
        except psycopg.errors.IdleInTransactionSessionTimeout as exc:
            self.close()
            raise psycopg.OperationalError(
                f"the database ended this session, its transaction idle too long "
                f"(this process was stopped?): {exc}"
            ) from exc

    def close(self) -> None:
        """Close the connection (a later call reopens it)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # --- the publisher's own record ---------------------------------------

    def register(self, version: str, pid: int, lease_seconds: float) -> None:
        """Record this publisher process, and the lease by which others judge it alive, in
        ``outbox.publishers``; raise ``SchemaBehind`` if the database lacks a migration this
        version ships."""
        require_current_schema(self.conn, "outbox-publisher")
        self.conn.execute(
            query("register_publisher"),
            {
                "id": self.publisher_id,
                "host": socket.gethostname(),
                "pid": pid,
                "version": version,
                "lease_seconds": float(lease_seconds),
            },
        )

    def heartbeat(
        self,
        lease_seconds: float,
        *,
        renew: bool,
        batches: Collection[int] | None = None,
        kafka_reached: bool | None = None,
    ) -> int:
        """Say this publisher is alive; with ``renew``, extend leases that expire soon.

        Only the leases of ``batches`` are renewed, when given. With
        ``kafka_reached``, say that it reaches Kafka now. Returns how many
        leases were renewed.
        """
        row = self.conn.execute(
            query("heartbeat"),
            {
                "id": self.publisher_id,
                "lease_seconds": float(lease_seconds),
                "renew": renew,
                "batches": None if batches is None else list(batches),
                "kafka_reached": kafka_reached,
            },
        ).fetchone()
        return int(row[0]) if row else 0

    def others_reach_kafka(self, lease_seconds: float) -> bool:
        """Whether another live publisher reached Kafka within its lease."""
        row = self.conn.execute(
            query("others_reach_kafka"),
            {"id": self.publisher_id, "lease_seconds": float(lease_seconds)},
        ).fetchone()
        return bool(row and row[0])

    def renew_lanes(self, lease_seconds: float) -> tuple[set[int], int]:
        """Renew this publisher's unexpired lanes; return them and the fair share, atomically."""
        params = {"owner": self.publisher_id, "lease_seconds": float(lease_seconds)}
        with self._transaction() as conn:
            kept = {row[0] for row in conn.execute(self._sql("renew_lanes"), params)}
            row = conn.execute(self._sql("fair_share"), params).fetchone()
        return kept, int(row[0]) if row else 1

    def acquire_lanes(self, count: int, lease_seconds: float) -> set[int]:
        """Take up to ``count`` free or expired lanes; return those taken."""
        rows = self.conn.execute(
            query("acquire_lanes"),
            {"owner": self.publisher_id, "count": count, "lease_seconds": float(lease_seconds)},
        ).fetchall()
        return {row[0] for row in rows}

    def release_lanes(self, lanes: Sequence[int] | None) -> set[int]:
        """Give back the given lanes (all when ``None``); return those given back."""
        rows = self.conn.execute(
            query("release_lanes"),
            {"owner": self.publisher_id, "lanes": None if lanes is None else list(lanes)},
        ).fetchall()
        return {row[0] for row in rows}

    def mark_stopped(self) -> None:
        """Record a clean stop."""
        self.conn.execute(query("stop_publisher"), {"id": self.publisher_id})

    # --- one batch ----------------------------------------------------------

    def claim(
        self, limit: int, lease_seconds: float, *, horizon: int | None = None
    ) -> Batch | None:
        """Lease up to ``limit`` pending messages in one statement; ``None`` if none.

        With ``horizon``, only the oldest ``horizon`` pending messages are
        candidates (a claim made ahead, which may well find every key busy).
        """
        rows = self.conn.execute(
            claim_statement(
                owner=self.publisher_id,
                lease_seconds=lease_seconds,
                limit=limit,
                horizon=horizon,
                template=self._sql("claim_batch"),
            ),
            # Used only by a claim_batch given to the store that still takes
            # parameters (benchmarks/baseline_cycle.sql).
            {
                "limit": limit,
                "owner": self.publisher_id,
                "lease_seconds": float(lease_seconds),
                "horizon": horizon,
            },
            binary=True,
            prepare=True,
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
                failures=row[8],
                send_alone=row[9],
                created_at=row[12],
            )
            for row in rows
        ]
        return Batch(id=rows[0][10], messages=messages, claimed_at=rows[0][11])

    def mark_sending(
        self,
        batch: Batch,
        partition_counts: Mapping[str, int],
        write_deadline_seconds: float,
        transactional_id: str | None = None,
    ) -> set[uuid.UUID]:
        """Record, before anything is sent, that the batch begins sending.

        Returns the ids of the batch's messages this publisher still holds;
        only those may be sent. The record says how partitions were chosen,
        which offsets were confirmed before, when the producer will have
        given up on every record, and (transactional delivery) the
        transactional.id the records are sent under.
        """
        with self._transaction() as conn:
            conn.execute(self._sql("lock_batch"), {"batch_id": batch.id})
            rows = conn.execute(
                self._sql("mark_sending"),
                {
                    "batch_id": batch.id,
                    "owner": self.publisher_id,
                    "write_deadline_seconds": float(write_deadline_seconds),
                    "transactional_id": transactional_id,
                    "partition_counts": Jsonb(dict(partition_counts)),
                    "topics": sorted(partition_counts),
                    # The row's fence as the claim read it (the attempt's is one more).
                    "ids": array_literal(m.id for m in batch.messages),
                    "fences": array_literal(m.fence - 1 for m in batch.messages),
                },
            ).fetchall()
        return {row[0] for row in rows}

    def settle(self, batch: Batch, settlements: Sequence[Settlement]) -> set[uuid.UUID]:
        """Close the batch and record every outcome in one statement; return the ids it changed.

        A message missing from the result was not this publisher's to settle
        any more: recovery closed its batch after the lease expired, or its
        row moved on since the claim (another fence). When every message of
        the batch was delivered, the shorter ``settle_delivered`` records it.
        """
        locations = _delivered_locations(batch, settlements)
        # (A store given another settle_batch, an older cycle's, keeps to it.)
        if locations is not None and "settle_batch" not in self._statements:
            return self.settle_delivered(batch, *locations)
        rows = self.conn.execute(
            self._sql("settle_batch"),
            {
                "ids": array_literal(s.message_id for s in settlements),
                "fences": array_literal(s.fence for s in settlements),
                "states": array_literal(s.state.value for s in settlements),
                "outcomes": array_literal(s.attempt_outcome for s in settlements),
                "partitions": array_literal(s.partition for s in settlements),
                "offsets": array_literal(s.offset for s in settlements),
                "retry_after": array_literal(float(s.retry_after) for s in settlements),
                "errors": array_literal(s.error for s in settlements),
                "send_began": array_literal(s.send_began for s in settlements),
                "failures": array_literal(s.counts_as_failure for s in settlements),
                "send_alone": array_literal(s.send_alone for s in settlements),
                "publisher": self.publisher_id,
                "batch_id": batch.id,
            },
        ).fetchall()
        return {row[0] for row in rows}

    def settled_by(self, batch: Batch, ids: Collection[uuid.UUID]) -> set[uuid.UUID]:
        """Which of ``ids`` a settle of ``batch`` recorded (``settled_by_batch``): for a
        settle retried after its first try's answer was lost, which finds the batch
        closed, by that try or by recovery."""
        rows = self.conn.execute(
            query("settled_by_batch"), {"batch_id": batch.id, "ids": list(ids)}
        ).fetchall()
        return {row[0] for row in rows}

    def settle_delivered(
        self, batch: Batch, partitions: Sequence[int], offsets: Sequence[int]
    ) -> set[uuid.UUID]:
        """Record a batch whose every message was delivered; return the ids it changed.

        ``partitions`` and ``offsets`` are where each message went, in the
        batch's claim order. What ``settle`` records for such a batch, with
        far less to send: the batch row names the messages.
        """
        if len(partitions) != len(batch.messages) or len(offsets) != len(batch.messages):
            raise ValueError("settle_delivered takes a partition and an offset per message")
        rows = self.conn.execute(
            self._sql("settle_delivered"),
            {
                "fences": array_literal(m.fence for m in batch.messages),
                "partitions": array_literal(partitions),
                "offsets": array_literal(offsets),
                "publisher": self.publisher_id,
                "batch_id": batch.id,
            },
        ).fetchall()
        return {row[0] for row in rows}

    # --- recovery and reconciliation ---------------------------------------

    def recover_expired_leases(self, limit: int = 100) -> list[Recovered]:
        """Close up to ``limit`` batches whose lease expired; return where their messages went."""
        rows = self.conn.execute(query("recover_expired_leases"), {"limit": limit}).fetchall()
        return [Recovered(row[0], State(row[1]), *row[2:]) for row in rows]

    def uncertain_due(
        self, limit: int = 1000, grace: float = 0.0, *, after: int = 0
    ) -> list[UncertainMessage]:
        """Uncertain, not escalated messages whose producer can no longer write: the first
        ``limit`` of them in key order (``seq``) after ``after``.

        Each says whether ``grace`` seconds have passed since, too.
        """
        rows = self.conn.execute(
            query("uncertain_due"), {"limit": limit, "grace": float(grace), "after": after}
        ).fetchall()
        return [UncertainMessage(*row) for row in rows]

    def note_waiting(
        self, messages: Sequence[UncertainMessage], note: str | None, *, keep: str | None = None
    ) -> int:
        """Write ``note`` as the ``last_error`` of those of ``messages`` still uncertain at
        the fence read, and not escalated; with ``None``, give such a note (other than
        ``keep``) way to the last attempt's error again. Return how many rows changed.

        A note starts with ``WAITING_NOTE``: that is how it is told apart from
        an attempt's error when it gives way.
        """
        if note is not None and not note.startswith(WAITING_NOTE):
            raise ValueError(f"a waiting note starts {WAITING_NOTE!r}, not {note!r}")
        if not messages:
            return 0
        cursor = self.conn.execute(
            query("note_waiting"),
            {
                "ids": [m.id for m in messages],
                "fences": [m.fence for m in messages],
                "note": note,
                "keep": keep,
                "prefix": WAITING_NOTE,
            },
        )
        return cursor.rowcount

    def later_of_key(self, message_id: uuid.UUID, ids: Collection[uuid.UUID]) -> set[uuid.UUID]:
        """Those of ``ids`` that come after ``message_id`` in its key's order."""
        if not ids:
            return set()
        rows = self.conn.execute(
            query("later_of_key"), {"id": message_id, "ids": list(ids)}
        ).fetchall()
        return {row[0] for row in rows}

    def decide(self, decisions: Sequence[Decision], decided_by: str) -> set[uuid.UUID]:
        """Apply reconciliation decisions in one statement; return the ids that changed."""
        if not decisions:
            return set()
        rows = self.conn.execute(
            query("decide_uncertain"),
            {
                "ids": [d.message_id for d in decisions],
                "fences": [d.fence for d in decisions],
                "to_states": [d.to_state.value for d in decisions],
                "partitions": [d.partition for d in decisions],
                "offsets": [d.offset for d in decisions],
                "reasons": [d.reason for d in decisions],
                "evidence": [Jsonb(dict(d.evidence)) for d in decisions],
                "decided_by": decided_by,
            },
        ).fetchall()
        moved = {row[0] for row in rows}
        # What waited behind them goes on now, not at the next hold pass.
        release_held_of(self.conn, moved)
        return moved

    # --- held messages -----------------------------------------------------

    def hold_and_release(self) -> tuple[int, int]:
        """Mark held what waits behind a stuck message in this publisher's lanes, then
        release held messages with nothing stuck before them; return both counts.

        Two transactions: the release reads what the mark committed (see
        ``outbox.holds``).
        """
        held = hold_behind_stuck(self.conn, self._owned_lanes())
        return held, release_stale_holds(self.conn)

    # --- what is left to do -------------------------------------------------

    def work_left(self, *, stale_holds: bool = False) -> bool:
        """Whether a message is pending, in flight, or uncertain and not escalated.

        With ``stale_holds``, also whether a held message has nothing before it that only
        an operator can move (its mark outlived its reason until the next hold pass):
        what ``--exit-when-idle`` must not exit before. One probe per key with held
        messages, so only then.
        """
        row = self.conn.execute(query("work_left")).fetchone()
        if row and row[0]:
            return True
        if not stale_holds:
            return False
        sql = query("stale_holds_left").format(held_key_hashes=query("held_key_hashes"))
        row = self.conn.execute(sql).fetchone()
        return bool(row and row[0])

    def seconds_until_due(self) -> float | None:
        """Seconds until a message needs this publisher (a pending one: of its lanes);
        ``None`` if none will."""
        row = self.conn.execute(
            query("seconds_until_due"), {"lanes": self._owned_lanes()}
        ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def _owned_lanes(self) -> list[int]:
        """The lanes this publisher owns under a live lease."""
        return [
            lane
            for (lane,) in self.conn.execute(query("owned_lanes"), {"owner": self.publisher_id})
        ]


#: psycopg's prepare_threshold for the store's connection: statements are
#: prepared only when asked to (see PublisherStore.conn).
_NEVER_BY_COUNT = 2**31 - 1

#: The number of lanes: a message's lane is a hash of its key (or id) modulo
#: 32, and outbox.lanes holds lanes 0 to 31 (schema/0004_lanes.sql).
LANES = 32


def _delivered_locations(
    batch: Batch, settlements: Sequence[Settlement]
) -> tuple[list[int], list[int]] | None:
    """Each message's partition and offset, if the settlements deliver the whole batch in order."""
    partitions: list[int] = []
    offsets: list[int] = []
    if len(settlements) != len(batch.messages):
        return None
    for s, m in zip(settlements, batch.messages, strict=True):
        if (
            s.state is not State.DELIVERED
            or s.partition is None
            or s.offset is None
            or s.message_id != m.id
            or s.fence != m.fence
        ):
            return None
        partitions.append(s.partition)
        offsets.append(s.offset)
    return partitions, offsets


@functools.lru_cache(maxsize=64)
def claim_statement(
    *,
    owner: uuid.UUID,
    lease_seconds: float,
    limit: int,
    horizon: int | None = None,
    template: str | None = None,
) -> str:
    """The claim's SQL (``claim_batch`` or ``template``): ``owner`` leases up to ``limit``
    messages for ``lease_seconds``.

    ``{claimable}`` becomes one ordered branch per lane (``claimable_in_lane``),
    which the planner merges in ``seq`` order. With ``horizon`` (a claim made
    ahead) only the oldest ``horizon`` due messages are candidates
    (``claim_horizon``, merged from ``due_in_lane`` branches), and each branch
    is bounded by it. Every value is written into the text, so the statement
    takes no parameters (see claim_batch).
    """
    if limit < 1 or (horizon is not None and horizon < 1):
        raise ValueError(f"a claim needs limits of at least 1, got {limit} and {horizon}")
    if not math.isfinite(lease_seconds) or lease_seconds <= 0:
        raise ValueError(f"a claim needs a lease of more than 0 seconds, got {lease_seconds}")
    bound = query("horizon_bound") if horizon is not None else ""
    claimable = "\nUNION ALL\n".join(
        query("claimable_in_lane").format(lane=lane, bound=bound, limit=int(limit))
        for lane in range(LANES)
    )
    horizon_cte = ""
    if horizon is not None:
        due = "\nUNION ALL\n".join(
            query("due_in_lane").format(lane=lane, reach=int(horizon) + int(limit))
            for lane in range(LANES)
        )
        horizon_cte = query("claim_horizon").format(due=due, size=int(horizon))
    return (template or query("claim_batch")).format(
        claimable=claimable,
        horizon=horizon_cte,
        limit=int(limit),
        # Literals of types Python checked: a UUID's and a finite float's text.
        owner=f"'{uuid.UUID(str(owner))}'::uuid",
        lease_seconds=f"{float(lease_seconds)!r}::float8",
    )


def array_literal(values: Iterable[object]) -> str:
    """PostgreSQL's text form of an array of ``values`` (None is NULL), for ``%s::type[]``.

    psycopg dumps a list element by element in Python, with a regular
    expression per text element: about a third of a 1,000-message settle.
    One string built here costs a small fraction of that, and PostgreSQL
    parses it in C. Text is always quoted, so any character is safe.
    """
    parts = []
    for v in values:
        if v is None:
            parts.append("NULL")
        elif isinstance(v, bool):
            parts.append("t" if v else "f")
        elif isinstance(v, int | float | uuid.UUID):
            parts.append(str(v))
        elif isinstance(v, str):
            parts.append('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"')
        else:
            raise TypeError(f"array_literal takes str, int, float, bool, UUID or None, not {v!r}")
    return "{" + ",".join(parts) + "}"
