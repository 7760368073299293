"""The database seam of the library: run SQL on whatever connection the caller holds.

``enqueue`` accepts a SQLAlchemy ``Session``, a SQLAlchemy ``Connection`` or a
psycopg 3 ``Connection``. Statements go through SQLAlchemy when the caller
uses it, so that SQLAlchemy's own transaction bookkeeping sees them (a
statement sent behind its back would not be committed by ``conn.commit()``).
Nothing here begins, commits or rolls back a transaction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from sqlalchemy.engine import Connection as SAConnection
from sqlalchemy.orm import Session

from outbox.errors import ConnectionNotSupported, NoOpenTransaction, TransactionAborted

# A tuple, not a list: SQLAlchemy reads a list of parameters as "execute many".
Params = tuple[Any, ...] | Mapping[str, Any]


class Executor(Protocol):
    """Runs one statement in the caller's transaction and returns its rows."""

    def fetchall(self, sql: str, params: Params) -> list[tuple[Any, ...]]:
        """Execute ``sql`` with psycopg-style placeholders and return all rows."""
        ...


class PsycopgExecutor:
    """Executes on a caller's psycopg 3 connection."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def fetchall(self, sql: str, params: Params) -> list[tuple[Any, ...]]:
        """Execute on a tuple-row cursor whatever row factory the caller chose."""
        with self._conn.cursor(row_factory=tuple_row) as cur:
            cur.execute(sql, params)
            return cur.fetchall() if cur.description is not None else []


class SQLAlchemyExecutor:
    """Executes through a SQLAlchemy connection so its transaction tracks the write."""

    def __init__(self, conn: SAConnection) -> None:
        self._conn = conn

    def fetchall(self, sql: str, params: Params) -> list[tuple[Any, ...]]:
        """Execute with ``exec_driver_sql``: the SQL goes to psycopg unchanged."""
        result = self._conn.exec_driver_sql(sql, params)
        return [tuple(row) for row in result] if result.returns_rows else []


def executor_for(conn: object) -> Executor:
    """Return an executor for ``conn`` after checking it has a usable open transaction."""
    if isinstance(conn, psycopg.Connection):
        _check_transaction(conn)
        return PsycopgExecutor(conn)
    if isinstance(conn, Session):
        conn = conn.connection()
    if isinstance(conn, SAConnection):
        driver = conn.connection.driver_connection
        if not isinstance(driver, psycopg.Connection):
            raise ConnectionNotSupported(
                f"the SQLAlchemy connection uses the {conn.dialect.name}+{conn.dialect.driver} "
                "driver; outbox needs psycopg 3 (a 'postgresql+psycopg://' URL)"
            )
        _check_transaction(driver)
        return SQLAlchemyExecutor(conn)
    raise ConnectionNotSupported(
        f"conn must be a SQLAlchemy Session or Connection or a psycopg 3 Connection, "
        f"got {type(conn).__module__}.{type(conn).__qualname__}"
    )


def _check_transaction(conn: psycopg.Connection[Any]) -> None:
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise TransactionAborted(
            "the transaction has already failed; roll it back before enqueuing"
        )
    if conn.autocommit and status == TransactionStatus.IDLE:
        raise NoOpenTransaction(
            "the connection is in autocommit mode with no transaction open, so the intent "
            "would commit on its own; enqueue inside a transaction "
            "(psycopg: `with conn.transaction():`, SQLAlchemy: a non-AUTOCOMMIT connection)"
        )
