"""``migrate_connection``: the outbox migrations on a caller's connection, in its transaction."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
import sqlalchemy as sa
from psycopg.pq import TransactionStatus
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from outbox.errors import ConnectionNotSupported, MigrationError, NoOpenTransaction
from outbox.migrations import (
    Migration,
    current_version,
    load_migrations,
    migrate,
    migrate_connection,
)
from tests.support import fetch_rows, wait_until

pytestmark = pytest.mark.integration

LATEST = load_migrations()[-1].version


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(
        url.replace("postgresql://", "postgresql+psycopg://", 1), poolclass=sa.pool.NullPool
    )


def _version(url: str) -> int:
    with psycopg.connect(url) as conn:
        return current_version(conn)


def _versions(applied: list[Migration]) -> list[int]:
    return [m.version for m in applied]


def test_psycopg_rollback_leaves_nothing_and_commit_leaves_everything(
    empty_database_url: str,
) -> None:
    """The migrations and their bookkeeping share the caller's fate: rolled back, then committed."""
    with psycopg.connect(empty_database_url) as conn:
        assert _versions(migrate_connection(conn)) == list(range(1, LATEST + 1))
        conn.rollback()
        assert conn.execute("SELECT to_regnamespace('outbox')").fetchone() == (None,)
        assert _versions(migrate_connection(conn)) == list(range(1, LATEST + 1))
    assert _version(empty_database_url) == LATEST
    with psycopg.connect(empty_database_url) as conn:
        assert conn.execute("SELECT count(*) FROM outbox.lanes").fetchone() == (32,)
        assert conn.execute(
            "SELECT count(*) FROM pg_trigger WHERE tgname = 'messages_notify_pending'"
        ).fetchone() == (1,)


def test_sqlalchemy_session_and_connection(empty_database_url: str) -> None:
    """Through a Session the SQL (literal % signs too) runs; a Connection then finds it done."""
    engine = _engine(empty_database_url)
    try:
        with Session(engine) as session, session.begin():
            assert _versions(migrate_connection(session)) == list(range(1, LATEST + 1))
        with engine.begin() as conn:
            assert migrate_connection(conn) == []
            assert conn.execute(sa.text("SELECT count(*) FROM outbox.lanes")).scalar() == 32
    finally:
        engine.dispose()
    assert _version(empty_database_url) == LATEST


def test_a_scoped_session_and_a_connection_prepared_at_once(empty_database_url: str) -> None:
    """A scoped_session (Flask-SQLAlchemy's db.session) migrates through the session it holds;
    a psycopg connection that prepares every statement (prepare_threshold=0) runs the scripts
    unprepared, and finds nothing left to apply."""
    engine = _engine(empty_database_url)
    scoped = scoped_session(sessionmaker(engine))
    try:
        with scoped.begin():
            assert _versions(migrate_connection(scoped)) == list(range(1, LATEST + 1))
    finally:
        scoped.remove()
        engine.dispose()
    with psycopg.connect(empty_database_url, prepare_threshold=0) as conn:
        assert migrate_connection(conn) == []
    with psycopg.connect(empty_database_url, prepare_threshold=0) as conn:
        conn.execute("DROP SCHEMA outbox CASCADE")
        assert _versions(migrate_connection(conn)) == list(range(1, LATEST + 1))
        conn.rollback()


def test_after_outbox_migrate_there_is_nothing_left_to_apply(database_url: str) -> None:
    """A database that `outbox migrate` brought up to date gets no second copy of anything."""
    with psycopg.connect(database_url) as conn:
        assert migrate_connection(conn) == []


def test_autocommit_without_a_transaction_is_refused(empty_database_url: str) -> None:
    """In autocommit mode with no transaction open it raises instead of committing piecemeal."""
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        with pytest.raises(NoOpenTransaction, match="each migration would commit on its own"):
            migrate_connection(conn)
        assert conn.execute("SELECT to_regnamespace('outbox')").fetchone() == (None,)


def test_pipeline_mode_and_an_async_connection_are_refused_with_the_way_out(
    empty_database_url: str,
) -> None:
    """Its scripts cannot run in pipeline mode: refused before any statement, the
    transaction still usable (it was failed by a syntax error before). An async
    connection is told how to run it."""
    with psycopg.connect(empty_database_url) as conn:
        with conn.pipeline(), pytest.raises(ConnectionNotSupported, match="pipeline mode"):
            migrate_connection(conn)
        assert conn.info.transaction_status != TransactionStatus.INERROR
        assert migrate_connection(conn) != []

    async def on_async_connection() -> None:
        async with await psycopg.AsyncConnection.connect(empty_database_url) as conn:
            migrate_connection(conn)

    with pytest.raises(ConnectionNotSupported, match=r"run_sync\(migrate_connection\)"):
        asyncio.run(on_async_connection())


def test_a_database_newer_than_the_library_is_refused(database_url: str) -> None:
    """A schema version above the newest shipped file raises MigrationError naming both."""
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "INSERT INTO outbox.schema_migrations (version, name) VALUES (%s, 'future')",
            (LATEST + 1,),
        )
        with pytest.raises(MigrationError, match=f"version {LATEST + 1}, newer than"):
            migrate_connection(conn)


def test_outbox_migrate_waits_for_an_open_migrating_transaction(empty_database_url: str) -> None:
    """`outbox migrate` waits on the advisory lock until the caller commits, then applies none."""
    with psycopg.connect(empty_database_url) as conn, ThreadPoolExecutor(1) as pool:
        migrate_connection(conn)
        started = threading.Event()

        def run() -> list[Migration]:
            started.set()
            return migrate(empty_database_url)

        other = pool.submit(run)
        started.wait()
        # The other session is blocked on the advisory lock this transaction holds.
        wait_until(
            lambda: fetch_rows(
                empty_database_url,
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
            ),
            timeout=30,
            what="outbox migrate to wait on the migration lock",
        )
        assert not other.done()
        conn.commit()
        assert other.result(timeout=30) == []
    assert _version(empty_database_url) == LATEST
