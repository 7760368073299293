"""Parsing retention periods, and purge's argument checks (no database needed)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import pytest

from outbox.retention import MIN_DELIVERED_AGE, parse_duration, purge
from publisher.config import ConfigError, PublisherConfig


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
        # Past a timedelta's range, and before 1970 (where message ids begin).
        ("99999999999999w", "at most 520w"),
        ("521w", "at most 520w"),
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
    with pytest.raises(ValueError, match="evidence_older_than must be at most 3640 days"):
        purge(
            conn, delivered_older_than=timedelta(days=7), evidence_older_than=timedelta(weeks=530)
        )


def test_a_window_too_long_is_a_configuration_problem_of_the_publisher() -> None:
    """The publisher lists it with its other problems, instead of failing at start."""
    config = PublisherConfig(
        database_url="postgresql://x", kafka_bootstrap="h:1", purge_delivered_after="99999999999w"
    )
    assert [p.text for p in config.problems()] == [
        "purge delivered after: '99999999999w': a retention period must be at most 520w "
        "(about ten years); to keep rows for ever, turn retention off"
    ]


def test_purge_refuses_a_delivered_window_under_the_minimum() -> None:
    """A delivered window under MIN_DELIVERED_AGE (5 minutes) is refused before any SQL,
    naming the minimum; exactly the minimum is accepted as far as the checks go."""
    conn = cast(Any, object())
    assert timedelta(minutes=5) == MIN_DELIVERED_AGE
    for short in (timedelta(seconds=1), timedelta(seconds=90), timedelta(seconds=299)):
        with pytest.raises(ValueError, match="shorter than the minimum, 5 minutes"):
            purge(conn, delivered_older_than=short)
    # At the minimum the checks pass and the purge goes on to the (fake) connection.
    with pytest.raises(AttributeError):
        purge(conn, delivered_older_than=MIN_DELIVERED_AGE)


def test_the_library_minimum_covers_the_publishers_defaults() -> None:
    """With its defaults a publisher decides an uncertain message within the library's floor."""
    config = PublisherConfig(database_url="postgresql://x", kafka_bootstrap="h:1")
    assert config.write_deadline_seconds + config.absence_grace <= MIN_DELIVERED_AGE.total_seconds()


@pytest.mark.parametrize(
    ("overrides", "window", "minimum"),
    [
        ({}, "299s", "300s"),
        ({}, "1s", "300s"),
        # 10 s hand-over + 10 s max block + 310 s longest send = 330 s, + 60 s grace.
        (
            {"delivery_timeout_ms": 300_000, "lease_seconds": 600, "absence_grace": 60.0},
            "6m",
            "390s",
        ),
    ],
)
def test_the_publisher_refuses_a_window_under_its_write_deadline_and_grace(
    overrides: dict[str, Any], window: str, minimum: str
) -> None:
    """--purge-delivered-after under the write deadline plus the absence grace (and never
    under the library's floor) is a config error naming the minimum."""
    config = PublisherConfig(
        database_url="postgresql://x",
        kafka_bootstrap="h:1",
        purge_delivered_after=window,
        purge_evidence_after="30d",
        **overrides,
    )
    with pytest.raises(ConfigError) as refused:
        config.validate()
    (line,) = [p for p in str(refused.value).splitlines() if "purge delivered after" in p]
    assert f"must be at least {minimum}" in line


@pytest.mark.parametrize(
    ("overrides", "window"),
    [
        ({}, "5m"),
        ({"delivery_timeout_ms": 300_000, "lease_seconds": 600, "absence_grace": 60.0}, "390s"),
    ],
)
def test_the_publisher_accepts_a_window_of_exactly_the_minimum(
    overrides: dict[str, Any], window: str
) -> None:
    """A window equal to the minimum is accepted."""
    PublisherConfig(
        database_url="postgresql://x",
        kafka_bootstrap="h:1",
        purge_delivered_after=window,
        **overrides,
    ).validate()


def test_windows_are_named_as_people_say_them() -> None:
    """Refusals give windows as "7 days", "90 seconds", not Python's "7 days, 0:00:00"."""
    conn = cast(Any, object())
    with pytest.raises(ValueError, match=r"delivered window \(90 seconds\) is shorter"):
        purge(conn, delivered_older_than=timedelta(seconds=90))
    with pytest.raises(ValueError, match=r"must be at most 3640 days, got 4000000001 seconds"):
        purge(conn, delivered_older_than=timedelta(seconds=4_000_000_001))
    with pytest.raises(
        ValueError,
        match=r"evidence window \(1 day\) must be at least the delivered window \(7 days\)",
    ):
        purge(conn, delivered_older_than=timedelta(days=7), evidence_older_than=timedelta(days=1))
