"""Migration 0010's storage settings: applied as documented, without waiting for enqueues."""

from __future__ import annotations

import psycopg
import pytest

import outbox
from outbox.migrations import migrate

pytestmark = pytest.mark.integration

STORAGE_SETTINGS = 10


def _options(conn: psycopg.Connection[tuple[object, ...]], table: str) -> dict[str, str]:
    row = conn.execute(
        "SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = %s::regclass",
        (f"outbox.{table}",),
    ).fetchone()
    assert row is not None
    options = row[0]
    assert isinstance(options, list)
    return dict(str(o).split("=", 1) for o in options)


def test_the_tables_get_their_settings(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        messages = _options(conn, "messages")
        assert messages["autovacuum_vacuum_scale_factor"] == "0.05"
        assert messages["autovacuum_analyze_scale_factor"] == "0.02"
        assert messages["autovacuum_vacuum_cost_limit"] == "1000"
        assert "fillfactor" not in messages
        assert _options(conn, "batches")["fillfactor"] == "80"
        for small in ("partition_offsets", "lanes", "publishers"):
            assert _options(conn, small)["fillfactor"] == "50", small


def test_the_migration_does_not_wait_for_an_open_enqueue(empty_database_url: str) -> None:
    """An enqueuing transaction left open does not hold the migration back, nor it the enqueue."""
    migrate(empty_database_url, target=STORAGE_SETTINGS - 1)
    with psycopg.connect(empty_database_url) as writer:
        outbox.enqueue(writer, "orders", b"still open")  # not committed until the end
        # A lock that conflicted with the writer's would time out after 1 s.
        applied = migrate(
            empty_database_url, target=STORAGE_SETTINGS, lock_timeout=1.0, lock_attempts=1
        )
        assert [m.version for m in applied] == [STORAGE_SETTINGS]
        writer.commit()
    with psycopg.connect(empty_database_url) as conn:
        assert _options(conn, "lanes")["fillfactor"] == "50"
        row = conn.execute("SELECT count(*) FROM outbox.messages").fetchone()
        assert row == (1,)
