"""Writing publication intents in the caller's transaction.

The intent exists only if the caller's transaction commits: the library
sends one INSERT on the caller's connection and never begins, commits or
rolls back the caller's transaction. A publisher delivers it after the commit.
A call that could otherwise end with part of its intents written runs in a
savepoint of its own (see ``_needs_savepoint``).

``outbox.aio`` offers the same calls for async connections. Validation,
the statements and the resolution of idempotency keys are written once here;
the two differ only in how a statement is executed (``_run``, ``_run_async``).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from outbox.connection import (
    AsyncExecutor,
    Executor,
    Params,
    Rows,
    as_uuid,
    async_executor_for,
    executor_for,
)
from outbox.errors import ConnectionInUse, IdempotencyKeyRace, InvalidMessage
from outbox.intent import (
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_KEY_BYTES,
    DEFAULT_MAX_VALUE_BYTES,
    Headers,
    Intent,
    build_intent,
)
from outbox.queries import query

#: Rows per INSERT statement in ``enqueue_many``: 7 parameters a row stays far
#: below PostgreSQL's limit of 65,535 parameters per statement.
MAX_ROWS_PER_STATEMENT = 5_000
#: Bytes of intents (values, keys, headers, topics, idempotency keys) per INSERT
#: statement in ``enqueue_many``, past which the next intent goes into another:
#: PostgreSQL closes the connection on a protocol message over 1 GB, and a
#: driver that sends bytea as hex text (SQLAlchemy with a client-side cursor)
#: doubles it. A statement holds at least one intent, whatever its size.
MAX_BYTES_PER_STATEMENT = 64 * 1024 * 1024
#: The largest each of ``Outbox``'s limits may be: one intent at all three
#: limits, sent as hex text, stays under PostgreSQL's 1 GB.
LARGEST_LIMIT = 100 * 1024 * 1024
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

    ``max_value_bytes`` bounds the encoded value, ``max_key_bytes`` the
    encoded key and ``max_header_bytes`` the caller's header names and values
    together (UTF-8); past one, ``ValueTooLarge``, ``KeyTooLarge`` or
    ``HeadersTooLarge`` is raised before anything is written. A publisher
    holds whole messages in memory, so these bound what one claim costs. ``enqueue_async`` and
    ``enqueue_many_async`` do on an async connection what ``enqueue`` and
    ``enqueue_many`` do on a synchronous one.
    """

    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    max_key_bytes: int = DEFAULT_MAX_KEY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES

    def __post_init__(self) -> None:
        """A limit that is not a positive int is refused here, not at every enqueue."""
        for name in ("max_value_bytes", "max_key_bytes", "max_header_bytes"):
            limit = getattr(self, name)
            if isinstance(limit, bool) or not isinstance(limit, int):
                raise TypeError(f"Outbox {name} must be an int, got {type(limit).__name__}")
            if limit < 1:
                raise ValueError(f"Outbox {name} must be at least 1, got {limit}")
            if limit > LARGEST_LIMIT:
                raise ValueError(
                    f"Outbox {name} must be at most {LARGEST_LIMIT} (100 MiB), got {limit}: "
                    "PostgreSQL takes no statement of 1 GB or more"
                )

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
        intent = self._intent(topic, value, key, headers, idempotency_key)
        return _run(executor_for(conn), [intent])[0]

    def enqueue_many(self, conn: object, messages: Iterable[Message]) -> list[uuid.UUID]:
        """Write many intents in one statement (per 5,000, or 64 MiB) and return their ids
        in order.

        Every message is validated before the first row is written; the first
        invalid one raises, naming its position. The call writes all its
        intents or none (see ``_needs_savepoint``).
        """
        intents = self._intents(messages)
        executor = executor_for(conn)  # checked even for no messages
        return _run(executor, intents) if intents else []

    async def enqueue_async(
        self,
        conn: object,
        topic: str,
        value: Any,
        *,
        key: bytes | str | None = None,
        headers: Headers | None = None,
        idempotency_key: str | None = None,
    ) -> uuid.UUID:
        """``enqueue`` on a psycopg ``AsyncConnection`` or SQLAlchemy ``AsyncSession`` /
        ``AsyncConnection``."""
        intent = self._intent(topic, value, key, headers, idempotency_key)
        return (await _run_async(await async_executor_for(conn), [intent]))[0]

    async def enqueue_many_async(
        self, conn: object, messages: Iterable[Message]
    ) -> list[uuid.UUID]:
        """``enqueue_many`` on an async connection."""
        intents = self._intents(messages)
        executor = await async_executor_for(conn)  # checked even for no messages
        return await _run_async(executor, intents) if intents else []

    def _intent(
        self,
        topic: object,
        value: object,
        key: object,
        headers: Headers | None,
        idempotency_key: object,
    ) -> Intent:
        return build_intent(
            topic,
            value,
            key=key,
            headers=headers,
            idempotency_key=idempotency_key,
            max_value_bytes=self.max_value_bytes,
            max_key_bytes=self.max_key_bytes,
            max_header_bytes=self.max_header_bytes,
        )

    def _intents(self, messages: Iterable[Message]) -> list[Intent]:
        """Validate every message before anything is sent; name the first bad one's position."""
        if isinstance(messages, Message) or not isinstance(messages, Iterable):
            hint = " (put the one message in a list)" if isinstance(messages, Message) else ""
            raise InvalidMessage(
                "messages must be an iterable of outbox.Message, "
                f"got {type(messages).__name__}{hint}"
            )
        intents: list[Intent] = []
        for index, m in enumerate(messages):
            if not isinstance(m, Message):
                raise InvalidMessage(
                    f"message {index}: expected an outbox.Message, got {type(m).__name__}"
                )
            try:
                intents.append(self._intent(m.topic, m.value, m.key, m.headers, m.idempotency_key))
            except InvalidMessage as exc:
                raise type(exc)(f"message {index}: {exc}") from exc
        return intents


#: The psycopg connections an enqueue runs on now, in any thread or task of the
#: process (each held by its call until it ends).
_busy: set[object] = set()
_busy_lock = threading.Lock()


@contextmanager
def _alone_on(driver: object) -> Iterator[None]:
    """Refuse a second enqueue on the psycopg connection ``driver`` while one runs on it
    (another task sharing an async connection, another thread, or another session or
    connection object over the same one): they would share its transaction and its
    savepoints, and one's rollback to its savepoint could undo the other's rows after
    that one returned their ids, with nothing raised (its transaction still commits).
    Keyed by the driver's connection, not the caller's object: a scoped_session is one
    object that gives each thread or task a session of its own."""
    with _busy_lock:
        if driver in _busy:
            raise ConnectionInUse(
                "another enqueue is running on this connection (another task or thread): "
                "one connection is one transaction; give each task or thread its own, or "
                "await one enqueue before the next"
            )
        _busy.add(driver)
    try:
        yield
    finally:
        with _busy_lock:
            _busy.discard(driver)


# The insert is written once, as steps: a generator that yields each statement
# to run and is sent back its rows. ``_run`` drives the steps on a synchronous
# connection and ``_run_async`` on an async one; nothing else differs.
Statement = tuple[str, Params]
Steps = Generator[Statement, Rows, list[uuid.UUID]]


def _run(executor: Executor, intents: Sequence[Intent]) -> list[uuid.UUID]:
    """Run the insert steps of ``intents``, in a savepoint when they need one."""
    statements = _statements(intents)
    steps = _insert(statements)
    with (
        _alone_on(executor.driver),
        executor.savepoint() if _needs_savepoint(statements) else nullcontext(),
    ):
        statement = next(steps)
        while True:
            rows = executor.fetchall(*statement)
            try:
                statement = steps.send(rows)
            except StopIteration as done:
                ids: list[uuid.UUID] = done.value
                return ids


async def _run_async(executor: AsyncExecutor, intents: Sequence[Intent]) -> list[uuid.UUID]:
    """``_run`` on an async connection; a cancelled call rolls back to its savepoint."""
    statements = _statements(intents)
    steps = _insert(statements)
    with _alone_on(executor.driver):
        async with executor.savepoint() if _needs_savepoint(statements) else nullcontext():
            statement = next(steps)
            while True:
                rows = await executor.fetchall(*statement)
                try:
                    statement = steps.send(rows)
                except StopIteration as done:
                    ids: list[uuid.UUID] = done.value
                    return ids


def _size(intent: Intent) -> int:
    """The bytes an intent puts into a statement."""
    return (
        len(intent.value)
        + len(intent.key or b"")
        + sum(len(name.encode()) for name in intent.header_names)
        + sum(len(value) for value in intent.header_values)
        + len(intent.topic.encode())
        + len((intent.idempotency_key or "").encode())
    )


def _statements(intents: Sequence[Intent]) -> list[Sequence[Intent]]:
    """The intents of each INSERT statement, in order: up to ``MAX_ROWS_PER_STATEMENT``
    of them and ``MAX_BYTES_PER_STATEMENT`` of their bytes (at least one intent)."""
    statements: list[Sequence[Intent]] = []
    start = size = 0
    for index, intent in enumerate(intents):
        bytes_ = _size(intent)
        if index > start and (
            index - start >= MAX_ROWS_PER_STATEMENT or size + bytes_ > MAX_BYTES_PER_STATEMENT
        ):
            statements.append(intents[start:index])
            start, size = index, 0
        size += bytes_
    if start < len(intents):
        statements.append(intents[start:])
    return statements


def _needs_savepoint(statements: Sequence[Sequence[Intent]]) -> bool:
    """Whether the call could end, failed or cancelled, with part of its intents written.

    One INSERT writes all its rows or none. A call needs more than one when
    it has more than 5,000 intents or 64 MiB of them; and when an idempotency
    key is taken, a second statement looks it up after the INSERT wrote the
    other rows. Such a call runs in a savepoint: if it raises (or its task is
    cancelled) the savepoint is rolled back to, so none of its rows remain.
    """
    return len(statements) > 1 or (
        len(statements) == 1
        and len(statements[0]) > 1
        and any(i.idempotency_key is not None for i in statements[0])
    )


def _insert(statements: Sequence[Sequence[Intent]]) -> Steps:
    """Insert intents, one statement for each of ``statements``; return their ids in order.

    Each statement locks its keys in one global order (take_key_locks). A
    call of several statements first takes the locks of all its keys, in one
    statement of its own: locked one statement at a time, two such calls
    could each hold a key the other's next statement waits for (a deadlock,
    and PostgreSQL aborts one).
    """
    ids: list[uuid.UUID] = []
    locked_first = False
    if len(statements) > 1:
        keyed = [i for intents in statements for i in intents if i.key is not None]
        if keyed:
            yield (
                query("lock_keys").format(take_key_locks=query("take_key_locks")),
                {
                    "topics": [i.topic for i in keyed],
                    "keys": [i.key for i in keyed],
                },
            )
            locked_first = True
    for intents in statements:
        ids += yield from _insert_statement(intents, lock=not locked_first)
    return ids


def insert_statement(rows: str, *, lock: bool = True) -> str:
    """The enqueue's INSERT (``insert_messages``) of ``rows``, its VALUES rows; it locks
    their keys unless ``lock`` is false. benchmarks/pgbench builds its script with it."""
    return query("insert_messages").format(
        rows=rows, lock="true" if lock else "false", take_key_locks=query("take_key_locks")
    )


def _insert_statement(intents: Sequence[Intent], *, lock: bool) -> Steps:
    """Insert intents in one statement (locking their keys unless ``lock`` is false: they
    are locked already); resolve idempotency conflicts to the ids already stored."""
    sql = insert_statement(", ".join([_ROW] * len(intents)), lock=lock)
    params: list[Any] = []
    for i in intents:
        params.extend(
            (i.id, i.topic, i.key, i.value, i.header_names, i.header_values, i.idempotency_key)
        )
    inserted = {as_uuid(row[0]) for row in (yield sql, tuple(params))}
    if len(inserted) == len(intents):
        return [i.id for i in intents]
    # Some keys were taken. This second statement runs with a fresh snapshot
    # (READ COMMITTED), so it also sees an intent that a concurrent transaction
    # committed while our INSERT waited on the unique index.
    missing = [i.idempotency_key for i in intents if i.id not in inserted]
    existing = {
        key: as_uuid(id_) for key, id_ in (yield query("ids_by_idempotency_key"), {"keys": missing})
    }
    ids = []
    for i in intents:
        if i.id in inserted:
            ids.append(i.id)
        elif i.idempotency_key in existing:
            ids.append(existing[i.idempotency_key])
        else:  # the conflicting row vanished between the two statements (a purge)
            raise IdempotencyKeyRace(
                f"idempotency key {i.idempotency_key!r} conflicted but its message is gone "
                "(purged meanwhile); nothing of this call was written and the transaction is "
                "usable: retry the enqueue"
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
    ``Connection`` (for their async counterparts: ``outbox.aio.enqueue``). The
    intent is published only if that transaction commits.
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
