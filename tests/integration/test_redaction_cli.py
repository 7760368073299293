"""The ``outbox`` CLI prints no secret of its database URL: not on errors, not in JSON.

Each command runs as a separate process, as an operator runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from urllib.parse import quote, urlsplit

import psycopg
import pytest

import outbox
from tests.support import run_outbox_cli

pytestmark = pytest.mark.integration

SECRET = "Sup3r-Secret-pw"  # noqa: S105 - a made-up password the tests look for
ODD = f"{SECRET} @/?#&="

#: Every credential form, pointing at a port where nothing listens (connection refused)
#: or not parsing at all; the password must show nowhere.
FAILING = [
    f"postgresql://alice:{SECRET}@127.0.0.1:1/app",
    f"postgresql://alice:{quote(ODD, safe='')}@127.0.0.1:1/app",
    f"postgresql://127.0.0.1:1/app?user=alice&password={SECRET}",
    f"postgresql://127.0.0.1:1/app?pass%77ord={SECRET}",
    f"postgresql://127.0.0.1:1/app?sslpassword={SECRET}&password={SECRET}",
    f"host=127.0.0.1 port=1 user=alice password='{SECRET} x' dbname=app",
    f"postgresql://alice:{SECRET}@127.0.0.1:notaport/app",
    # Do not parse:
    f"postgresql://alice:{SECRET}@[::1/app",
    f"postgresql://alice:{SECRET}%zz@127.0.0.1:1/app",
    f"postgresql://alice:{SECRET} x@127.0.0.1:1/app",
    f"host=127.0.0.1 port=1 password=first {SECRET}",
    # libpq reads the first '@': the "host" it cannot resolve is a piece of the password.
    f"postgresql://alice:pw@{SECRET}@127.0.0.1:1/app",
]

COMMANDS = [
    ("status", "--json"),
    ("list", "--state", "pending", "--json"),
    ("inspect", str(uuid.uuid4()), "--json"),
    ("migrate", "--create-roles"),
    ("resolve", str(uuid.uuid4()), "--pending", "--fence", "0", "--reason", "r"),
    ("purge", "--delivered-older-than", "1d", "--json"),
]


def _pieces() -> list[str]:
    return [SECRET, quote(ODD, safe=""), quote(SECRET, safe="")]


@pytest.mark.parametrize("url", FAILING)
def test_no_command_prints_the_password_of_a_failing_url(url: str) -> None:
    """Each command exits 2 with one line naming the problem, and no piece of the password."""
    for command in COMMANDS:
        done = run_outbox_cli(url, *command)
        assert done.returncode == 2, (command, done.stderr)
        assert done.stderr.startswith("outbox: "), (command, done.stderr)
        assert "Traceback" not in done.stderr
        for piece in _pieces():
            assert piece not in done.stdout + done.stderr, (command, done.stdout, done.stderr)


def test_a_url_that_does_not_parse_is_named_as_such() -> None:
    """The reason is libpq's, without the pieces of the URL it quotes."""
    done = run_outbox_cli(f"postgresql://u:{SECRET}@[::1/db", "status")
    assert done.returncode == 2
    assert done.stderr.startswith("outbox: the database URL could not be parsed: ")
    assert "IPv6 host address" in done.stderr


def _with_password(database_url: str, form: str) -> str:
    """The test database's URL with a password in the given form (the server trusts us)."""
    parts = urlsplit(database_url)
    user, _, host = parts.netloc.rpartition("@")
    if form == "userinfo":
        return parts._replace(netloc=f"{user}:{quote(ODD, safe='')}@{host}").geturl()
    if form == "query":
        return f"{database_url}?password={quote(ODD, safe='')}"
    hostname, _, port = host.partition(":")
    return (
        f"host={hostname} port={port} user={user} dbname={parts.path.lstrip('/')} "
        f"password='{SECRET} x'"
    )


@pytest.mark.parametrize("form", ["userinfo", "query", "key/value"])
def test_json_output_holds_no_secret(database_url: str, form: str) -> None:
    """status, list and inspect --json on a URL with a password show none of it."""
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, "orders", b"payload")
    url = _with_password(database_url, form)
    for command in (
        ("status", "--json"),
        ("list", "--state", "pending", "--json"),
        ("inspect", str(message_id), "--json"),
    ):
        done = run_outbox_cli(url, *command)
        assert done.returncode in (0, 1), done.stderr
        assert done.stdout.startswith("{"), done.stderr
        for piece in _pieces():
            assert piece not in done.stdout + done.stderr


def test_the_command_prints_no_password_from_the_environment() -> None:
    """PGPASSWORD (and OUTBOX_DATABASE_URL) are read, never printed, by the real process."""
    url = f"postgresql://alice:{SECRET}@127.0.0.1:1/app"
    env = {**os.environ, "PGPASSWORD": "Env-" + SECRET, "OUTBOX_DATABASE_URL": url}
    for args in (["status", "--json"], ["--help"], ["migrate", "--help"]):
        done = subprocess.run(
            [sys.executable, "-m", "outbox.cli", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert SECRET not in done.stdout + done.stderr
        assert "Traceback" not in done.stderr
