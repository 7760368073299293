"""Writing publication intents in the caller's transaction, on an async connection.

The same calls as ``outbox.enqueue`` and ``outbox.enqueue_many``, awaited, for
a psycopg 3 ``AsyncConnection`` or a SQLAlchemy ``AsyncSession`` or
``AsyncConnection`` (driver ``postgresql+psycopg``)::

    async with sessions.begin() as session:         # commits on success, rolls back on error
        session.add(order)
        await outbox.aio.enqueue(session, "orders", {"id": str(order.id)}, key=customer)

They validate, write and resolve idempotency keys exactly as the synchronous
calls do, and likewise never begin, commit or roll back the caller's
transaction. ``Outbox(...).enqueue_async`` and ``.enqueue_many_async`` use
settings of your own.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from outbox.enqueue import Message, Outbox
from outbox.intent import Headers

__all__ = ["Message", "Outbox", "enqueue", "enqueue_many"]

_default = Outbox()


async def enqueue(
    conn: object,
    topic: str,
    value: Any,
    *,
    key: bytes | str | None = None,
    headers: Headers | None = None,
    idempotency_key: str | None = None,
) -> uuid.UUID:
    """Write one publication intent in ``conn``'s open transaction; return its id.

    ``conn`` is a psycopg 3 ``AsyncConnection`` or a SQLAlchemy ``AsyncSession``
    or ``AsyncConnection``; the arguments are those of ``outbox.enqueue``. Bad
    input raises an ``outbox.InvalidMessage`` before anything is sent.
    """
    return await _default.enqueue_async(
        conn, topic, value, key=key, headers=headers, idempotency_key=idempotency_key
    )


async def enqueue_many(conn: object, messages: Iterable[Message]) -> list[uuid.UUID]:
    """Write many intents in ``conn``'s open transaction; return their ids in order.

    It writes all of them or none, even when it fails or its task is
    cancelled part-way (docs/embedding.md, "All or nothing: failures and
    cancellation", says what the transaction is left as).
    """
    return await _default.enqueue_many_async(conn, messages)
