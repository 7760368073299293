"""Writing publication intents in the caller's transaction.

The intent exists only if the caller's transaction commits: the library
sends one INSERT on the caller's connection and never begins, commits or
rolls back anything. A publisher delivers it after the commit.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from outbox.connection import Executor, executor_for
from outbox.errors import InvalidMessage, OutboxError
from outbox.intent import DEFAULT_MAX_VALUE_BYTES, Headers, Intent, build_intent
from outbox.queries import query

#: Rows per INSERT statement in ``enqueue_many``: 7 parameters a row stays far
#: below PostgreSQL's limit of 65,535 parameters per statement.
MAX_ROWS_PER_STATEMENT = 5_000
_ROW = "(%s::uuid, %s::text, %s::bytea, %s::bytea, %s::text[], %s::bytea[], %s::text)"


@dataclass(frozen=True, slots=True)
class Message:
    """One intent for ``enqueue_many``; the fields mean what ``enqueue``'s arguments mean."""

    topic: str
    value: Any
    key: bytes | str | None = None
    headers: Headers | None = None
    idempotency_key: str | None = None


@dataclass(frozen=True, slots=True)
class Outbox:
    """Enqueue with settings of your own; the module-level functions use the defaults.

    ``max_value_bytes`` bounds the encoded value; a larger one raises
    ``ValueTooLarge`` before anything is written.
    """

    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES

    def enqueue(
        self,
        conn: object,
        topic: str,
        value: Any,
        *,
        key: bytes | str | None = None,
        headers: Headers | None = None,
        idempotency_key: str | None = None,
    ) -> uuid.UUID:
        """Write one intent in ``conn``'s open transaction and return its message id.

        With an ``idempotency_key`` already used by a committed (or concurrently
        committing) intent, nothing is written and that intent's id is returned.
        """
        intent = build_intent(
            topic,
            value,
            key=key,
            headers=headers,
            idempotency_key=idempotency_key,
            max_value_bytes=self.max_value_bytes,
        )
        return _insert(executor_for(conn), [intent])[0]

    def enqueue_many(self, conn: object, messages: Iterable[Message]) -> list[uuid.UUID]:
        """Write many intents in one statement (per 5,000) and return their ids in order.

        Every message is validated before the first row is written; the first
        invalid one raises, naming its position.
        """
        intents: list[Intent] = []
        for index, m in enumerate(messages):
            try:
                intents.append(
                    build_intent(
                        m.topic,
                        m.value,
                        key=m.key,
                        headers=m.headers,
                        idempotency_key=m.idempotency_key,
                        max_value_bytes=self.max_value_bytes,
                    )
                )
            except InvalidMessage as exc:
                raise type(exc)(f"message {index}: {exc}") from exc
        if not intents:
            return []
        executor = executor_for(conn)
        ids: list[uuid.UUID] = []
        for start in range(0, len(intents), MAX_ROWS_PER_STATEMENT):
            ids.extend(_insert(executor, intents[start : start + MAX_ROWS_PER_STATEMENT]))
        return ids


def _insert(executor: Executor, intents: Sequence[Intent]) -> list[uuid.UUID]:
    """Insert intents; resolve idempotency conflicts to the ids already stored."""
    sql = query("insert_messages").format(rows=", ".join([_ROW] * len(intents)))
    params: list[Any] = []
    for i in intents:
        params.extend(
            (i.id, i.topic, i.key, i.value, i.header_names, i.header_values, i.idempotency_key)
        )
    inserted = {row[0] for row in executor.fetchall(sql, tuple(params))}
    if len(inserted) == len(intents):
        return [i.id for i in intents]
    # Some keys were taken. This second statement runs with a fresh snapshot
    # (READ COMMITTED), so it also sees an intent that a concurrent transaction
    # committed while our INSERT waited on the unique index.
    missing = [i.idempotency_key for i in intents if i.id not in inserted]
    existing = dict(executor.fetchall(query("ids_by_idempotency_key"), {"keys": missing}))
    ids = []
    for i in intents:
        if i.id in inserted:
            ids.append(i.id)
        elif i.idempotency_key in existing:
            ids.append(existing[i.idempotency_key])
        else:  # the conflicting row vanished between the two statements (a purge)
            raise OutboxError(
                f"idempotency key {i.idempotency_key!r} conflicted but its message is gone; "
                "retry the transaction"
            )
    return ids


_default = Outbox()


def enqueue(
    conn: object,
    topic: str,
    value: Any,
    *,
    key: bytes | str | None = None,
    headers: Headers | None = None,
    idempotency_key: str | None = None,
) -> uuid.UUID:
    """Write one publication intent in ``conn``'s open transaction; return its id.

    ``conn`` is a SQLAlchemy ``Session`` or ``Connection`` or a psycopg 3
    ``Connection``. The intent is published only if that transaction commits.
    ``value`` is bytes, str (UTF-8) or a JSON-serialisable object (sent as JSON
    with a ``content-type: application/json`` header); ``key`` is bytes or str.
    Bad input raises an ``outbox.InvalidMessage`` before anything is written.
    """
    return _default.enqueue(
        conn, topic, value, key=key, headers=headers, idempotency_key=idempotency_key
    )


def enqueue_many(conn: object, messages: Iterable[Message]) -> list[uuid.UUID]:
    """Write many intents in ``conn``'s open transaction; return their ids in order."""
    return _default.enqueue_many(conn, messages)
