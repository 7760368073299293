"""The wheel a user installs carries the SQL the library and the publisher need."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from outbox.migrations import load_migrations

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_migrations_queries_and_both_console_scripts(tmp_path: Path) -> None:
    """The built wheel holds every migration, queries.sql and the two entry points."""
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
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("pg_kafka_outbox-*.whl")
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
