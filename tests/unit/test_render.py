"""How the outbox command lays out what it shows (pure formatting, no database)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest

from outbox.render import age, key_text, table, to_json


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (None, "-"),
        (-3, "0s"),
        (42.9, "42s"),
        (200, "3m 20s"),
        (5 * 3600 + 120, "5h 02m"),
        (2 * 86400 + 3 * 3600, "2d 03h"),
    ],
)
def test_ages_read_at_a_glance(seconds: float | None, shown: str) -> None:
    """Durations use the two largest units."""
    assert age(seconds) == shown


def test_keys_are_text_or_hex() -> None:
    """A UTF-8 key is shown as itself, anything else as 0x-prefixed hex."""
    assert key_text(b"order-7") == "order-7"
    assert key_text(b"\xff\x00") == "0xff00"
    assert key_text(None) is None


def test_json_turns_times_ids_and_bytes_into_text() -> None:
    """The JSON output never fails on the types the tables return."""
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    i = uuid.UUID(int=1)
    out = json.loads(to_json({"at": at, "id": i, "key": b"k", "rows": [(i, b"\xfe")]}))
    assert out == {
        "at": "2026-01-02T03:04:05+00:00",
        "id": str(i),
        "key": "k",
        "rows": [[str(i), "0xfe"]],
    }


def test_tables_align_columns_and_leave_the_last_one_ragged() -> None:
    """Cells are padded to the widest of their column; right-aligned ones on the left."""
    text = table([["STATE", "N", "NEXT"], ["pending", "12", "none"]], right=frozenset({1}))
    assert text.splitlines() == ["STATE     N  NEXT", "pending  12  none"]
