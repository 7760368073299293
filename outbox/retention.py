"""Retention: delete delivered messages, and later their evidence, in small steps.

``purge`` never deletes a message that is not delivered. It deletes:

* delivered messages delivered (and enqueued) longer ago than
  ``delivered_older_than`` (at least ``MIN_DELIVERED_AGE``, 5 minutes),
  except those of a key whose earlier message is still open (pending, in
  flight, uncertain or quarantined): the reconciler reads them as proof that
  the key moved on, and an uncertain message proven absent is then not sent
  again out of order;
* attempts and decisions of messages that are gone (purged), once those
  messages were enqueued longer ago than ``evidence_older_than``; the
  evidence of a message that still exists is never deleted;
* batches claimed longer ago than ``evidence_older_than``, except those an
  in-flight or uncertain message still needs, and those a quarantined message
  names (what was sent with it: an operator's retry checks it).

Each step deletes at most ``batch_size`` rows in its own short transaction,
walking the primary keys (message ids are UUIDv7, so id order is enqueue
order) with a cursor, so purge neither holds long locks nor rereads rows.
A deleted message frees its idempotency key: enqueues are deduplicated only
for as long as their message is kept.

One purge runs at a time per database (a session advisory lock); another one
started meanwhile raises ``PurgeBusy`` instead of deleting the same rows twice.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg

from outbox.errors import OutboxError
from outbox.migrations import MIGRATION_LOCK_KEY
from outbox.queries import query

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

#: Evidence (attempts, decisions, batches) outlives its purged message by default.
DEFAULT_EVIDENCE_AGE = timedelta(days=30)
#: Rows deleted per step (and per transaction).
DEFAULT_BATCH_SIZE = 1000
#: The shortest delivered window a purge accepts. A delivered message may be
#: the evidence that its key moved on past an earlier uncertain one, which the
#: reconciler decides only after the sender's write deadline and the absence
#: grace (with the publisher's defaults, 60 s + 60 s). Purge keeps such a
#: message while the earlier one is open anyway (see purge_delivered); this
#: floor is the second line, with room for longer Kafka timeouts. A publisher
#: refuses a window shorter than its own write deadline plus absence grace.
MIN_DELIVERED_AGE = timedelta(minutes=5)

#: The longest window a purge accepts.
MAX_RETENTION = timedelta(weeks=520)

_ZERO_ID = uuid.UUID(int=0)
#: Key of the session advisory lock a purge holds (next to the migrations' one).
PURGE_LOCK_KEY = MIGRATION_LOCK_KEY + 1


class PurgeBusy(OutboxError):
    """Another purge (``outbox purge`` or a publisher's retention pass) is running."""


def parse_duration(text: str) -> timedelta:
    """Parse ``30s``, ``15m``, ``12h``, ``7d`` or ``2w``; ``ValueError`` says what is accepted."""
    match = _DURATION_RE.match(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a duration: use a number and a unit, s, m, h, d or w (e.g. 7d)"
        )
    seconds = float(match[1]) * _UNIT_SECONDS[match[2]]
    if seconds <= 0:
        raise ValueError(f"{text!r}: a retention period must be longer than zero")
    if seconds > MAX_RETENTION.total_seconds():
        # Also keeps the cut-off after 1970, where message ids (UUIDv7) begin.
        raise ValueError(
            f"{text!r}: a retention period must be at most {MAX_RETENTION.days // 7}w "
            "(about ten years); to keep rows for ever, turn retention off"
        )
    return timedelta(seconds=seconds)


def _words(age: timedelta) -> str:
    """``7 days``, ``5 minutes``, ``90 seconds``: a window as people say it."""
    seconds = age.total_seconds()
    for unit, size in (("day", 86_400), ("hour", 3_600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = seconds / size
            return f"{count:.15g} {unit}{'' if count == 1 else 's'}"
    return f"{seconds:.15g} second{'' if seconds == 1 else 's'}"


@dataclass(frozen=True, slots=True)
class PurgeReport:
    """How many rows a purge deleted (or, in a dry run, would delete)."""

    messages: int = 0
    attempts: int = 0
    decisions: int = 0
    batches: int = 0
    #: Transactions the purge took (0 in a dry run).
    steps: int = 0


def evidence_age_for(delivered_older_than: timedelta) -> timedelta:
    """The evidence window when none is given: ``DEFAULT_EVIDENCE_AGE``, or the delivered
    window when that is longer (evidence never goes before the messages it explains)."""
    return max(DEFAULT_EVIDENCE_AGE, delivered_older_than)


def check_windows(
    delivered_older_than: timedelta,
    evidence_older_than: timedelta | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> timedelta:
    """The evidence window these purge settings give (``evidence_age_for`` the delivered
    one when none is given); ``ValueError`` naming what is wrong with them, before any SQL."""
    if evidence_older_than is None:
        evidence_older_than = evidence_age_for(delivered_older_than)
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    for name, age in (
        ("delivered_older_than", delivered_older_than),
        ("evidence_older_than", evidence_older_than),
    ):
        if age <= timedelta(0):
            raise ValueError(f"{name} must be longer than zero, got {_words(age)}")
        if age > MAX_RETENTION:
            raise ValueError(f"{name} must be at most {MAX_RETENTION.days} days, got {_words(age)}")
    if delivered_older_than < MIN_DELIVERED_AGE:
        raise ValueError(
            f"the delivered window ({_words(delivered_older_than)}) is shorter than the minimum, "
            f"{_words(MIN_DELIVERED_AGE)}: a delivered message must outlive the write deadline "
            "and absence grace of the uncertain messages before it"
        )
    if evidence_older_than < delivered_older_than:
        raise ValueError(
            f"the evidence window ({_words(evidence_older_than)}) must be at least the delivered "
            f"window ({_words(delivered_older_than)}): evidence must not go before the messages "
            "it explains"
        )
    return evidence_older_than


def purge(
    conn: psycopg.Connection[Any],
    *,
    delivered_older_than: timedelta,
    evidence_older_than: timedelta | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    dry_run: bool = False,
    should_stop: Callable[[], bool] = lambda: False,
) -> PurgeReport:
    """Delete what retention allows, ``batch_size`` rows per transaction; return the counts.

    ``conn`` is committed after every step, so pass a connection of your own,
    not one in the middle of a business transaction. ``should_stop`` is asked
    between steps (the publisher stops a purge when it is asked to stop).
    Without ``evidence_older_than``, evidence goes after ``evidence_age_for``
    the delivered window. Settings ``check_windows`` refuses raise ``ValueError``.
    """
    evidence_older_than = check_windows(delivered_older_than, evidence_older_than, batch_size)
    if dry_run:
        return _count(conn, delivered_older_than, evidence_older_than)
    locked = conn.execute(query("purge_lock"), (PURGE_LOCK_KEY,)).fetchone()
    conn.commit()
    if not locked or not locked[0]:
        raise PurgeBusy("another purge is running on this database; try again when it is done")
    try:
        return _purge(conn, delivered_older_than, evidence_older_than, batch_size, should_stop)
    finally:
        # A failed step leaves its transaction aborted: end it first. If the
        # connection itself is gone, so is the lock; the first error stands.
        with contextlib.suppress(psycopg.Error):
            conn.rollback()
            conn.execute(query("purge_unlock"), (PURGE_LOCK_KEY,))
            conn.commit()


def _purge(
    conn: psycopg.Connection[Any],
    delivered_older_than: timedelta,
    evidence_older_than: timedelta,
    batch_size: int,
    should_stop: Callable[[], bool],
) -> PurgeReport:
    steps = 0

    def walk(name: str, age: timedelta, first: tuple[Any, Any]) -> int:
        nonlocal steps
        cursor, deleted = first, 0
        while not should_stop():
            with conn.cursor() as cur:
                cur.execute(
                    query(name),
                    {"after": cursor[0], "after_n": cursor[1], "age": age, "limit": batch_size},
                )
                row = cur.fetchone()
            conn.commit()
            steps += 1
            if row is None:  # not reached: each step query returns one row
                break
            *last, count = row
            deleted += count
            if last[0] is None:
                break
            cursor = (last[0], last[1] if len(last) > 1 else 0)
        return deleted

    # Messages first, so that their evidence becomes purgeable in the same run.
    messages = walk("purge_delivered", delivered_older_than, (_ZERO_ID, 0))
    attempts = walk("purge_attempts", evidence_older_than, (_ZERO_ID, 0))
    decisions = walk("purge_decisions", evidence_older_than, (_ZERO_ID, 0))
    batches = walk("purge_batches", evidence_older_than, (0, 0))
    return PurgeReport(messages, attempts, decisions, batches, steps)


def _count(
    conn: psycopg.Connection[Any], delivered_older_than: timedelta, evidence_older_than: timedelta
) -> PurgeReport:
    """What a purge would delete, counted in one statement (see count_to_purge)."""
    row = conn.execute(
        query("count_to_purge"),
        {"delivered": delivered_older_than, "evidence": evidence_older_than},
    ).fetchone()
    conn.rollback()
    return PurgeReport(*row) if row else PurgeReport()
