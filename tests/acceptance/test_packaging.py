"""The wheel a user installs: what it carries, and what the library alone brings.

The wheel is built from this checkout once per module. One test reads it; the
other installs it with no extra into a fresh virtualenv (pip fetches psycopg
from the package index, or its cache) and uses it there as a service that only
enqueues would: migrate, check the status, enqueue in a transaction, with
nothing that talks to Kafka or SQLAlchemy installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from outbox.migrations import load_migrations
from tests.support import fetch_rows

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]

#: What only an extra brings; a service that installs the library alone has none of it.
NOT_IN_THE_LIBRARY = ("kafka", "confluent_kafka", "sqlalchemy", "prometheus_client", "publisher")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout built into a wheel, as ``pip wheel`` builds it for a user."""
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    [built] = dist.glob("pg_kafka_outbox-*.whl")
    return built


def test_wheel_ships_migrations_queries_and_both_console_scripts(wheel: Path) -> None:
    """The built wheel holds every migration, queries.sql and the two entry points."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(
            archive.read(n).decode() for n in names if n.endswith("entry_points.txt")
        )
    for migration in load_migrations():
        assert f"outbox/schema/{migration.version:04d}_{migration.name}.sql" in names
    assert "outbox/queries.sql" in names
    assert "outbox = outbox.cli:main" in entry_points
    assert "outbox-publisher = publisher.cli:main" in entry_points
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


class _Venv:
    """A fresh virtualenv; its commands run isolated from this checkout and its PYTHONPATH."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bin = path / "bin"
        # -I (isolated) in every python call ignores PYTHON* variables and the
        # current folder; the scripts get an environment without PYTHONPATH too.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        self.env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    def run(self, *command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run a program of the venv (``python``, ``pip``, ``outbox``) from outside the checkout."""
        program, *args = command
        return subprocess.run(
            [str(self.bin / program), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=self.env,
            cwd=self.path,
        )

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``code`` with the venv's interpreter, isolated."""
        return self.run("python", "-I", "-c", code, *args)


def _ok(result: subprocess.CompletedProcess[str], what: Sequence[str] = ()) -> str:
    assert result.returncode == 0, f"{' '.join(what)}: {result.stdout}{result.stderr}"
    return result.stdout


_ENQUEUE = """
import sys, psycopg, outbox
with psycopg.connect(sys.argv[1]) as conn:
    conn.execute("CREATE TABLE IF NOT EXISTS orders (id int PRIMARY KEY)")
    conn.execute("INSERT INTO orders VALUES (1)")
    print(outbox.enqueue(conn, "orders", {"id": 1}, key="customer-7"))
"""

_IMPORTS = """
import importlib, json, sys
import outbox, outbox.cli, outbox.migrations
names = sys.argv[1:]
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(names))
refused = {}
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        refused[name] = str(exc)
print(json.dumps({"loaded_by_outbox": loaded, "refused": refused}))
"""


def test_the_library_alone_installs_migrates_and_enqueues_without_kafka(
    wheel: Path, tmp_path: Path, empty_database_url: str
) -> None:
    """Installed with no extra, the wheel migrates and enqueues; no Kafka, SQLAlchemy,
    metrics client or publisher is importable, and `outbox reconcile` names the extra."""
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=120)
    venv = _Venv(tmp_path / "venv")
    _ok(venv.run("python", "-I", "-m", "pip", "install", "--quiet", str(wheel), timeout=300))

    found = json.loads(_ok(venv.python(_IMPORTS, *NOT_IN_THE_LIBRARY), ["import outbox"]))
    assert found["loaded_by_outbox"] == []
    assert sorted(found["refused"]) == sorted(NOT_IN_THE_LIBRARY)
    # The wheel ships the publisher's code; without its extra it says what to install.
    assert "pip install 'pg-kafka-outbox[publisher]'" in found["refused"]["publisher"]

    migrated = _ok(venv.run("outbox", "--database-url", empty_database_url, "migrate"))
    assert f"schema at version {load_migrations()[-1].version}" in migrated
    message_id = uuid.UUID(_ok(venv.python(_ENQUEUE, empty_database_url), ["enqueue"]).strip())
    assert fetch_rows(
        empty_database_url, "SELECT topic, state FROM outbox.messages WHERE id = %s", message_id
    ) == [("orders", "pending")]
    status = venv.run("outbox", "--database-url", empty_database_url, "status", "--json")
    # 1: a pending message and no publisher running needs an operator.
    assert status.returncode == 1, status.stderr
    assert json.loads(status.stdout)

    moved = venv.run("outbox", "--database-url", empty_database_url, "reconcile")
    assert moved.returncode == 2
    assert "outbox-publisher reconcile" in moved.stderr
    assert "pg-kafka-outbox[publisher]" in moved.stderr
    for args in (["--help"], ["reconcile", "--database-url", empty_database_url]):
        sidecar = venv.run("outbox-publisher", *args)
        # One line, no traceback, and not reconcile's 1 ("some left uncertain").
        assert sidecar.returncode == 2, sidecar.stderr
        assert sidecar.stderr.splitlines() == [
            "outbox-publisher: the outbox publisher needs kafka, prometheus_client: "
            "pip install 'pg-kafka-outbox[publisher]'"
        ]
