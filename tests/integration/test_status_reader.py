"""The metrics' status reader (publisher/metrics.py) on a real PostgreSQL: its own settings
(statement timeout, JIT off) come as statements, so the URL's own ``options`` are kept."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

from publisher.metrics import StatusReader

pytestmark = pytest.mark.integration


def _show(conn: psycopg.Connection[Any], setting: str) -> object:
    row = conn.execute(f"SHOW {setting}").fetchone()
    assert row is not None
    return row[0]


@pytest.fixture
def url_with_options(database_url: str) -> str:
    """The test's database, with a setting of its own in the URL's ``options``."""
    options = quote("-c work_mem=7MB")
    return database_url + ("&" if "?" in database_url else "?") + f"options={options}"


def test_the_urls_options_are_kept_beside_the_readers_own_settings(
    url_with_options: str,
) -> None:
    """The URL's options (here work_mem) hold on the metrics connection, and so do the
    reader's statement timeout and JIT off; the status itself reads as ever."""
    seen: dict[str, object] = {}

    def read(conn: psycopg.Connection[Any]) -> list[Any]:
        seen.update({s: _show(conn, s) for s in ("work_mem", "statement_timeout", "jit")})
        return []

    reader = StatusReader(url_with_options, read=read, timeout_seconds=3)
    try:
        assert reader() == []
        # Both only for the read's transaction: a pooler may hand the session on.
        with psycopg.connect(url_with_options) as fresh:
            defaults = {s: _show(fresh, s) for s in ("statement_timeout", "jit")}
        assert reader._conn is not None
        assert {s: _show(reader._conn, s) for s in defaults} == defaults
    finally:
        reader.close()
    assert seen == {"work_mem": "7MB", "statement_timeout": "3s", "jit": "off"}
    default = StatusReader(url_with_options)
    try:
        assert list(default()) == []  # a migrated, empty outbox
    finally:
        default.close()


def test_a_read_longer_than_the_timeout_is_cut_off_and_the_next_one_reconnects(
    url_with_options: str,
) -> None:
    """A status read that outlasts the timeout is cancelled by the server at the timeout;
    the reader closes that connection and the next read opens another, bounded the same."""
    sessions: list[tuple[int, object]] = []

    def read(conn: psycopg.Connection[Any]) -> list[Any]:
        sessions.append((conn.info.backend_pid, _show(conn, "statement_timeout")))
        if len(sessions) == 1:
            conn.execute("SELECT pg_sleep(10)")
        return []

    reader = StatusReader(url_with_options, read=read, timeout_seconds=1)
    try:
        started = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled):
            reader()
        assert time.monotonic() - started < 5
        assert reader() == []
    finally:
        reader.close()
    (first, first_timeout), (second, second_timeout) = sessions
    assert first != second
    assert first_timeout == second_timeout == "1s"
