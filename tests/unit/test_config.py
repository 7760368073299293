"""Checking publisher settings (publisher/config.py): every problem on its own line."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from outbox.errors import OutboxError
from publisher.config import ConfigError, PublisherConfig

VALID = PublisherConfig(database_url="postgresql://x", kafka_bootstrap="h:1")


def _problems(error: ConfigError) -> list[str]:
    """The problem lines of a ConfigError (its first line is the heading)."""
    heading, *lines = str(error).splitlines()
    assert heading == "invalid publisher configuration:"
    return [line.strip() for line in lines]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"database_url": "postgres://user:pw@db:5432/app"},
        {"kafka_bootstrap": "broker-1:9092, broker-2:9092,10.0.0.3:9093"},
        {"kafka_bootstrap": "[::1]:9092"},
        {"batch_size": 1, "poll_interval": 0.01},
        {"retry_base_seconds": 5.0, "retry_cap_seconds": 5.0},
        {"delivery_timeout_ms": 10_005, "linger_ms": 5, "request_timeout_ms": 10_000},
        {"lease_seconds": 40.001},
    ],
)
def test_valid_config_passes(overrides: dict[str, Any]) -> None:
    """A config with sound settings (edge values included) validates without error."""
    replace(VALID, **overrides).validate()


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"database_url": ""}, "database URL is missing"),
        ({"heartbeat_interval": 0}, "heartbeat interval (0s) must be positive"),
        ({"heartbeat_interval": 31}, "at most half the lease (60s)"),
        ({"recovery_interval": 0}, "recovery interval must be positive"),
        ({"reconcile_interval": -1}, "reconcile interval must be 0 (off) or positive"),
        ({"database_url": "mysql://x"}, "database URL 'mysql://x' must start with postgresql://"),
        ({"kafka_bootstrap": ""}, "Kafka bootstrap servers are missing"),
        ({"kafka_bootstrap": "host"}, "Kafka bootstrap server 'host' is not host:port"),
        ({"kafka_bootstrap": "host:port"}, "'host:port' is not host:port"),
        ({"kafka_bootstrap": ":9092"}, "':9092' is not host:port"),
        ({"kafka_bootstrap": "h:1,h2"}, "'h2' is not host:port"),
        ({"batch_size": 0}, "batch size must be at least 1, got 0"),
        ({"poll_interval": 0}, "poll interval must be positive, got 0"),
        ({"poll_interval": -1.0}, "poll interval must be positive"),
        ({"retry_base_seconds": 10.0, "retry_cap_seconds": 5.0}, "0 < base <= cap"),
        ({"retry_base_seconds": 0.0}, "0 < base <= cap"),
        (
            {"delivery_timeout_ms": 5_000, "linger_ms": 5, "request_timeout_ms": 10_000},
            "delivery timeout must be at least linger + request timeout",
        ),
        ({"lease_seconds": 40.0}, "lease (40s) must be longer than the longest a send can take"),
        ({"lease_seconds": 10.0}, "lease (10s) must be longer"),
    ],
)
def test_each_invalid_setting_is_reported_on_its_own_line(
    overrides: dict[str, Any], fragment: str
) -> None:
    """One bad setting gives a ConfigError with exactly one problem line, naming it."""
    with pytest.raises(ConfigError) as caught:
        replace(VALID, **overrides).validate()
    problems = _problems(caught.value)
    assert len(problems) == 1, problems
    assert fragment in problems[0]


def test_every_problem_is_listed_at_once() -> None:
    """Several bad settings are all listed, one line each, in a single ConfigError."""
    config = replace(
        VALID,
        database_url="",
        kafka_bootstrap="host",
        batch_size=0,
        poll_interval=0,
        retry_base_seconds=2.0,
        retry_cap_seconds=1.0,
        lease_seconds=1.0,
    )
    with pytest.raises(ConfigError) as caught:
        config.validate()
    problems = _problems(caught.value)
    assert len(problems) == 7, problems
    for fragment in (
        "heartbeat interval (5s) must be positive and at most half the lease (1s)",
        "database URL is missing",
        "'host' is not host:port",
        "batch size",
        "poll interval",
        "0 < base <= cap",
        "lease (1s) must be longer",
    ):
        assert sum(fragment in p for p in problems) == 1, fragment


def test_config_error_is_an_outbox_error() -> None:
    """ConfigError can be caught as outbox's base error."""
    with pytest.raises(OutboxError):
        replace(VALID, batch_size=0).validate()


def test_longest_send_is_delivery_plus_request_timeout() -> None:
    """The longest a send may take is delivery timeout plus request timeout, in seconds."""
    config = replace(VALID, delivery_timeout_ms=30_000, request_timeout_ms=10_000)
    assert config.longest_send_seconds == 40.0
