"""``outbox migrate``: applies every migration once, also when run concurrently."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from outbox.migrations import current_version, load_migrations, migrate

pytestmark = pytest.mark.integration


def _recorded(url: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        return conn.execute(
            "SELECT version, name FROM outbox.schema_migrations ORDER BY version"
        ).fetchall()


def test_migrate_applies_once_and_records_the_version(empty_database_url: str) -> None:
    """The first run applies everything; a second run applies nothing."""
    shipped = load_migrations()
    assert [m.version for m in migrate(empty_database_url)] == [m.version for m in shipped]
    assert migrate(empty_database_url) == []
    assert _recorded(empty_database_url) == [(m.version, m.name) for m in shipped]
    with psycopg.connect(empty_database_url) as conn:
        assert current_version(conn) == shipped[-1].version
        assert conn.execute("SELECT count(*) FROM outbox.status").fetchone() == (6,)


def test_concurrent_migrations_apply_each_file_once(empty_database_url: str) -> None:
    """Four processes migrating at once: every migration applied by exactly one of them."""
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: migrate(empty_database_url), range(4)))
    applied = [m.version for result in results for m in result]
    assert sorted(applied) == [m.version for m in load_migrations()]
    assert len(_recorded(empty_database_url)) == len(load_migrations())
