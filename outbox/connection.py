"""The database seam of the library: run SQL on whatever connection the caller holds.

``enqueue`` accepts a psycopg 3 ``Connection`` or a SQLAlchemy ``Session`` or
``Connection``; ``outbox.aio.enqueue`` accepts their async counterparts (a
psycopg 3 ``AsyncConnection``, a SQLAlchemy ``AsyncSession`` or
``AsyncConnection``). Statements go through SQLAlchemy when the caller uses
it, so that SQLAlchemy's own transaction bookkeeping sees them (a statement
sent behind its back would not be committed by ``conn.commit()``).

Nothing here begins, commits or rolls back the caller's transaction. A
savepoint (``savepoint()``) is the one thing the library opens itself, and it
is always released or rolled back to before the call returns.

SQLAlchemy is optional: it is imported only when ``conn`` is one of its
objects, so a service on psycopg alone never loads it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
    suppress,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from psycopg.pq import PipelineStatus, TransactionStatus
from psycopg.rows import tuple_row

from outbox.errors import ConnectionNotSupported, NoOpenTransaction, TransactionAborted
from outbox.queries import query

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection


def as_uuid(value: object) -> uuid.UUID:
    """An id as read back: a UUID, whatever loader the caller's connection has for the type
    (a text loader returns the string)."""
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


# A tuple, not a list: SQLAlchemy reads a list of parameters as "execute many".
Params = tuple[Any, ...] | Mapping[str, Any]
Rows = list[tuple[Any, ...]]

# The savepoint a multi-statement ``enqueue_many`` runs in on a psycopg
# connection (outbox_enqueue): opened, rolled back to and released by one
# statement each (queries.sql), since a string of two cannot be prepared
# (``prepare_threshold=0``) nor sent in pipeline mode.


@dataclass(frozen=True, slots=True)
class Purpose:
    """What the library checks a caller's connection for, and how a refusal names it."""

    #: "enqueuing": what the caller must roll back before.
    doing: str
    #: What a statement in autocommit mode with no transaction open would do, said in
    #: the refusal; ``None`` when that is no problem (a read).
    autocommit: str | None
    #: The way out for a connection of the other kind, sync or async.
    sync_hint: str
    async_hint: str
    #: Whether the statements can run in pipeline mode (a script of several cannot).
    pipeline: bool = True


ENQUEUE = Purpose(
    doing="enqueuing",
    autocommit="so the intent would commit on its own; enqueue inside a transaction",
    sync_hint=(
        "use outbox.enqueue / outbox.enqueue_many (without await; with an Outbox of your "
        "own settings, its .enqueue / .enqueue_many)"
    ),
    async_hint=(
        "use `await outbox.aio.enqueue(...)` / `await outbox.aio.enqueue_many(...)` (with an "
        "Outbox of your own settings, `await its .enqueue_async(...)` / "
        "`.enqueue_many_async(...)`)"
    ),
)
MIGRATE = Purpose(
    doing="migrating",
    autocommit="so each migration would commit on its own; migrate inside a transaction",
    sync_hint="",  # migrate_connection has no async counterpart
    async_hint=(
        "migrate_connection takes a synchronous connection (on SQLAlchemy's "
        "AsyncConnection: `await conn.run_sync(migrate_connection)`), or run `outbox migrate`"
    ),
    pipeline=False,
)


class Executor(Protocol):
    """Runs statements in the caller's transaction."""

    @property
    def driver(self) -> object:
        """The psycopg connection beneath, whatever wraps it (one transaction, shared by
        every session, connection or proxy over it)."""
        ...

    def fetchall(self, sql: str, params: Params) -> Rows:
        """Execute ``sql`` (which returns rows) with psycopg-style placeholders; all its rows."""
        ...

    def savepoint(self) -> AbstractContextManager[None]:
        """Roll back to a savepoint if the block raises, release it if not."""
        ...


class AsyncExecutor(Protocol):
    """Runs statements in the caller's transaction, on an async connection."""

    @property
    def driver(self) -> object:
        """As ``Executor.driver``."""
        ...

    async def fetchall(self, sql: str, params: Params) -> Rows:
        """Execute ``sql`` with psycopg-style placeholders and return all rows."""
        ...

    def savepoint(self) -> AbstractAsyncContextManager[None]:
        """Roll back to a savepoint if the block raises (or is cancelled), release it if not."""
        ...


@contextmanager
def search_path_pinned(fetchall: Callable[[str, Params], Rows]) -> Iterator[None]:
    """Resolve names in pg_catalog only (``pin_search_path``) for the block, in the
    caller's transaction, and put the caller's path back after it: a savepoint's
    release keeps a transaction-local setting, and the caller's next statements
    would look for its tables in pg_catalog. After a database error the
    transaction is failed, and rolling it (or the savepoint) back undoes the pin."""
    [(previous, _)] = fetchall(query("pin_search_path"), (True,))
    try:
        yield
    finally:
        with suppress(Exception):  # a failed transaction refuses it; see above
            fetchall(query("restore_search_path"), (previous,))


class PsycopgExecutor:
    """Executes on a caller's psycopg 3 connection.

    Every statement goes through a plain client-side ``psycopg.Cursor`` with
    tuple rows, whatever ``cursor_factory`` and ``row_factory`` the caller's
    connection has (a ``RawCursor`` would send the ``%s`` placeholders to the
    server as they are). Rows are always fetched, never judged from
    ``description`` first: in pipeline mode that is unset until they are.
    """

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self.driver = conn

    def fetchall(self, sql: str, params: Params) -> Rows:
        """Execute a statement that returns rows and return them all, as tuples."""
        with psycopg.Cursor(self._conn, row_factory=tuple_row) as cur:
            cur.execute(sql, params)
            return cur.fetchall()

    def _run(self, sql: str) -> None:
        with psycopg.Cursor(self._conn) as cur:
            cur.execute(sql)

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        """A SAVEPOINT statement, not ``conn.transaction()``.

        On a connection whose transaction has not begun yet (no statement
        sent), ``conn.transaction()`` would begin one and commit it at the end
        of the block; a SAVEPOINT statement instead lets psycopg begin the
        caller's transaction as any first statement does, and leaves it open.
        """
        self._run(query("open_enqueue_savepoint"))
        try:
            yield
        except BaseException:
            self._resume_pipeline()
            # If this fails too, the original error says more; the transaction stays failed.
            with suppress(psycopg.Error):
                self._run(query("rollback_to_enqueue_savepoint"))
                self._run(query("release_enqueue_savepoint"))
            raise
        self._run(query("release_enqueue_savepoint"))

    def _resume_pipeline(self) -> None:
        """In pipeline mode, after an error the server skips every statement up to the
        next sync point: send one, so that the rollback to the savepoint runs."""
        if self._conn.pgconn.pipeline_status == PipelineStatus.ABORTED:
            with suppress(psycopg.Error), self._conn.pipeline() as pipeline:
                pipeline.sync()


class AsyncPsycopgExecutor:
    """Executes on a caller's psycopg 3 async connection, as ``PsycopgExecutor`` does."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn
        self.driver = conn

    async def fetchall(self, sql: str, params: Params) -> Rows:
        """Execute a statement that returns rows and return them all, as tuples."""
        async with psycopg.AsyncCursor(self._conn, row_factory=tuple_row) as cur:
            await cur.execute(sql, params)
            return await cur.fetchall()

    async def _run(self, sql: str) -> None:
        async with psycopg.AsyncCursor(self._conn) as cur:
            await cur.execute(sql)

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        """As ``PsycopgExecutor.savepoint``; a cancelled block rolls back too.

        psycopg cancels a statement interrupted by task cancellation in the
        server, which fails the transaction; the rollback to the savepoint
        makes it usable again.
        """
        await self._run(query("open_enqueue_savepoint"))
        try:
            yield
        except BaseException:
            await self._resume_pipeline()
            # If this fails too, the original error says more; the transaction stays failed.
            with suppress(psycopg.Error):
                await self._run(query("rollback_to_enqueue_savepoint"))
                await self._run(query("release_enqueue_savepoint"))
            raise
        await self._run(query("release_enqueue_savepoint"))

    async def _resume_pipeline(self) -> None:
        """As ``PsycopgExecutor._resume_pipeline``."""
        if self._conn.pgconn.pipeline_status == PipelineStatus.ABORTED:
            with suppress(psycopg.Error):
                async with self._conn.pipeline() as pipeline:
                    await pipeline.sync()


#: A caller's connection may stream results (``execution_options(stream_results=True)``,
#: or ``yield_per=N``, which SQLAlchemy turns into streaming for every statement): that
#: opens a server-side cursor, which PostgreSQL refuses for an INSERT (and the caller's
#: transaction would fail). The library's statements never stream.
_CLIENT_CURSOR: dict[str, Any] = {"stream_results": False, "yield_per": None}


class SQLAlchemyExecutor:
    """Executes through a SQLAlchemy connection so its transaction tracks the write."""

    def __init__(self, conn: SAConnection) -> None:
        self._conn = conn
        self.driver = conn.connection.driver_connection

    def fetchall(self, sql: str, params: Params) -> Rows:
        """Execute with ``exec_driver_sql``: the SQL goes to psycopg unchanged."""
        result = self._conn.exec_driver_sql(sql, params, execution_options=_CLIENT_CURSOR)
        return [tuple(row) for row in result] if result.returns_rows else []

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        """SQLAlchemy's own nested transaction, so that it knows about the savepoint."""
        with _not_streaming(self._conn), self._conn.begin_nested():
            yield


class AsyncSQLAlchemyExecutor:
    """Executes through a SQLAlchemy async connection so its transaction tracks the write."""

    def __init__(self, conn: SAAsyncConnection, driver: object) -> None:
        self._conn = conn
        self.driver = driver

    async def fetchall(self, sql: str, params: Params) -> Rows:
        """Execute with ``exec_driver_sql``: the SQL goes to psycopg unchanged."""
        result = await self._conn.exec_driver_sql(sql, params, execution_options=_CLIENT_CURSOR)
        return [tuple(row) for row in result] if result.returns_rows else []

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        """SQLAlchemy's own nested transaction, so that it knows about the savepoint."""
        with _not_streaming(self._conn.sync_connection):
            async with self._conn.begin_nested():
                yield


@contextmanager
def _not_streaming(conn: SAConnection | None) -> Iterator[None]:
    """Turn a connection's streaming (``stream_results``, ``yield_per``) off while a
    savepoint opens and ends.

    SQLAlchemy sends SAVEPOINT, RELEASE and ROLLBACK TO with the connection's
    own options, and on a streaming one runs them in a server-side cursor
    (``DECLARE ... CURSOR FOR SAVEPOINT``: a syntax error that aborts the
    caller's transaction). A connection's options change in place, so the
    caller's settings are put back when the block ends.
    """
    options = {} if conn is None else conn.get_execution_options()
    if conn is None or not any(options.get(name) for name in _CLIENT_CURSOR):
        yield
        return
    conn.execution_options(**_CLIENT_CURSOR)
    try:
        yield
    finally:
        conn.execution_options(
            **{name: options.get(name, off) for name, off in _CLIENT_CURSOR.items()}
        )


def executor_for(conn: object, purpose: Purpose = ENQUEUE) -> Executor:
    """Return an executor for ``conn`` after checking it has a usable open transaction."""
    if isinstance(conn, psycopg.Connection):
        if conn.pgconn.pipeline_status != PipelineStatus.OFF:
            _check_pipeline(purpose)
            # In pipeline mode the transaction's status is known only at a sync point.
            # A statement of the caller's that failed meanwhile raises here.
            try:
                with conn.pipeline() as pipeline:
                    pipeline.sync()
            except psycopg.Error as exc:
                _failed_in_pipeline(conn, exc, purpose)
                with conn.pipeline() as pipeline:
                    pipeline.sync()  # see _failed_in_pipeline
        _check_transaction(conn, purpose)
        return PsycopgExecutor(conn)
    if isinstance(conn, psycopg.AsyncConnection):
        raise _wrong_kind(conn, "an async connection", purpose.async_hint)
    if _from_sqlalchemy(conn):
        return _sqlalchemy_executor(conn, purpose)
    raise _unsupported(conn)


async def async_executor_for(conn: object, purpose: Purpose = ENQUEUE) -> AsyncExecutor:
    """Return an executor for the async ``conn`` after checking its transaction."""
    if isinstance(conn, psycopg.AsyncConnection):
        if conn.pgconn.pipeline_status != PipelineStatus.OFF:
            _check_pipeline(purpose)
            try:
                async with conn.pipeline() as pipeline:
                    await pipeline.sync()
            except psycopg.Error as exc:
                _failed_in_pipeline(conn, exc, purpose)
                async with conn.pipeline() as pipeline:
                    await pipeline.sync()  # see _failed_in_pipeline
        _check_transaction(conn, purpose)
        return AsyncPsycopgExecutor(conn)
    if isinstance(conn, psycopg.Connection):
        raise _wrong_kind(conn, "a synchronous connection", purpose.sync_hint)
    if _from_sqlalchemy(conn):
        return await _async_sqlalchemy_executor(conn, purpose)
    raise _unsupported(conn)


def _from_sqlalchemy(conn: object) -> bool:
    """Whether ``conn``'s class (or a base of it) comes from SQLAlchemy, without importing it."""
    return any(cls.__module__.partition(".")[0] == "sqlalchemy" for cls in type(conn).__mro__)


def _sqlalchemy_executor(conn: object, purpose: Purpose) -> Executor:
    from sqlalchemy.engine import Connection  # noqa: PLC0415 - SQLAlchemy is optional
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession  # noqa: PLC0415
    from sqlalchemy.orm import Session  # noqa: PLC0415

    conn = unscoped(conn)
    if isinstance(conn, AsyncSession | AsyncConnection):
        raise _wrong_kind(conn, "an async connection", purpose.async_hint)
    if isinstance(conn, Session):
        with _bound(conn, purpose):
            _refuse_async_view(conn, conn.get_bind().dialect, purpose)
            conn = conn.connection()
    if not isinstance(conn, Connection):
        raise _unsupported(conn)
    _refuse_async_view(conn, conn.dialect, purpose)
    _check_valid(conn, purpose)
    _check_driver(
        conn.connection.driver_connection, conn.dialect.name, conn.dialect.driver, purpose
    )
    return SQLAlchemyExecutor(conn)


async def _async_sqlalchemy_executor(conn: object, purpose: Purpose) -> AsyncExecutor:
    from sqlalchemy.engine import Connection  # noqa: PLC0415 - SQLAlchemy is optional
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession  # noqa: PLC0415
    from sqlalchemy.orm import Session  # noqa: PLC0415

    conn = unscoped(conn)
    if isinstance(conn, Session | Connection):
        if isinstance(conn, Session):
            with _bound(conn, purpose):
                dialect = conn.get_bind().dialect
        else:
            dialect = conn.dialect
        if getattr(dialect, "is_async", False):
            raise _wrong_kind(
                conn,
                "the synchronous view of an async engine's session or connection",
                "pass the AsyncSession or AsyncConnection itself",
            )
        raise _wrong_kind(conn, "a synchronous connection", purpose.sync_hint)
    if isinstance(conn, AsyncSession):
        with _bound(conn, purpose):
            conn = await conn.connection()
    if not isinstance(conn, AsyncConnection):
        raise _unsupported(conn)
    _check_valid(conn, purpose)
    raw = await conn.get_raw_connection()
    _check_driver(raw.driver_connection, conn.dialect.name, conn.dialect.driver, purpose)
    return AsyncSQLAlchemyExecutor(conn, raw.driver_connection)


def _refuse_async_view(conn: object, dialect: Any, purpose: Purpose) -> None:
    """Refuse the synchronous view of an async engine's session or connection
    (``AsyncSession.sync_session``, ``AsyncConnection.sync_connection``) outside
    ``run_sync``: it cannot send a statement there, and SQLAlchemy would say so only as
    ``MissingGreenlet`` (after trying, for a connection)."""
    from sqlalchemy.util.concurrency import in_greenlet  # noqa: PLC0415

    if getattr(dialect, "is_async", False) and not in_greenlet():
        raise ConnectionNotSupported(
            f"conn is the synchronous view of an async engine's session or connection "
            f"({_kind(conn)}), which sends nothing outside run_sync: pass the AsyncSession "
            f"or AsyncConnection itself and {purpose.async_hint.removeprefix('use ')}, or "
            "call this inside `await session.run_sync(...)`"
        )


def unscoped(conn: object) -> object:
    """The current session of a ``scoped_session`` (Flask-SQLAlchemy's ``db.session``) or
    ``async_scoped_session``; anything else as it is."""
    from sqlalchemy.ext.asyncio import async_scoped_session  # noqa: PLC0415
    from sqlalchemy.orm import scoped_session  # noqa: PLC0415

    if isinstance(conn, scoped_session | async_scoped_session):
        return conn()
    return conn


@contextmanager
def _bound(session: object, purpose: Purpose) -> Iterator[None]:
    """Name the way out when a session cannot give its connection: it has no default bind
    to take one from, or its transaction failed (a flush or statement raised)."""
    from sqlalchemy.exc import PendingRollbackError, UnboundExecutionError  # noqa: PLC0415

    try:
        yield
    except PendingRollbackError as exc:
        raise TransactionAborted(
            f"the {_kind(session)}'s transaction has already failed (an earlier flush or "
            f"statement raised); roll it back before {purpose.doing}"
        ) from exc
    except UnboundExecutionError as exc:
        raise ConnectionNotSupported(
            f"the {_kind(session)} has no default bind (it binds per mapper or table), so "
            "the library cannot tell which database your rows go to; pass the connection "
            "they use instead: session.connection(bind_arguments={'mapper': YourModel})"
        ) from exc


def _check_valid(conn: SAConnection | SAAsyncConnection, purpose: Purpose) -> None:
    """A SQLAlchemy connection invalidated in its transaction (its DBAPI connection was
    lost, or an async task was cancelled in a statement) needs a rollback first; after
    it, the connection reconnects on its next statement."""
    if conn.invalidated and conn.in_transaction():
        raise TransactionAborted(
            f"the SQLAlchemy connection was invalidated in its transaction (its database "
            f"connection was lost or closed); roll it back before {purpose.doing}"
        )


def _check_driver(driver: object, dialect: str, name: str, purpose: Purpose) -> None:
    """Refuse a SQLAlchemy connection on another driver than psycopg 3."""
    if not isinstance(driver, psycopg.Connection | psycopg.AsyncConnection):
        raise ConnectionNotSupported(
            f"the SQLAlchemy connection uses the {dialect}+{name} driver; outbox needs "
            "psycopg 3 (a 'postgresql+psycopg://' URL, for sync and async engines alike)"
        )
    _check_transaction(driver, purpose)


def _kind(conn: object) -> str:
    return f"{type(conn).__module__}.{type(conn).__qualname__}"


def _wrong_kind(conn: object, what: str, hint: str) -> ConnectionNotSupported:
    return ConnectionNotSupported(f"conn is {what} ({_kind(conn)}); {hint}")


def _check_pipeline(purpose: Purpose) -> None:
    if not purpose.pipeline:
        raise ConnectionNotSupported(
            f"the connection is in pipeline mode, where {purpose.doing} cannot run (its "
            "scripts hold several statements each); call it outside the `with conn.pipeline()` "
            "block"
        )


def _unsupported(conn: object) -> ConnectionNotSupported:
    return ConnectionNotSupported(
        "conn must be a psycopg 3 Connection or a SQLAlchemy Session or Connection "
        "(outbox.enqueue), or a psycopg 3 AsyncConnection or a SQLAlchemy AsyncSession "
        f"or AsyncConnection (outbox.aio.enqueue), got {_kind(conn)}"
    )


def _aborted(purpose: Purpose) -> str:
    return f"the transaction has already failed; roll it back before {purpose.doing}"


def _failed_in_pipeline(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    error: psycopg.Error,
    purpose: Purpose,
) -> None:
    """A statement of the caller's failed in pipeline mode (its error came with the sync).

    Outside autocommit every statement runs in the caller's transaction, which
    the failure aborted: say so now. libpq may not have read the server's new
    transaction status yet when the sync returns (it can still say ACTIVE), so
    the status is no proof. In autocommit the failed statement may have been a
    transaction of its own, or one of a ``conn.transaction()`` block: the
    caller syncs once more, which returns with the status read, and the status
    check decides.
    """
    if not conn.autocommit:
        raise TransactionAborted(_aborted(purpose)) from error


def _check_transaction(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], purpose: Purpose
) -> None:
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise TransactionAborted(_aborted(purpose))
    if purpose.autocommit and conn.autocommit and status == TransactionStatus.IDLE:
        raise NoOpenTransaction(
            f"the connection is in autocommit mode with no transaction open, {purpose.autocommit} "
            "(psycopg: `with conn.transaction():`, SQLAlchemy: a non-AUTOCOMMIT connection)"
        )
