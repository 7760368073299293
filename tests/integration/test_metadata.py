"""outbox.metadata describes exactly the tables the SQL migrations create.

Two checks, each against a database migrated by ``schema/*.sql``: Alembic's
own comparison (what autogenerate would propose) finds nothing, and the
catalog of a database built from the metadata alone (``create_all``) equals
the migrated one: columns, defaults, identity and generated columns,
constraints by name and definition, and indexes with their WHERE clauses,
which Alembic does not compare. Each check is also shown to notice a change.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

import outbox.metadata
from outbox.metadata import SCHEMA, include_name, metadata

pytestmark = pytest.mark.integration


def sa_url(url: str) -> str:
    """The same database on SQLAlchemy's psycopg 3 driver."""
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


@contextmanager
def sa_connection(url: str) -> Iterator[sa.Connection]:
    """A SQLAlchemy connection to ``url``, its engine disposed afterwards."""
    engine = sa.create_engine(sa_url(url), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def alembic_differences(url: str, target: sa.MetaData = metadata) -> list[Any]:
    """What autogenerate would change in the outbox schema, and any warning it gives.

    Types and server defaults are compared too (Alembic leaves server
    defaults out unless asked). A warning counts as a difference: Alembic
    reports a changed generated column only by warning that it "cannot be
    modified".
    """
    opts = {
        "include_schemas": True,
        "include_name": include_name,
        "compare_type": True,
        "compare_server_default": True,
    }
    with sa_connection(url) as conn, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        diffs = compare_metadata(MigrationContext.configure(conn, opts=opts), target)
    found: list[Any] = [d for d in diffs if _schema_of(d) == SCHEMA]
    found.extend(str(w.message) for w in caught if not issubclass(w.category, ResourceWarning))
    return found


def _schema_of(diff: Any) -> str | None:
    """The schema a diff from compare_metadata is about (its shape varies by kind)."""
    if isinstance(diff, list):  # modify_* diffs come grouped per column
        diff = diff[0]
    target = diff[1]
    if isinstance(target, sa.Table):
        return target.schema
    if isinstance(target, sa.Index | sa.Constraint):
        return target.table.schema if target.table is not None else None
    return str(target) if target is not None else None  # column diffs: (kind, schema, table, ...)


_CATALOG = {
    "columns": """
        SELECT c.relname,
               -- The position among live columns (a dropped column leaves a gap in attnum).
               row_number() OVER (PARTITION BY c.relname ORDER BY a.attnum),
               a.attname, format_type(a.atttypid, a.atttypmod),
               a.attnotnull, a.attidentity, a.attgenerated, pg_get_expr(d.adbin, d.adrelid)
        FROM pg_attribute AS a
        JOIN pg_class AS c ON c.oid = a.attrelid AND c.relkind = 'r'
        LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = %(schema)s::regnamespace AND a.attnum > 0
          AND NOT a.attisdropped
        ORDER BY 1, 2
    """,
    "constraints": """
        SELECT c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid)
        FROM pg_constraint AS k
        JOIN pg_class AS c ON c.oid = k.conrelid
        -- A constraint trigger (t) is a trigger, which no MetaData describes.
        WHERE k.connamespace = %(schema)s::regnamespace AND k.contype NOT IN ('n', 't')
        ORDER BY 1, 2
    """,
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = %(schema)s ORDER BY 1, 2
    """,
    "identity sequences": """
        SELECT c.relname, s.seqtypid::regtype::text, s.seqstart, s.seqincrement,
               s.seqmin, s.seqmax, s.seqcache, s.seqcycle
        FROM pg_sequence AS s
        JOIN pg_class AS c ON c.oid = s.seqrelid
        WHERE c.relnamespace = %(schema)s::regnamespace
        ORDER BY 1
    """,
}


def catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """The outbox schema's tables as PostgreSQL describes them (views and functions aside)."""
    with psycopg.connect(url) as conn:
        return {
            part: conn.execute(sql, {"schema": SCHEMA}).fetchall() for part, sql in _CATALOG.items()
        }


def catalog_differences(migrated: dict[str, Any], built: dict[str, Any]) -> list[str]:
    """Rows in one catalog and not the other, named by part."""
    out = []
    for part in _CATALOG:
        for row in sorted(set(migrated[part]) - set(built[part]), key=str):
            out.append(f"{part}: only migrated: {row}")
        for row in sorted(set(built[part]) - set(migrated[part]), key=str):
            out.append(f"{part}: only in metadata: {row}")
        if not out and migrated[part] != built[part]:
            out.append(f"{part}: same rows in another order")
    return out


@pytest.fixture
def built_from_metadata(empty_database_url: str) -> str:
    """A database whose outbox schema comes from ``metadata.create_all`` alone."""
    engine = sa.create_engine(sa_url(empty_database_url), poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(sa.schema.CreateSchema(SCHEMA))
            metadata.create_all(conn)
    finally:
        engine.dispose()
    return empty_database_url


def test_alembic_finds_no_difference_after_the_sql_migrations(database_url: str) -> None:
    """compare_metadata against the migrated schema: no op, no warning."""
    assert alembic_differences(database_url) == []


def test_metadata_builds_the_same_tables_as_the_migrations(
    database_url: str, built_from_metadata: str
) -> None:
    """Columns, defaults, constraints, indexes and identities equal those the SQL creates."""
    migrated = catalog(database_url)
    assert {row[0] for row in migrated["columns"]} == {t.name for t in metadata.sorted_tables}
    assert catalog_differences(migrated, catalog(built_from_metadata)) == []


def test_every_table_is_exported_by_name() -> None:
    """Each table of the metadata is a module attribute of the same name, for Core queries."""
    for table in metadata.sorted_tables:
        assert getattr(outbox.metadata, table.name) is table
        assert table.schema == SCHEMA


def _drop_column(conn: psycopg.Connection[Any]) -> None:
    conn.execute("ALTER TABLE outbox.publishers DROP COLUMN stopped_at")


def _add_column(conn: psycopg.Connection[Any]) -> None:
    conn.execute("ALTER TABLE outbox.batches ADD COLUMN note text")


def _change_type(conn: psycopg.Connection[Any]) -> None:
    conn.execute("ALTER TABLE outbox.attempts ALTER COLUMN attempt TYPE bigint")


def _change_default(conn: psycopg.Connection[Any]) -> None:
    conn.execute("ALTER TABLE outbox.messages ALTER COLUMN state SET DEFAULT 'quarantined'")


def _change_nullability(conn: psycopg.Connection[Any]) -> None:
    conn.execute("ALTER TABLE outbox.publishers ALTER COLUMN host DROP NOT NULL")


def _drop_index(conn: psycopg.Connection[Any]) -> None:
    conn.execute("DROP INDEX outbox.decisions_message")


def _change_generated_column(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "ALTER TABLE outbox.messages DROP COLUMN lane CASCADE, "
        "ADD COLUMN lane smallint GENERATED ALWAYS AS ((hashtext(id::text) % 16)::smallint) STORED"
    )


def _change_partial_index(conn: psycopg.Connection[Any]) -> None:
    conn.execute("DROP INDEX outbox.messages_pending_by_lane")
    conn.execute(
        "CREATE INDEX messages_pending_by_lane ON outbox.messages (lane, held, seq) "
        "WHERE state <> 'x'"
    )


def _change_check_constraint(conn: psycopg.Connection[Any]) -> None:
    conn.execute("ALTER TABLE outbox.attempts DROP CONSTRAINT attempts_outcome_known")
    conn.execute(
        "ALTER TABLE outbox.attempts ADD CONSTRAINT attempts_outcome_known CHECK (outcome <> '')"
    )


def _change_identity(conn: psycopg.Connection[Any]) -> None:
    conn.execute("ALTER TABLE outbox.batches ALTER COLUMN id SET GENERATED BY DEFAULT")


# What Alembic notices itself, and what only the catalog comparison does.
ALEMBIC_SEES = [
    _drop_column,
    _add_column,
    _change_type,
    _change_default,
    _change_nullability,
    _drop_index,
    _change_generated_column,
    _change_identity,
]
CATALOG_SEES = [*ALEMBIC_SEES, _change_partial_index, _change_check_constraint]


@pytest.mark.parametrize("change", ALEMBIC_SEES, ids=lambda f: f.__name__.strip("_"))
def test_alembic_comparison_notices_a_schema_change(
    database_url: str, change: Callable[[psycopg.Connection[Any]], None]
) -> None:
    """Each of these edits to the migrated schema makes compare_metadata report something."""
    with psycopg.connect(database_url) as conn:
        change(conn)
    assert alembic_differences(database_url) != []


@pytest.mark.parametrize("change", CATALOG_SEES, ids=lambda f: f.__name__.strip("_"))
def test_catalog_comparison_notices_a_schema_change(
    database_url: str, built_from_metadata: str, change: Callable[[psycopg.Connection[Any]], None]
) -> None:
    """Each of these edits, including WHERE clauses and checks, breaks the catalog equality."""
    with psycopg.connect(database_url) as conn:
        change(conn)
    assert catalog_differences(catalog(database_url), catalog(built_from_metadata)) != []


def test_a_column_missing_from_the_metadata_is_a_difference(database_url: str) -> None:
    """A copy of the metadata without messages.last_error yields a remove_column op."""
    partial = sa.MetaData(schema=SCHEMA)
    for table in metadata.sorted_tables:
        table.to_metadata(partial)
    messages = partial.tables[f"{SCHEMA}.messages"]
    messages._columns.remove(messages.c.last_error)  # no public way to drop one
    diffs = alembic_differences(database_url, partial)
    assert [(d[0], d[2], d[3].name) for d in diffs] == [("remove_column", "messages", "last_error")]


def test_without_include_schemas_alembic_would_create_the_tables(database_url: str) -> None:
    """As docs/embedding.md warns: without include_schemas=True Alembic proposes every table."""
    with sa_connection(database_url) as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), metadata)
    created = {d[1].name for d in diffs if not isinstance(d, list) and d[0] == "add_table"}
    assert created == {t.name for t in metadata.sorted_tables}
