"""enqueue() in the caller's transaction, through psycopg and SQLAlchemy."""

from __future__ import annotations

import asyncio
import importlib
import secrets
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg.types.string import TextLoader
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import outbox
import outbox.aio
from outbox.connection import executor_for
from outbox.enqueue import MAX_ROWS_PER_STATEMENT
from tests.support import submit_until_waiting, wait_until, waiting_on_lock

pytestmark = pytest.mark.integration

#: The module, which ``outbox.enqueue`` (the function) hides.
outbox_enqueue = importlib.import_module("outbox.enqueue")


def _sa_url(database_url: str) -> str:
    return database_url.replace("postgresql://", "postgresql+psycopg://", 1)


def _rows(database_url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url) as conn:
        return conn.execute(
            "SELECT id, topic, key, value, header_names, header_values, state "
            "FROM outbox.messages ORDER BY seq"
        ).fetchall()


Opener = Callable[[str], AbstractContextManager[Any]]


@contextmanager
def _psycopg(url: str) -> Iterator[Any]:
    with psycopg.connect(url) as conn:
        yield conn


@contextmanager
def _sa_connection(url: str) -> Iterator[Any]:
    engine = sa.create_engine(_sa_url(url))
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


@contextmanager
def _sa_session(url: str) -> Iterator[Any]:
    engine = sa.create_engine(_sa_url(url))
    try:
        with Session(engine) as session:
            yield session
    finally:
        engine.dispose()


OPENERS = pytest.mark.parametrize(
    "opener",
    [_psycopg, _sa_connection, _sa_session],
    ids=["psycopg", "sa-connection", "sa-session"],
)


@OPENERS
def test_intent_is_written_in_the_callers_transaction(database_url: str, opener: Opener) -> None:
    """The row appears only when the caller commits, with the encoded fields."""
    with opener(database_url) as conn:
        message_id = outbox.enqueue(conn, "orders", {"id": 1}, key="c-1", headers={"h": "v"})
        assert _rows(database_url) == []  # not visible before the caller commits
        conn.commit()
    assert _rows(database_url) == [
        (
            message_id,
            "orders",
            b"c-1",
            b'{"id":1}',
            ["h", "content-type"],
            [b"v", b"application/json"],
            "pending",
        )
    ]


@OPENERS
def test_rollback_leaves_nothing(database_url: str, opener: Opener) -> None:
    """When the caller rolls back, no intent remains."""
    with opener(database_url) as conn:
        outbox.enqueue(conn, "orders", b"x")
        conn.rollback()
    assert _rows(database_url) == []


@OPENERS
def test_invalid_input_writes_nothing_and_keeps_the_transaction_usable(
    database_url: str, opener: Opener
) -> None:
    """Bad input raises before any SQL; the same transaction then commits normally."""
    with opener(database_url) as conn:
        good = outbox.enqueue(conn, "orders", b"first")
        bad_calls: list[Callable[[], object]] = [
            lambda: outbox.enqueue(conn, "", b"x"),
            lambda: outbox.enqueue(conn, "bad topic!", b"x"),
            lambda: outbox.enqueue(conn, "orders", object()),
            lambda: outbox.enqueue(conn, "orders", b"x", headers={"h": 1}),  # type: ignore[arg-type]
            lambda: outbox.enqueue(conn, "orders", b"x", key=5),  # type: ignore[arg-type]
            lambda: outbox.Outbox(max_value_bytes=10).enqueue(conn, "orders", b"x" * 11),
            lambda: outbox.enqueue_many(
                conn, [outbox.Message("orders", b"ok"), outbox.Message("orders", {1j})]
            ),
        ]
        for call in bad_calls:
            with pytest.raises(outbox.InvalidMessage):
                call()
        second = outbox.enqueue(conn, "orders", b"second")
        conn.commit()
    assert [row[0] for row in _rows(database_url)] == [good, second]


LONE_SURROGATE = "\ud800"


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


@OPENERS
def test_oversized_and_unstorable_input_raises_before_sql_and_keeps_the_transaction_usable(
    database_url: str, opener: Opener
) -> None:
    """Input PostgreSQL or a publisher could not hold (a key, headers or idempotency key over
    its limit, NUL in text, lone surrogates, JSON too deep) raises the field's InvalidMessage
    before any SQL: the transaction then commits normally."""
    deep = _nested(100_000)
    too_long = secrets.token_urlsafe(3000)
    with opener(database_url) as conn:
        good = outbox.enqueue(conn, "orders", b"first")
        bad_calls: list[tuple[type[outbox.InvalidMessage], Callable[[], object]]] = [
            # Over the btree row limit (about 2.7 kB once compressed, hence random text)
            # the server would abort the transaction.
            (
                outbox.InvalidIdempotencyKey,
                lambda: outbox.enqueue(conn, "orders", b"x", idempotency_key=too_long),
            ),
            (
                outbox.InvalidIdempotencyKey,
                lambda: outbox.enqueue(conn, "orders", b"x", idempotency_key="k" * 1025),
            ),
            (
                outbox.InvalidIdempotencyKey,
                lambda: outbox.enqueue(conn, "orders", b"x", idempotency_key="a\x00b"),
            ),
            (
                outbox.InvalidIdempotencyKey,
                lambda: outbox.enqueue(conn, "orders", b"x", idempotency_key=f"a{LONE_SURROGATE}"),
            ),
            (outbox.KeyTooLarge, lambda: outbox.enqueue(conn, "orders", b"x", key=b"k" * 20_000)),
            (
                outbox.InvalidKey,
                lambda: outbox.enqueue(conn, "orders", b"x", key=f"k{LONE_SURROGATE}"),
            ),
            (
                outbox.HeadersTooLarge,
                lambda: outbox.enqueue(conn, "orders", b"x", headers={"h": b"x" * 20_000}),
            ),
            (
                outbox.InvalidHeaders,
                lambda: outbox.enqueue(conn, "orders", b"x", headers={"h\x00": b"x"}),
            ),
            (
                outbox.InvalidHeaders,
                lambda: outbox.enqueue(conn, "orders", b"x", headers={"h": f"v{LONE_SURROGATE}"}),
            ),
            (outbox.InvalidTopic, lambda: outbox.enqueue(conn, "ord\x00ers", b"x")),
            (outbox.InvalidValue, lambda: outbox.enqueue(conn, "orders", f"v{LONE_SURROGATE}")),
            (outbox.InvalidValue, lambda: outbox.enqueue(conn, "orders", deep)),
            (
                outbox.InvalidIdempotencyKey,
                lambda: outbox.enqueue_many(
                    conn,
                    [
                        outbox.Message("orders", b"ok"),
                        outbox.Message("orders", b"x", idempotency_key=too_long),
                    ],
                ),
            ),
        ]
        for error, call in bad_calls:
            with pytest.raises(error):
                call()
        second = outbox.enqueue(conn, "orders", b"second", idempotency_key="k" * 1024)
        conn.commit()
    assert [row[0] for row in _rows(database_url)] == [good, second]


def test_a_key_with_nul_bytes_is_stored_as_given(database_url: str) -> None:
    """A key is bytea: NUL bytes in it (given as bytes or str) are stored and read back."""
    with psycopg.connect(database_url) as conn:
        outbox.enqueue(conn, "orders", b"x", key="a\x00b")
        outbox.enqueue(conn, "orders", b"x", key=b"\x00")
    assert [row[2] for row in _rows(database_url)] == [b"a\x00b", b"\x00"]


def test_autocommit_connection_without_transaction_is_refused(database_url: str) -> None:
    """An autocommit connection would commit the intent alone, so enqueue refuses it."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        with pytest.raises(outbox.NoOpenTransaction):
            outbox.enqueue(conn, "orders", b"x")
        with conn.transaction():  # an explicit transaction block is fine
            outbox.enqueue(conn, "orders", b"y")
    assert [row[3] for row in _rows(database_url)] == [b"y"]


def test_failed_transaction_is_reported_before_sql(database_url: str) -> None:
    """After a failed statement, enqueue says the transaction must be rolled back."""
    with psycopg.connect(database_url) as conn:
        with pytest.raises(psycopg.errors.UndefinedTable):
            conn.execute("SELECT * FROM no_such_table")
        with pytest.raises(outbox.TransactionAborted):
            outbox.enqueue(conn, "orders", b"x")


def test_in_pipeline_mode_a_failed_statement_is_reported_before_sql(database_url: str) -> None:
    """In pipeline mode the caller's failed statement is known only at a sync point: enqueue
    syncs, then says the transaction must be rolled back, as outside pipeline mode."""
    with psycopg.connect(database_url) as conn:
        with conn.pipeline():
            conn.execute("SELECT 1 / 0")  # queued: it fails at the next sync
            with pytest.raises(outbox.TransactionAborted):
                outbox.enqueue(conn, "orders", b"x")
        conn.rollback()
        outbox.enqueue(conn, "orders", b"after the rollback")
        conn.commit()
    assert [row[3] for row in _rows(database_url)] == [b"after the rollback"]


def _enqueue_after_a_failure(conn: psycopg.Connection[Any]) -> str:
    """What enqueue raises in an autocommit connection's transaction block whose statement
    failed in pipeline mode (the class name)."""
    try:
        with conn.transaction(), conn.pipeline():
            conn.execute("SELECT 1 / 0")
            outbox.enqueue(conn, "orders", b"x")
    except Exception as exc:  # noqa: BLE001 - the outcome is its class
        return type(exc).__name__
    return "written"


async def _enqueue_async_after_a_failure(conn: psycopg.AsyncConnection[Any]) -> str:
    """``_enqueue_after_a_failure`` on an async connection."""
    try:
        async with conn.transaction(), conn.pipeline():
            await conn.execute("SELECT 1 / 0")
            await outbox.aio.enqueue(conn, "orders", b"x")
    except Exception as exc:  # noqa: BLE001 - the outcome is its class
        return type(exc).__name__
    return "written"


def test_an_autocommit_transaction_block_failed_in_pipeline_mode_is_reported_every_time(
    database_url: str,
) -> None:
    """In autocommit, a failed statement of a ``conn.transaction()`` block: right after the
    sync libpq may still say the status is ACTIVE, not failed. Every try of many says the
    transaction failed, before any SQL, sync and async alike."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        outcomes = Counter(_enqueue_after_a_failure(conn) for _ in range(100))

    async def in_async() -> Counter[str]:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            return Counter([await _enqueue_async_after_a_failure(conn) for _ in range(100)])

    assert outcomes == {"TransactionAborted": 100}
    assert asyncio.run(in_async()) == {"TransactionAborted": 100}
    assert _rows(database_url) == []


def test_other_connection_types_are_refused(database_url: str) -> None:
    """Something that is not a supported connection raises a clear error."""
    with pytest.raises(outbox.ConnectionNotSupported, match="psycopg 3 Connection"):
        outbox.enqueue(object(), "orders", b"x")


def test_enqueue_many_writes_in_order_and_returns_ids(database_url: str) -> None:
    """enqueue_many keeps input order, and ids match the stored rows."""
    messages = [outbox.Message("orders", f"v{i}", key=f"k{i % 3}") for i in range(12)]
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(conn, messages)
    rows = _rows(database_url)
    assert [row[0] for row in rows] == ids
    assert [row[3] for row in rows] == [f"v{i}".encode() for i in range(12)]


def test_repeated_idempotency_key_returns_first_id(database_url: str) -> None:
    """Same key in a later transaction, on another topic and inside one batch: one row,
    one id (only the key is compared, across topics)."""
    with psycopg.connect(database_url) as conn:
        first = outbox.enqueue(conn, "orders", b"a", idempotency_key="order-1")
    with psycopg.connect(database_url) as conn:
        again = outbox.enqueue(conn, "orders", b"b", idempotency_key="order-1")
        assert outbox.enqueue(conn, "payments", b"p", idempotency_key="order-1") == first
        batch = outbox.enqueue_many(
            conn,
            [
                outbox.Message("orders", b"c", idempotency_key="order-2"),
                outbox.Message("orders", b"d", idempotency_key="order-1"),
                outbox.Message("orders", b"e", idempotency_key="order-2"),
            ],
        )
    assert again == first
    assert batch[1] == first
    assert batch[0] == batch[2] != first
    assert [row[3] for row in _rows(database_url)] == [b"a", b"c"]


@pytest.mark.parametrize("first_commits", [True, False], ids=["first-commits", "first-rolls-back"])
def test_idempotency_key_race_between_two_transactions(
    database_url: str, first_commits: bool
) -> None:
    """Two open transactions enqueue the same key: one row, both see the surviving id."""
    name = f"racer-{uuid.uuid4().hex[:8]}"
    first_conn = psycopg.connect(database_url)
    second_conn = psycopg.connect(database_url, application_name=name)
    try:
        first_id = outbox.enqueue(first_conn, "orders", b"first", idempotency_key="pay-9")
        with ThreadPoolExecutor(1) as pool:
            # The second INSERT must wait for the first transaction to finish.
            second = submit_until_waiting(
                pool,
                database_url,
                name,
                "the second enqueue to block on the first",
                outbox.enqueue,
                second_conn,
                "orders",
                b"second",
                idempotency_key="pay-9",
            )
            if first_commits:
                first_conn.commit()
            else:
                first_conn.rollback()
            second_id = second.result(timeout=10)
        second_conn.commit()
    finally:
        first_conn.close()
        second_conn.close()
    rows = _rows(database_url)
    if first_commits:
        assert second_id == first_id
        assert [(row[0], row[3]) for row in rows] == [(first_id, b"first")]
    else:
        assert second_id != first_id
        assert [(row[0], row[3]) for row in rows] == [(second_id, b"second")]


@pytest.mark.parametrize("with_new_message", [False, True], ids=["alone", "with-a-new-one"])
def test_a_key_whose_message_is_purged_mid_call_raises_a_race_and_writes_nothing(
    database_url: str, monkeypatch: pytest.MonkeyPatch, with_new_message: bool
) -> None:
    """The INSERT finds the key taken; before the lookup, the message is deleted (as a
    purge does): IdempotencyKeyRace, nothing of the call kept, the transaction usable, and
    the enqueue retried writes the message anew."""
    with psycopg.connect(database_url) as conn:
        outbox.enqueue(conn, "orders", b"old", idempotency_key="k-gone")

    class PurgeAfterInsert:
        def __init__(self, conn: object) -> None:
            self.inner = executor_for(conn)
            self.driver = self.inner.driver
            self.statements = 0

        def fetchall(self, sql: str, params: Any) -> Any:
            rows = self.inner.fetchall(sql, params)
            self.statements += 1
            if self.statements == 1:  # the INSERT: delete the message it conflicted with
                with psycopg.connect(database_url, autocommit=True) as other:
                    other.execute("DELETE FROM outbox.messages WHERE idempotency_key = 'k-gone'")
            return rows

        def savepoint(self) -> AbstractContextManager[None]:
            return self.inner.savepoint()

    monkeypatch.setattr(outbox_enqueue, "executor_for", PurgeAfterInsert)
    messages = [outbox.Message("orders", b"new", idempotency_key="k-gone")]
    if with_new_message:
        messages.insert(0, outbox.Message("orders", b"other", key="k"))
    with psycopg.connect(database_url) as conn:
        with pytest.raises(outbox.IdempotencyKeyRace, match="'k-gone' conflicted but its message"):
            outbox.enqueue_many(conn, messages)
        monkeypatch.setattr(outbox_enqueue, "executor_for", executor_for)
        assert conn.execute("SELECT count(*) FROM outbox.messages").fetchone() == (0,)
        retried = outbox.enqueue_many(conn, messages)
    assert [row[0] for row in _rows(database_url)] == retried


def test_many_concurrent_writers_with_one_key_make_one_row(database_url: str) -> None:
    """Eight threads racing on one idempotency key all get the same id."""
    barrier = threading.Barrier(8)

    def writer(n: int) -> uuid.UUID:
        with psycopg.connect(database_url) as conn:
            barrier.wait(timeout=10)
            return outbox.enqueue(conn, "orders", f"w{n}", idempotency_key="same")

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(writer, range(8)))
    assert len(set(ids)) == 1
    assert len(_rows(database_url)) == 1


def test_two_calls_of_several_statements_lock_their_keys_in_one_order(database_url: str) -> None:
    """Two enqueue_many calls of more than 5,000 messages, each with key a in its first
    statement's rows and b in its second's, the other way round for the other: each takes
    all its key locks before writing, in one order, so neither deadlocks the other."""
    filler = [outbox.Message("orders", b"-") for _ in range(MAX_ROWS_PER_STATEMENT)]

    def call(first: str, then: str) -> list[outbox.Message]:
        return [
            outbox.Message("orders", first, key=first),
            *filler,
            outbox.Message("orders", then, key=then),
        ]

    names = [f"enqueuer-{n}-{uuid.uuid4().hex[:8]}" for n in range(2)]
    with psycopg.connect(database_url) as holder:
        # Both keys held, so that both calls are under way, waiting, when they are let go.
        outbox.enqueue_many(
            holder, [outbox.Message("orders", "a", key="a"), outbox.Message("orders", "b", key="b")]
        )

        def enqueue_in(name: str, messages: list[outbox.Message]) -> list[uuid.UUID]:
            with psycopg.connect(database_url, application_name=name) as conn:
                return outbox.enqueue_many(conn, messages)

        with ThreadPoolExecutor(2) as pool:
            calls = [
                pool.submit(enqueue_in, names[0], call("a", "b")),
                pool.submit(enqueue_in, names[1], call("b", "a")),
            ]
            wait_until(
                lambda: all(waiting_on_lock(database_url, name) for name in names),
                timeout=30,
                what="both calls to wait for the keys",
            )
            holder.commit()
            results = [c.result(timeout=60) for c in calls]
    assert [len(ids) for ids in results] == [len(filler) + 2] * 2
    assert _count_rows(database_url) == 2 + 2 * (len(filler) + 2)


def _count_rows(database_url: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT count(*) FROM outbox.messages").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    "streaming", [{"stream_results": True}, {"yield_per": 10}], ids=["stream_results", "yield_per"]
)
@pytest.mark.parametrize(
    "opener", [_sa_connection, _sa_session], ids=["sa-connection", "sa-session"]
)
def test_a_streaming_sqlalchemy_connection_enqueues_like_any_other(
    database_url: str, opener: Opener, streaming: dict[str, Any]
) -> None:
    """A connection set to stream results (as yield_per does) would open a server-side
    cursor, which PostgreSQL refuses for an INSERT: the library's statements never stream,
    nor its savepoints (SQLAlchemy would DECLARE a cursor FOR SAVEPOINT); the caller's
    setting is kept."""
    with opener(database_url) as conn:
        connection = conn.connection() if isinstance(conn, Session) else conn
        connection.execution_options(**streaming)
        message_id = outbox.enqueue(conn, "orders", b"x", idempotency_key="streamed")
        assert outbox.enqueue(conn, "orders", b"y", idempotency_key="streamed") == message_id
        # Several messages with idempotency keys: one call in a savepoint of its own.
        many = outbox.enqueue_many(
            conn,
            [
                outbox.Message("orders", b"x", idempotency_key="streamed"),
                outbox.Message("orders", b"z", idempotency_key="streamed-too"),
            ],
        )
        assert many[0] == message_id
        options = connection.get_execution_options()
        assert {name: options[name] for name in streaming} == streaming
        conn.commit()
    assert [(row[0], row[3]) for row in _rows(database_url)] == [
        (message_id, b"x"),
        (many[1], b"z"),
    ]


def test_an_invalidated_sqlalchemy_connection_is_reported_as_an_aborted_transaction(
    database_url: str,
) -> None:
    """A connection invalidated in its transaction (its database connection lost, or an
    async task cancelled in a statement) must be rolled back first: TransactionAborted,
    as for a failed statement, not SQLAlchemy's PendingRollbackError."""
    with _sa_connection(database_url) as conn:
        conn.exec_driver_sql("SELECT 1")
        conn.invalidate()
        with pytest.raises(outbox.TransactionAborted, match="invalidated"):
            outbox.enqueue(conn, "orders", b"x")
        conn.rollback()
        outbox.enqueue(conn, "orders", b"after the rollback")
        conn.commit()
    assert [row[3] for row in _rows(database_url)] == [b"after the rollback"]


def test_a_session_whose_flush_failed_is_reported_as_an_aborted_transaction(
    database_url: str,
) -> None:
    """After a failed flush the session must be rolled back (SQLAlchemy raises
    PendingRollbackError until it is): enqueue says so with TransactionAborted, an
    OutboxError, as on a connection whose statement failed."""

    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __tablename__ = "orders_flushed"
        id: Mapped[int] = mapped_column(primary_key=True)

    engine = sa.create_engine(_sa_url(database_url))
    try:
        Base.metadata.create_all(engine)
        with Session(engine) as session:
            session.add_all([Order(id=1)])
            session.commit()
            session.add(Order(id=1))
            with pytest.raises(sa.exc.IntegrityError):
                session.flush()
            with pytest.raises(outbox.TransactionAborted, match="roll it back"):
                outbox.enqueue(session, "orders", b"x")
            session.rollback()
            outbox.enqueue(session, "orders", b"after the rollback")
            session.commit()
    finally:
        engine.dispose()
    assert [row[3] for row in _rows(database_url)] == [b"after the rollback"]


def test_ids_are_uuids_whatever_the_connection_loads_uuids_as(database_url: str) -> None:
    """A connection whose uuid columns load as text: the ids returned are still UUIDs, and a
    taken idempotency key still resolves to its message in a call of several."""
    with psycopg.connect(database_url) as conn:
        conn.adapters.register_loader("uuid", TextLoader)
        first = outbox.enqueue(conn, "orders", b"1", idempotency_key="k")
        again = outbox.enqueue_many(
            conn,
            [outbox.Message("orders", b"2"), outbox.Message("orders", b"3", idempotency_key="k")],
        )
    assert isinstance(first, uuid.UUID)
    assert again[1] == first
    assert [row[0] for row in _rows(database_url)] == [first, again[0]]


@OPENERS
def test_an_empty_enqueue_many_checks_the_connection_too(database_url: str, opener: Opener) -> None:
    """No messages still need a usable transaction: an autocommit connection is refused."""
    with pytest.raises(outbox.ConnectionNotSupported):
        outbox.enqueue_many(object(), [])
    with (
        psycopg.connect(database_url, autocommit=True) as conn,
        pytest.raises(outbox.NoOpenTransaction),
    ):
        outbox.enqueue_many(conn, [])
    with opener(database_url) as conn:
        assert outbox.enqueue_many(conn, []) == []
