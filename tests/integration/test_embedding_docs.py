"""The code in docs/embedding.md works as shown.

The enqueue examples run against a real database with the names they
assume (``url``, ``engine``, ``orders``, ...). The Alembic excerpts are
checked to be verbatim parts of examples/migrations, which
tests/integration/test_alembic.py runs.
"""

from __future__ import annotations

import ast
import asyncio
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import outbox
from tests.support import assert_excerpt_of_file

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "embedding.md"


def python_blocks() -> list[tuple[str, str]]:
    """Every ```python block of the doc with the ``##`` section it is in."""
    blocks = []
    section = ""
    code: list[str] | None = None
    for line in DOC.read_text().splitlines(keepends=True):
        if code is not None:
            if line.rstrip() == "```":
                blocks.append((section, "".join(code)))
                code = None
            else:
                code.append(line)
        elif line.startswith("## "):
            section = line[3:].strip()
        elif line.rstrip() == "```python":
            code = []
    return blocks


class _Base(DeclarativeBase):
    pass


class Order(_Base):
    """The ``Order`` the Session example adds."""

    __tablename__ = "orders"
    id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    total: Mapped[Decimal]


def _create_tables(database_url: str) -> sa.Engine:
    """The tables the examples write to (``orders``, ``accounts`` with one account), and
    a synchronous engine on the database."""
    engine = sa.create_engine(
        database_url.replace("postgresql://", "postgresql+psycopg://", 1),
        poolclass=sa.pool.NullPool,
    )
    _Base.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE accounts (id text PRIMARY KEY, balance int)")
        conn.exec_driver_sql("INSERT INTO accounts VALUES ('acct-1', 100)")
    return engine


def _names(database_url: str, engine: object) -> dict[str, Any]:
    """The names an example assumes: the database, an engine, an order and an account."""
    return {
        "url": database_url,
        "engine": engine,
        "orders": Order.__table__,
        "Order": Order,
        "order_id": uuid.uuid4(),
        "total": Decimal("12.50"),
        "account": "acct-1",
    }


def test_the_enqueue_examples_commit_their_row_and_their_event(database_url: str) -> None:
    """The psycopg, SQLAlchemy Connection and Session examples each commit a row and an event."""
    examples = [code for _, code in python_blocks() if "outbox.enqueue(" in code]
    assert len(examples) == 3
    engine = _create_tables(database_url)
    try:
        for code in examples:
            names = _names(database_url, engine)
            exec(compile(code, str(DOC), "exec"), names)  # noqa: S102 - the doc's own examples
    finally:
        engine.dispose()
    with psycopg.connect(database_url) as conn:
        topics = [t for (t,) in conn.execute("SELECT topic FROM outbox.messages ORDER BY seq")]
        assert topics == ["payments", "orders", "orders"]
        assert conn.execute("SELECT balance FROM accounts").fetchone() == (90,)
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (2,)


def test_the_async_examples_commit_their_row_and_their_events(database_url: str) -> None:
    """The psycopg and SQLAlchemy async examples, and the cancellation one, each commit."""
    examples = [
        code
        for section, code in python_blocks()
        if "await outbox.aio." in code and section != "FastAPI"
    ]
    assert len(examples) == 4
    _create_tables(database_url).dispose()

    async def run_examples() -> None:
        engine = create_async_engine(
            database_url.replace("postgresql://", "postgresql+psycopg://", 1),
            poolclass=sa.pool.NullPool,
        )
        try:
            for code in examples:
                names = _names(database_url, engine)
                names["events"] = [outbox.Message("orders", {"n": n}) for n in range(2)]
                # The examples are written as the body of an async function.
                compiled = compile(code, str(DOC), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
                await eval(compiled, names)  # noqa: S307 - the doc's own examples
        finally:
            await engine.dispose()

    asyncio.run(run_examples())
    with psycopg.connect(database_url) as conn:
        topics = [t for (t,) in conn.execute("SELECT topic FROM outbox.messages ORDER BY seq")]
        assert topics == ["payments", "orders", "orders", "orders", "orders"]
        assert conn.execute("SELECT balance FROM accounts").fetchone() == (90,)
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (3,)


def test_the_fastapi_excerpt_is_part_of_the_tested_example() -> None:
    """The FastAPI block names its examples/ file and is a verbatim part of it."""
    [code] = [code for section, code in python_blocks() if section == "FastAPI"]
    first, _, rest = code.partition("\n")
    assert first == "# examples/fastapi_service.py"
    assert rest in (ROOT / "examples" / "fastapi_service.py").read_text()


def test_the_alembic_excerpts_are_parts_of_the_tested_example_project() -> None:
    """Each Alembic block names its examples/migrations file; each part between ``...`` is in it."""
    excerpts = [code for section, code in python_blocks() if section == "Alembic"]
    assert len(excerpts) >= 2
    for code in excerpts:
        assert_excerpt_of_file(code, ROOT / "examples" / "migrations")
