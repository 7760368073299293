"""The ``outbox`` command against a real database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import psycopg
import pytest

import outbox
from tests.support import run_outbox_cli

pytestmark = pytest.mark.integration


def _outbox(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return run_outbox_cli(url, *args)


def test_migrate_then_status_json_counts_every_state(empty_database_url: str) -> None:
    """migrate prints the version; status --json maps every state to its count."""
    first = _outbox("migrate", url=empty_database_url)
    assert first.returncode == 0, first.stderr
    assert "applied now: 0001_initial" in first.stdout
    again = _outbox("migrate", url=empty_database_url)
    assert again.returncode == 0
    assert "applied now: none" in again.stdout

    with psycopg.connect(empty_database_url) as conn:
        outbox.enqueue_many(conn, [outbox.Message("t", b"x") for _ in range(3)])
        conn.execute(
            "UPDATE outbox.messages SET state = 'quarantined' "
            "WHERE id = (SELECT id FROM outbox.messages ORDER BY seq LIMIT 1)"
        )
    status = _outbox("status", "--json", url=empty_database_url)
    assert status.returncode == 1  # a quarantined message needs an operator
    report = json.loads(status.stdout)
    assert report["counts"] == {
        "pending": 2,
        "in_flight": 0,
        "delivered": 0,
        "uncertain": 0,
        "quarantined": 1,
        "discarded": 0,
    }
    assert report["healthy"] is False
    table = _outbox("status", url=empty_database_url)
    assert table.returncode == 1
    assert "quarantined" in table.stdout
    assert "NEEDS ACTION: read its error" in table.stdout
    assert "outbox retry ID --fence N, or outbox discard ID --fence N" in table.stdout


def test_the_database_url_may_follow_the_command(database_url: str) -> None:
    """`outbox status --database-url URL` works as `outbox --database-url URL status`; given
    in both places, the one after the command is used."""
    with psycopg.connect(database_url) as conn:
        outbox.enqueue(conn, "t", b"x")
    refused = "postgresql://nobody@127.0.0.1:1/nowhere"
    for before in ([], ["--database-url", refused]):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "outbox.cli",
                *before,
                "status",
                "--json",
                "--database-url",
                database_url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={k: v for k, v in os.environ.items() if k != "OUTBOX_DATABASE_URL"},
        )
        assert result.returncode == 1, result.stderr  # pending, and no publisher running
        assert json.loads(result.stdout)["counts"]["pending"] == 1


def test_no_database_is_a_usage_error_of_the_command() -> None:
    """No --database-url and no OUTBOX_DATABASE_URL: exit 2 with the command's usage
    line (not the top one) and what to pass."""
    result = subprocess.run(
        [sys.executable, "-m", "outbox.cli", "list", "--state", "pending"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "OUTBOX_DATABASE_URL"},
    )
    assert result.returncode == 2
    assert result.stderr.startswith("usage: outbox list "), result.stderr
    assert "no database: pass --database-url or set OUTBOX_DATABASE_URL" in result.stderr


def test_status_on_healthy_database_exits_zero(database_url: str) -> None:
    """With nothing needing action, status exits 0."""
    result = _outbox("status", "--json", url=database_url)
    assert result.returncode == 0
    assert json.loads(result.stdout)["healthy"] is True


def test_status_before_migrate_says_what_to_do(empty_database_url: str) -> None:
    """An unmigrated database gets a clear message and exit code 2."""
    result = _outbox("status", url=empty_database_url)
    assert result.returncode == 2
    assert "run `outbox migrate`" in result.stderr


def test_unreachable_database_is_an_error_not_a_traceback() -> None:
    """A database that does not answer gives exit code 2 and one line."""
    url = f"postgresql://nobody@127.0.0.1:1/{uuid.uuid4().hex}"
    result = _outbox("status", url=url)
    assert result.returncode == 2
    assert result.stderr.startswith("outbox: ")
    assert "Traceback" not in result.stderr


def test_a_reader_that_closes_the_pipe_ends_the_command_without_a_traceback(
    database_url: str,
) -> None:
    """`outbox list ... | head -1`: the reader goes away mid-output. The command exits 141
    (as one killed by SIGPIPE does in a shell), not 1, which says an operator is needed,
    and prints no traceback."""
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(conn, [outbox.Message("t", "v" * 200) for _ in range(2_000)])
    command = [sys.executable, "-m", "outbox.cli", "--database-url", database_url]
    with subprocess.Popen(
        [*command, "list", "--state", "pending", "--limit", "2000", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as process:
        assert process.stdout is not None
        assert process.stderr is not None
        assert process.stdout.readline()
        process.stdout.close()
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=60) == 141, stderr
    assert stderr == ""
