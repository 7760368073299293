"""Array parameters built as text (``publisher.store.array_literal``) read back exactly."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from publisher.store import array_literal

pytestmark = pytest.mark.integration

AWKWARD_TEXT = [
    None,
    "",
    "NULL",
    "plain",
    'say "hi"',
    "back\\slash",
    '\\"',
    "{braces}, commas, and spaces ",
    "line\nbreak\ttab",
    "ünïcødé ☃",
]


@pytest.mark.parametrize(
    ("values", "pg_type"),
    [
        (AWKWARD_TEXT, "text"),
        ([uuid.uuid4(), None, uuid.UUID(int=0)], "uuid"),
        ([0, -1, 2**62, None], "bigint"),
        ([0.0, 0.5, 1e-05, 123456.789, None], "float8"),
        ([True, False, None], "boolean"),
        ([], "text"),
    ],
)
def test_round_trip(database_url: str, values: list[object], pg_type: str) -> None:
    """What PostgreSQL parses from the literal equals the Python values, NULLs included."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(f"SELECT %s::{pg_type}[]", (array_literal(values),)).fetchone()
    assert row is not None
    assert row[0] == values
