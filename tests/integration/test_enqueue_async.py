"""outbox.aio: enqueue in the caller's transaction on psycopg and SQLAlchemy async connections.

Each behaviour is checked on the three async connection types, against the
real PostgreSQL and, for delivery, the real Kafka. The savepoint that keeps
a multi-statement ``enqueue_many`` whole is checked on the synchronous types too.
"""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    AsyncExitStack,
    asynccontextmanager,
    contextmanager,
    nullcontext,
)
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg.pq import TransactionStatus
from sqlalchemy.ext.asyncio import (
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session, scoped_session, sessionmaker

import outbox
import outbox.aio
from outbox.enqueue import MAX_ROWS_PER_STATEMENT
from tests.support import publish_until_idle, read_topic, wait_until, waiting_on_lock

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _sa_url(database_url: str) -> str:
    return database_url.replace("postgresql://", "postgresql+psycopg://", 1)


def _committed(database_url: str) -> list[tuple[uuid.UUID, bytes]]:
    """(id, value) of every committed message, in insertion order."""
    with psycopg.connect(database_url) as conn:
        return conn.execute("SELECT id, value FROM outbox.messages ORDER BY seq").fetchall()


# --- the async connection types ------------------------------------------------------------

AsyncOpener = Callable[..., AbstractAsyncContextManager[Any]]


@asynccontextmanager
async def _psycopg(url: str, **connect_args: Any) -> AsyncIterator[Any]:
    # Closed without commit: what the test did not commit is rolled back.
    conn = await psycopg.AsyncConnection.connect(url, **connect_args)
    try:
        yield conn
    finally:
        await conn.close()


@asynccontextmanager
async def _sa_connection(url: str, **connect_args: Any) -> AsyncIterator[Any]:
    engine = create_async_engine(_sa_url(url), poolclass=sa.NullPool, connect_args=connect_args)
    try:
        async with engine.connect() as conn:
            yield conn
    finally:
        await engine.dispose()


@asynccontextmanager
async def _sa_session(url: str, **connect_args: Any) -> AsyncIterator[Any]:
    engine = create_async_engine(_sa_url(url), poolclass=sa.NullPool, connect_args=connect_args)
    try:
        async with AsyncSession(engine) as session:
            yield session
    finally:
        await engine.dispose()


ASYNC_OPENERS = pytest.mark.parametrize(
    "opener",
    [_psycopg, _sa_connection, _sa_session],
    ids=["psycopg-async", "sa-async-connection", "sa-async-session"],
)


@asynccontextmanager
async def _psycopg_pipeline(url: str, **connect_args: Any) -> AsyncIterator[Any]:
    async with _psycopg(url, **connect_args) as conn, conn.pipeline():
        yield conn


@asynccontextmanager
async def _sa_scoped_session(url: str, **connect_args: Any) -> AsyncIterator[Any]:
    engine = create_async_engine(_sa_url(url), poolclass=sa.NullPool, connect_args=connect_args)
    scoped = async_scoped_session(async_sessionmaker(engine), scopefunc=asyncio.current_task)
    try:
        yield scoped
    finally:
        await scoped.remove()
        await engine.dispose()


#: The async connection types, and the settings of a caller's connection that
#: change how statements are sent: each runs the savepoint's paths.
ASYNC_VARIANTS = pytest.mark.parametrize(
    "opener",
    [
        _psycopg,
        functools.partial(_psycopg, cursor_factory=psycopg.AsyncRawCursor),
        functools.partial(_psycopg, cursor_factory=psycopg.AsyncClientCursor),
        functools.partial(_psycopg, prepare_threshold=0),
        _psycopg_pipeline,
        _sa_connection,
        _sa_session,
        _sa_scoped_session,
    ],
    ids=[
        "psycopg-async",
        "psycopg-async-raw-cursor",
        "psycopg-async-client-cursor",
        "psycopg-async-prepared-at-once",
        "psycopg-async-pipeline",
        "sa-async-connection",
        "sa-async-session",
        "sa-async-scoped-session",
    ],
)


async def _scalar(conn: Any, sql: str) -> Any:
    """Run ``sql`` in ``conn``'s transaction and return its one value."""
    if isinstance(conn, psycopg.AsyncConnection):
        row = await (await conn.execute(sql)).fetchone()
        assert row is not None
        return row[0]
    return (await conn.execute(sa.text(sql))).scalar_one()


async def _until_waiting_on_lock(database_url: str, application_name: str) -> None:
    """Wait (off the event loop, with a deadline) until that backend waits on a lock."""
    await asyncio.to_thread(
        wait_until,
        lambda: waiting_on_lock(database_url, application_name),
        timeout=10,
        what=f"{application_name} to wait on a lock",
    )


@contextmanager
def _key_held(database_url: str, topic: str, key: str) -> Iterator[None]:
    """Another transaction holds ``key``'s lock: an enqueue of that key waits until it ends."""
    with psycopg.connect(database_url) as blocker:
        outbox.enqueue(blocker, topic, b"held", key=key)
        try:
            yield
        finally:
            blocker.rollback()


def _bulk_then(key: str) -> list[outbox.Message]:
    """More messages than one statement takes; only the last, in the second statement, is keyed."""
    return [outbox.Message("t", b"bulk") for _ in range(MAX_ROWS_PER_STATEMENT)] + [
        outbox.Message("t", b"last", key=key)
    ]


# --- commit, rollback -------------------------------------------------------------------------


@ASYNC_OPENERS
def test_committed_intents_are_delivered_to_kafka(
    database_url: str, kafka_bootstrap: str, topic: str, opener: AsyncOpener
) -> None:
    """enqueue and enqueue_many in a committed transaction: a publisher delivers each once."""

    async def test() -> tuple[uuid.UUID, list[uuid.UUID]]:
        async with opener(database_url) as conn:
            one = await outbox.aio.enqueue(conn, topic, {"n": 0}, key="k", headers={"h": "v"})
            many = await outbox.aio.enqueue_many(
                conn, [outbox.Message(topic, f"m{i}", key="k") for i in range(1, 4)]
            )
            await conn.commit()
        return one, many

    one, many = asyncio.run(test())
    publish_until_idle(database_url, kafka_bootstrap)
    records = read_topic(kafka_bootstrap, topic)
    assert [(r.outbox_id, r.key, r.value) for r in records] == [
        (one, b"k", b'{"n":0}'),
        *[(mid, b"k", f"m{i}".encode()) for i, mid in enumerate(many, start=1)],
    ]
    assert records[0].header("h") == b"v"


@ASYNC_OPENERS
def test_rolled_back_intents_are_never_published(
    database_url: str, kafka_bootstrap: str, topic: str, opener: AsyncOpener
) -> None:
    """A rolled-back transaction's intents are not stored and never reach Kafka."""

    async def test() -> uuid.UUID:
        async with opener(database_url) as conn:
            await outbox.aio.enqueue(conn, topic, b"rolled back")
            await outbox.aio.enqueue_many(conn, [outbox.Message(topic, b"rolled back too")])
            await conn.rollback()
            kept = await outbox.aio.enqueue(conn, topic, b"committed")
            await conn.commit()
        return kept

    kept = asyncio.run(test())
    assert _committed(database_url) == [(kept, b"committed")]
    publish_until_idle(database_url, kafka_bootstrap)
    assert [(r.outbox_id, r.value) for r in read_topic(kafka_bootstrap, topic)] == [
        (kept, b"committed")
    ]


# --- idempotency keys -------------------------------------------------------------------------


@ASYNC_OPENERS
def test_idempotency_key_race_between_two_async_transactions(
    database_url: str, opener: AsyncOpener
) -> None:
    """The second transaction waits on the unique index, then returns the first's id."""
    name = f"racer-{uuid.uuid4().hex[:8]}"

    async def test() -> tuple[uuid.UUID, uuid.UUID]:
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(opener(database_url))
            second = await stack.enter_async_context(opener(database_url, application_name=name))
            first_id = await outbox.aio.enqueue(first, "orders", b"first", idempotency_key="pay-9")
            racer = asyncio.create_task(
                outbox.aio.enqueue(second, "orders", b"second", idempotency_key="pay-9")
            )
            await _until_waiting_on_lock(database_url, name)
            assert not racer.done()
            await first.commit()
            second_id = await asyncio.wait_for(racer, timeout=10)
            await second.commit()
        return first_id, second_id

    first_id, second_id = asyncio.run(test())
    assert second_id == first_id
    assert _committed(database_url) == [(first_id, b"first")]


# --- bad input --------------------------------------------------------------------------------


@ASYNC_OPENERS
def test_invalid_input_raises_before_sql_and_keeps_the_transaction_usable(
    database_url: str, opener: AsyncOpener
) -> None:
    """Bad input raises an InvalidMessage; the same transaction goes on and commits."""

    async def test() -> tuple[uuid.UUID, uuid.UUID]:
        async with opener(database_url) as conn:
            good = await outbox.aio.enqueue(conn, "orders", b"first")
            bad_calls: list[Callable[[], Awaitable[object]]] = [
                lambda: outbox.aio.enqueue(conn, "", b"x"),
                lambda: outbox.aio.enqueue(conn, "bad topic!", b"x"),
                lambda: outbox.aio.enqueue(conn, "orders", object()),
                lambda: outbox.aio.enqueue(conn, "orders", b"x", headers={"h": 1}),  # type: ignore[arg-type]
                lambda: outbox.aio.enqueue(conn, "orders", b"x", key=5),  # type: ignore[arg-type]
                lambda: outbox.aio.enqueue(conn, "orders", b"x", idempotency_key=""),
                lambda: outbox.Outbox(max_value_bytes=10).enqueue_async(conn, "orders", b"x" * 11),
                lambda: outbox.aio.enqueue_many(
                    conn, [outbox.Message("orders", b"ok"), outbox.Message("orders", {1j})]
                ),
            ]
            for call in bad_calls:
                with pytest.raises(outbox.InvalidMessage):
                    await call()
            assert await _scalar(conn, "SELECT count(*) FROM outbox.messages") == 1
            second = await outbox.aio.enqueue(conn, "orders", b"second")
            await conn.commit()
        return good, second

    good, second = asyncio.run(test())
    assert _committed(database_url) == [(good, b"first"), (second, b"second")]


def test_a_connection_of_the_other_kind_is_refused_with_the_api_to_use(
    database_url: str,
) -> None:
    """Sync enqueue on an async connection points to outbox.aio, and the reverse."""

    async def test() -> None:
        for opener in (_psycopg, _sa_connection, _sa_session):
            async with opener(database_url) as conn:
                with pytest.raises(outbox.ConnectionNotSupported, match=r"outbox\.aio\.enqueue"):
                    outbox.enqueue(conn, "orders", b"x")
                with pytest.raises(outbox.ConnectionNotSupported, match=r"outbox\.aio\.enqueue"):
                    outbox.enqueue_many(conn, [outbox.Message("orders", b"x")])
                # An Outbox of one's own settings is pointed to its own async methods,
                # not to the module's calls, which would drop those settings.
                with pytest.raises(outbox.ConnectionNotSupported, match=r"\.enqueue_async"):
                    outbox.Outbox(max_value_bytes=10).enqueue(conn, "orders", b"x")
        engine = sa.create_engine(_sa_url(database_url), poolclass=sa.NullPool)
        try:
            with psycopg.connect(database_url) as c, engine.connect() as sc, Session(engine) as s:
                for conn in (c, sc, s):
                    with pytest.raises(outbox.ConnectionNotSupported, match=r"outbox\.enqueue "):
                        await outbox.aio.enqueue(conn, "orders", b"x")
                    with pytest.raises(outbox.ConnectionNotSupported, match=r"its \.enqueue "):
                        await outbox.Outbox().enqueue_async(conn, "orders", b"x")
        finally:
            engine.dispose()
        with pytest.raises(outbox.ConnectionNotSupported, match="AsyncSession"):
            await outbox.aio.enqueue(object(), "orders", b"x")

    asyncio.run(test())
    assert _committed(database_url) == []


def test_the_synchronous_view_of_an_async_session_works_only_in_run_sync(
    database_url: str,
) -> None:
    """AsyncSession.sync_session and AsyncConnection.sync_connection send nothing outside
    run_sync: refused there, naming what to pass instead, by either call (SQLAlchemy said
    only MissingGreenlet); inside run_sync, outbox.enqueue writes in the transaction."""

    async def test() -> list[uuid.UUID]:
        written = []
        for opener in (_sa_session, _sa_connection):
            async with opener(database_url) as conn:
                view = conn.sync_session if hasattr(conn, "sync_session") else conn.sync_connection
                with pytest.raises(outbox.ConnectionNotSupported, match="run_sync") as refused:
                    outbox.enqueue(view, "orders", b"x")
                assert "synchronous view of an async engine" in str(refused.value)
                with pytest.raises(outbox.ConnectionNotSupported, match="itself"):
                    await outbox.aio.enqueue(view, "orders", b"x")
                written.append(
                    await conn.run_sync(lambda sync: outbox.enqueue(sync, "orders", b"in"))
                )
                await conn.commit()
        return written

    written = asyncio.run(test())
    assert [row[0] for row in _committed(database_url)] == written


def test_an_async_connection_in_autocommit_or_a_failed_transaction_is_refused(
    database_url: str,
) -> None:
    """The transaction checks of the synchronous enqueue apply to async connections too."""

    async def test() -> None:
        conn = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
        try:
            with pytest.raises(outbox.NoOpenTransaction):
                await outbox.aio.enqueue(conn, "orders", b"x")
            async with conn.transaction():
                await outbox.aio.enqueue(conn, "orders", b"in a transaction block")
        finally:
            await conn.close()
        async with _psycopg(database_url) as conn:
            with pytest.raises(psycopg.errors.UndefinedTable):
                await conn.execute("SELECT * FROM no_such_table")
            with pytest.raises(outbox.TransactionAborted):
                await outbox.aio.enqueue(conn, "orders", b"x")

    asyncio.run(test())
    assert [value for _, value in _committed(database_url)] == [b"in a transaction block"]


# --- failure and cancellation part-way --------------------------------------------------------


@ASYNC_VARIANTS
def test_enqueue_many_failing_in_its_second_statement_leaves_none_of_its_rows(
    database_url: str, opener: AsyncOpener
) -> None:
    """The savepoint is rolled back to: the transaction stays usable, without the call's rows."""

    async def test() -> tuple[uuid.UUID, uuid.UUID]:
        # The second INSERT waits for a held key and gives up after lock_timeout.
        async with opener(database_url, options="-c lock_timeout=200") as conn:
            before = await outbox.aio.enqueue(conn, "t", b"before")
            with (
                _key_held(database_url, "t", "hot"),
                pytest.raises(Exception) as failed,  # noqa: PT011 - checked below
            ):
                await outbox.aio.enqueue_many(conn, _bulk_then("hot"))
            assert _lock_timeout(failed.value)
            assert await _scalar(conn, "SELECT count(*) FROM outbox.messages") == 1
            after = await outbox.aio.enqueue(conn, "t", b"after")
            await conn.commit()
        return before, after

    before, after = asyncio.run(test())
    assert _committed(database_url) == [(before, b"before"), (after, b"after")]


@ASYNC_OPENERS
def test_a_second_enqueue_on_a_connection_in_use_is_refused(
    database_url: str, opener: AsyncOpener
) -> None:
    """Two tasks sharing a connection would share its transaction and savepoints: one's
    rollback to its savepoint could undo the other's rows after it returned their ids,
    and the transaction would still commit. The second call is refused while the first
    runs (ConnectionInUse); the first's rows all commit, and the next call goes on."""
    many = [outbox.Message("t", b"%d" % i) for i in range(MAX_ROWS_PER_STATEMENT + 1)]

    async def test() -> list[uuid.UUID]:
        async with opener(database_url) as conn:
            await _scalar(conn, "SELECT 1")  # the business write's statement, say
            first, second = await asyncio.gather(
                outbox.aio.enqueue_many(conn, many),  # in a savepoint: two statements
                outbox.aio.enqueue(conn, "t", b"second"),
                return_exceptions=True,
            )
            assert isinstance(second, outbox.ConnectionInUse), second
            assert "another enqueue is running on this connection" in str(second)
            assert isinstance(first, list)
            after = await outbox.aio.enqueue(conn, "t", b"after")
            await conn.commit()
        return [*first, after]

    ids = asyncio.run(test())
    assert [row[0] for row in _committed(database_url)] == ids


def test_one_scoped_session_in_many_tasks_or_threads_is_many_connections(
    database_url: str,
) -> None:
    """A scoped_session is one object that gives each thread (an async_scoped_session: each
    task) a session and connection of its own: enqueues through it at once are not on one
    connection, and none is refused. Two objects over one connection are: an AsyncSession
    and the AsyncConnection it gives."""
    engine = sa.create_engine(_sa_url(database_url), poolclass=sa.NullPool)
    scoped = scoped_session(sessionmaker(engine))
    together = threading.Barrier(4)
    errors: list[BaseException] = []

    def in_a_thread(n: int) -> None:
        try:
            together.wait(timeout=10)
            outbox.enqueue_many(scoped, [outbox.Message("t", b"%d" % n)] * 2)
            scoped.commit()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)
        finally:
            scoped.remove()

    threads = [threading.Thread(target=in_a_thread, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    engine.dispose()
    assert errors == []
    assert len(_committed(database_url)) == 8

    async def test() -> BaseException | None:
        aengine = create_async_engine(_sa_url(database_url), poolclass=sa.NullPool)
        ascoped = async_scoped_session(async_sessionmaker(aengine), scopefunc=asyncio.current_task)

        async def in_a_task(n: int) -> None:
            await outbox.aio.enqueue_many(ascoped, [outbox.Message("t", b"%d" % n)] * 2)
            await ascoped.commit()
            await ascoped.remove()

        try:
            await asyncio.gather(*(in_a_task(n) for n in range(4)))
            async with AsyncSession(aengine) as session:
                many = [outbox.Message("t", b"x")] * (MAX_ROWS_PER_STATEMENT + 1)
                _, second = await asyncio.gather(
                    outbox.aio.enqueue_many(session, many),
                    outbox.aio.enqueue(await session.connection(), "t", b"y"),
                    return_exceptions=True,
                )
                await session.rollback()
                return second if isinstance(second, BaseException) else None
        finally:
            await aengine.dispose()

    refused = asyncio.run(test())
    assert isinstance(refused, outbox.ConnectionInUse), refused
    assert len(_committed(database_url)) == 16


#: The synchronous connection types, and the settings of a caller's psycopg
#: connection that change how statements are sent.
SYNC_OPENERS = pytest.mark.parametrize(
    "opener",
    [
        "psycopg",
        "psycopg-raw-cursor",
        "psycopg-client-cursor",
        "psycopg-prepared-at-once",
        "psycopg-pipeline",
        "sa-connection",
        "sa-session",
        "sa-scoped-session",
    ],
)

_PSYCOPG_SETTINGS: dict[str, dict[str, Any]] = {
    "psycopg": {},
    "psycopg-raw-cursor": {"cursor_factory": psycopg.RawCursor},
    "psycopg-client-cursor": {"cursor_factory": psycopg.ClientCursor},
    "psycopg-prepared-at-once": {"prepare_threshold": 0},
    "psycopg-pipeline": {},
}


@contextmanager
def _sync_conn(kind: str, url: str, **connect_args: Any) -> Iterator[Any]:
    if kind in _PSYCOPG_SETTINGS:
        raw = psycopg.connect(url, **_PSYCOPG_SETTINGS[kind], **connect_args)
        try:
            with raw.pipeline() if kind == "psycopg-pipeline" else nullcontext():
                yield raw
        finally:
            raw.close()
        return
    engine = sa.create_engine(_sa_url(url), poolclass=sa.NullPool, connect_args=connect_args)
    opened: AbstractContextManager[Any]
    if kind == "sa-connection":
        opened = engine.connect()
    elif kind == "sa-session":
        opened = Session(engine)
    else:
        opened = _removed(scoped_session(sessionmaker(engine)))
    try:
        with opened as conn:
            yield conn
    finally:
        engine.dispose()


@contextmanager
def _removed(scoped: scoped_session[Session]) -> Iterator[scoped_session[Session]]:
    """A scoped session (as Flask-SQLAlchemy's ``db.session``), removed at the end."""
    try:
        yield scoped
    finally:
        scoped.remove()


@SYNC_OPENERS
def test_sync_enqueue_many_failing_in_its_second_statement_leaves_none_of_its_rows(
    database_url: str, opener: str
) -> None:
    """The synchronous enqueue_many uses the same savepoint, with the same outcome."""
    with _sync_conn(opener, database_url, options="-c lock_timeout=200") as conn:
        before = outbox.enqueue(conn, "t", b"before")
        with (
            _key_held(database_url, "t", "hot"),
            pytest.raises(Exception) as failed,  # noqa: PT011 - checked below
        ):
            outbox.enqueue_many(conn, _bulk_then("hot"))
        assert _lock_timeout(failed.value)
        count = "SELECT count(*) FROM outbox.messages"
        if isinstance(conn, psycopg.Connection):
            assert conn.execute(count).fetchall() == [(1,)]
        else:
            assert conn.execute(sa.text(count)).scalar_one() == 1
        after = outbox.enqueue(conn, "t", b"after")
        conn.commit()
    assert _committed(database_url) == [(before, b"before"), (after, b"after")]


@pytest.mark.parametrize("opener", ["psycopg", "psycopg-client-cursor", "sa-connection"])
def test_enqueue_many_of_more_bytes_than_a_statement_takes_is_split_and_all_or_none(
    database_url: str, opener: str
) -> None:
    """33 values of 2 MiB are over 64 MiB: the call takes two statements (a second that
    fails leaves none of its rows), however few its messages; and succeeds whole."""
    big = outbox.Outbox(max_value_bytes=2 * 1024 * 1024)
    messages = [outbox.Message("t", bytes([n]) * (2 * 1024 * 1024)) for n in range(33)]
    with _sync_conn(opener, database_url, options="-c lock_timeout=200") as conn:
        with (
            _key_held(database_url, "t", "hot"),
            pytest.raises(Exception) as failed,  # noqa: PT011 - checked below
        ):
            # Only the last message is keyed, and in the second statement.
            big.enqueue_many(conn, [*messages, outbox.Message("t", b"last", key="hot")])
        assert _lock_timeout(failed.value)
        ids = big.enqueue_many(conn, messages)
        conn.commit()
    stored = _committed(database_url)
    assert [id_ for id_, _ in stored] == ids
    assert [value[:1] for _, value in stored] == [bytes([n]) for n in range(33)]
    assert {len(value) for _, value in stored} == {2 * 1024 * 1024}


def _lock_timeout(exc: BaseException) -> bool:
    """The error is PostgreSQL's lock_timeout (raised by psycopg, or wrapped by SQLAlchemy)."""
    return isinstance(getattr(exc, "orig", exc), psycopg.errors.LockNotAvailable)


@ASYNC_OPENERS
def test_cancelled_enqueue_many_leaves_none_of_its_rows(
    database_url: str, opener: AsyncOpener
) -> None:
    """Cancelled in its second statement, after the first wrote 5,000 rows: none of them remain.

    psycopg: the savepoint is rolled back to and the transaction goes on.
    SQLAlchemy: it invalidates the interrupted connection, so the whole
    transaction is gone; after rollback() the session or connection works again.
    """
    name = f"cancelled-{uuid.uuid4().hex[:8]}"

    async def test() -> list[uuid.UUID]:
        async with opener(database_url, application_name=name) as conn:
            before = await outbox.aio.enqueue(conn, "t", b"before")
            with _key_held(database_url, "t", "hot"):
                call = asyncio.create_task(outbox.aio.enqueue_many(conn, _bulk_then("hot")))
                # Only the second statement has a held key: the first is done.
                await _until_waiting_on_lock(database_url, name)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            if isinstance(conn, psycopg.AsyncConnection):
                assert conn.info.transaction_status == TransactionStatus.INTRANS
                assert await _scalar(conn, "SELECT count(*) FROM outbox.messages") == 1
                kept = [before]
            else:
                with pytest.raises(sa.exc.PendingRollbackError):
                    await _scalar(conn, "SELECT count(*) FROM outbox.messages")
                await conn.rollback()
                kept = []
            after = await outbox.aio.enqueue(conn, "t", b"after")
            await conn.commit()
        return [*kept, after]

    kept = asyncio.run(test())
    assert [mid for mid, _ in _committed(database_url)] == kept


def test_several_messages_with_idempotency_keys_run_in_a_savepoint(database_url: str) -> None:
    """Their lookup is a second statement, so they get a savepoint: cancelled, psycopg goes on."""
    name = f"cancelled-{uuid.uuid4().hex[:8]}"
    messages = [
        outbox.Message("t", b"a", idempotency_key="a"),
        outbox.Message("t", b"b", key="hot", idempotency_key="b"),
    ]

    async def test() -> uuid.UUID:
        async with _psycopg(database_url, application_name=name) as conn:
            before = await outbox.aio.enqueue(conn, "t", b"before")
            with _key_held(database_url, "t", "hot"):
                call = asyncio.create_task(outbox.aio.enqueue_many(conn, messages))
                await _until_waiting_on_lock(database_url, name)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            assert conn.info.transaction_status == TransactionStatus.INTRANS
            await conn.commit()
        return before

    before = asyncio.run(test())
    assert _committed(database_url) == [(before, b"before")]


@ASYNC_OPENERS
def test_enqueue_cancelled_while_its_statement_runs_fails_the_transaction(
    database_url: str, opener: AsyncOpener
) -> None:
    """A single statement cancelled mid-way: the transaction must be rolled back, then works.

    psycopg cancels the statement in the server (the transaction is failed);
    SQLAlchemy invalidates the connection. Either way enqueue says so.
    """
    name = f"cancelled-{uuid.uuid4().hex[:8]}"

    async def test() -> uuid.UUID:
        async with opener(database_url, application_name=name) as conn:
            await outbox.aio.enqueue(conn, "t", b"before")
            with _key_held(database_url, "t", "hot"):
                call = asyncio.create_task(outbox.aio.enqueue(conn, "t", b"hot", key="hot"))
                await _until_waiting_on_lock(database_url, name)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            if isinstance(conn, psycopg.AsyncConnection):
                assert conn.info.transaction_status == TransactionStatus.INERROR
            with pytest.raises(outbox.TransactionAborted, match="roll it back"):
                await outbox.aio.enqueue(conn, "t", b"refused")
            await conn.rollback()
            after = await outbox.aio.enqueue(conn, "t", b"after")
            await conn.commit()
        return after

    after = asyncio.run(test())
    assert _committed(database_url) == [(after, b"after")]


# --- SQLAlchemy stays optional ----------------------------------------------------------------


def test_outbox_and_outbox_aio_work_without_sqlalchemy(database_url: str) -> None:
    """With SQLAlchemy not importable, both APIs import and enqueue on psycopg connections."""
    script = f"""
import asyncio, sys
sys.modules["sqlalchemy"] = None  # any `import sqlalchemy` now raises ImportError
import psycopg
import outbox, outbox.aio

with psycopg.connect({database_url!r}) as conn:
    outbox.enqueue(conn, "t", b"sync")

async def main():
    async with await psycopg.AsyncConnection.connect({database_url!r}) as conn:
        await outbox.aio.enqueue_many(conn, [outbox.Message("t", b"async")])

asyncio.run(main())
try:
    outbox.enqueue(object(), "t", b"x")
except outbox.ConnectionNotSupported:
    print("refused")
print(sorted(m for m, module in sys.modules.items() if m.startswith("sqlalchemy") and module))
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["refused", "[]"]
    assert [value for _, value in _committed(database_url)] == [b"sync", b"async"]


def test_a_streaming_sqlalchemy_async_connection_keeps_its_savepoints_out_of_cursors(
    database_url: str,
) -> None:
    """An AsyncConnection set to stream results: enqueue_many of several keyed messages
    runs in a savepoint, which SQLAlchemy would send in a server-side cursor (DECLARE ...
    FOR SAVEPOINT, aborting the transaction). It is written whole; the setting is kept."""

    async def test() -> list[uuid.UUID]:
        async with _sa_connection(database_url) as conn:
            await conn.execution_options(stream_results=True)
            ids = await outbox.aio.enqueue_many(
                conn,
                [
                    outbox.Message("orders", b"a", idempotency_key="streamed-a"),
                    outbox.Message("orders", b"b", idempotency_key="streamed-b"),
                ],
            )
            assert conn.sync_connection.get_execution_options()["stream_results"] is True
            await conn.commit()
        return ids

    ids = asyncio.run(test())
    assert _committed(database_url) == [(ids[0], b"a"), (ids[1], b"b")]
