"""Held messages: the pending messages of a key that wait behind its stuck message.

A keyed message waits while an earlier message of its key is uncertain or
quarantined (stuck: only the reconciler or an operator moves it on). Such a
waiting message is marked held (``outbox.messages.held``) so that claims do
not read it again and again: they read only the pending messages that are not
held. Three statements keep the marks (see ``outbox/queries.sql``):

* ``hold_behind_stuck`` marks what waits behind a stuck message; the
  publisher's hold pass runs it for its own lanes (``publisher.holds``);
* ``release_held_of`` releases what waited behind messages that moved on; a
  decision runs it with the move (the reconciler's, an operator's);
* ``release_stale_holds`` releases held messages whose key has nothing stuck
  before them any more (a mark that raced a decision, or one left by a
  publisher that did not release); the publisher runs it after marking.

A mark is never needed for order: the claim counts a held message as holding
its key back, so one marked or released late delays its key, never reorders it.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any

import psycopg

from outbox.queries import query

#: The most messages of one key a statement marks held, or releases; the next pass goes
#: on from there (each statement is a short transaction).
MOST_HELD_PER_KEY = 50_000


def hold_behind_stuck(
    conn: psycopg.Connection[Any], lanes: Collection[int], *, most: int = MOST_HELD_PER_KEY
) -> int:
    """Mark held the pending messages of ``lanes`` that wait behind a stuck message of
    their key, at most ``most`` of each key; return how many were marked."""
    if not lanes:
        return 0
    cursor = conn.execute(query("hold_behind_stuck"), {"lanes": sorted(lanes), "most": most})
    return cursor.rowcount


def release_held_of(
    conn: psycopg.Connection[Any],
    message_ids: Collection[uuid.UUID],
    *,
    most: int = MOST_HELD_PER_KEY,
) -> int:
    """Release what was held behind ``message_ids`` (they moved on), the oldest ``most``
    of each key (the next pass releases the rest); return how many."""
    if not message_ids:
        return 0
    cursor = conn.execute(
        query("release_held_of").format(release_keys=query("release_keys")),
        {"ids": list(message_ids), "most": most},
    )
    return cursor.rowcount


def release_stale_holds_statement() -> str:
    """The statement ``release_stale_holds`` runs, its parts filled in."""
    return query("release_stale_holds").format(
        held_key_hashes=query("held_key_hashes"), release_keys=query("release_keys")
    )


def release_stale_holds(conn: psycopg.Connection[Any], *, most: int = MOST_HELD_PER_KEY) -> int:
    """Release the held messages whose key has nothing stuck before them, the oldest
    ``most`` of each key; return how many."""
    cursor = conn.execute(release_stale_holds_statement(), {"most": most})
    return cursor.rowcount
