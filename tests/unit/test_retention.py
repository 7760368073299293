"""Parsing retention periods, and purge's argument checks (no database needed)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import pytest

from outbox.retention import parse_duration, purge


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", timedelta(seconds=30)),
        ("15m", timedelta(minutes=15)),
        ("12h", timedelta(hours=12)),
        ("7d", timedelta(days=7)),
        ("2w", timedelta(weeks=2)),
        ("1.5d", timedelta(hours=36)),
        (" 7d ", timedelta(days=7)),
    ],
)
def test_durations_in_every_unit(text: str, expected: timedelta) -> None:
    """A number and one unit letter make a period."""
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("7", "is not a duration"),
        ("d", "is not a duration"),
        ("7y", "is not a duration"),
        ("-1d", "is not a duration"),
        ("0s", "longer than zero"),
    ],
)
def test_bad_durations_say_what_is_accepted(text: str, says: str) -> None:
    """Anything else is refused with the accepted form."""
    with pytest.raises(ValueError, match=says):
        parse_duration(text)


def test_purge_checks_its_arguments_before_touching_the_database() -> None:
    """A zero window or batch size is refused before any SQL (the connection is never used)."""
    conn = cast(Any, object())
    with pytest.raises(ValueError, match="batch size"):
        purge(conn, delivered_older_than=timedelta(days=7), batch_size=0)
    with pytest.raises(ValueError, match="evidence_older_than"):
        purge(conn, delivered_older_than=timedelta(days=7), evidence_older_than=timedelta(0))
