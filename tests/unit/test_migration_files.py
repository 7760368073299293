"""Finding and ordering the numbered migration files (outbox/migrations.py), without a database."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from outbox.errors import MigrationError
from outbox.migrations import load_migrations, migrate


def _write(directory: Path, *names: str) -> None:
    for name in names:
        (directory / name).write_text(f"-- {name}\nSELECT 1;\n", encoding="utf-8")


def test_shipped_migrations_are_numbered_from_one_without_gaps() -> None:
    """The shipped migrations load as versions 1..N in order, each with a name and SQL."""
    migrations = load_migrations()
    assert [m.version for m in migrations] == list(range(1, len(migrations) + 1))
    assert migrations[0].name == "initial"
    for m in migrations:
        assert re.fullmatch(r"[a-z0-9_]+", m.name)
        assert m.sql.strip()


def test_load_migrations_orders_by_version_and_reads_names_and_sql(tmp_path: Path) -> None:
    """Files are returned ordered by version whatever order they were written in."""
    _write(tmp_path, "0003_third_step.sql", "0001_initial.sql", "0002_add_index.sql")
    migrations = load_migrations(tmp_path)
    assert [(m.version, m.name) for m in migrations] == [
        (1, "initial"),
        (2, "add_index"),
        (3, "third_step"),
    ]
    assert migrations[1].sql == "-- 0002_add_index.sql\nSELECT 1;\n"


def test_load_migrations_rejects_a_gap_naming_the_missing_version(tmp_path: Path) -> None:
    """0001 and 0003 without 0002 raises MigrationError naming 0002."""
    _write(tmp_path, "0001_initial.sql", "0003_later.sql")
    with pytest.raises(MigrationError, match="migration 0002 is missing"):
        load_migrations(tmp_path)


def test_load_migrations_rejects_a_set_not_starting_at_one(tmp_path: Path) -> None:
    """Migrations starting at 0002 raise MigrationError naming 0001."""
    _write(tmp_path, "0002_second.sql")
    with pytest.raises(MigrationError, match="migration 0001 is missing"):
        load_migrations(tmp_path)


@pytest.mark.parametrize(
    "bad_name",
    ["initial.sql", "1_initial.sql", "00002_initial.sql", "0002-initial.sql", "0002_Initial.sql"],
)
def test_load_migrations_rejects_a_badly_named_sql_file(tmp_path: Path, bad_name: str) -> None:
    """A .sql file not named NNNN_name.sql raises MigrationError naming the file."""
    _write(tmp_path, "0001_initial.sql", bad_name)
    with pytest.raises(MigrationError, match=re.escape(repr(bad_name))):
        load_migrations(tmp_path)


def test_load_migrations_rejects_an_empty_directory(tmp_path: Path) -> None:
    """A directory without migration files raises MigrationError."""
    with pytest.raises(MigrationError, match="no migrations found"):
        load_migrations(tmp_path)


def test_load_migrations_ignores_files_that_are_not_sql(tmp_path: Path) -> None:
    """README, backups and other non-.sql files are skipped."""
    _write(tmp_path, "0001_initial.sql", "README.md", "0002_draft.sql.bak", "notes.txt")
    assert [m.version for m in load_migrations(tmp_path)] == [1]


def test_load_migrations_with_only_non_sql_files_finds_none(tmp_path: Path) -> None:
    """A directory holding only non-.sql files raises MigrationError as an empty one does."""
    _write(tmp_path, "README.md")
    with pytest.raises(MigrationError, match="no migrations found"):
        load_migrations(tmp_path)


@pytest.mark.parametrize("lock_timeout", [0.0, -1.0, math.inf, math.nan, 2_147_484.0])
def test_migrate_refuses_a_lock_timeout_postgresql_cannot_take(lock_timeout: float) -> None:
    """Refused before any connection (the URL leads nowhere), naming the range."""
    with pytest.raises(MigrationError, match="more than 0 and at most 2147483 seconds"):
        migrate("postgresql://unused.invalid/none", lock_timeout=lock_timeout)
