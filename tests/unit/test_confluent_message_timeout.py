"""The confluent sink's message.timeout.ms ends each record before its batch's write deadline."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("confluent_kafka", reason="the confluent extra is not installed")

from publisher.config import WRITE_MARGIN_MS, ConfigError, PublisherConfig
from publisher.confluent_sink import ConfluentSink, message_timeout_ms
from publisher.sink import KafkaSinkConfig

DEFAULTS = PublisherConfig("postgresql://localhost/outbox", "localhost:9092", sink="confluent")


def _sink_config(config: PublisherConfig, **extra: Any) -> KafkaSinkConfig:
    """The sink settings ``publisher.app.build_sink`` takes from a publisher's config."""
    return KafkaSinkConfig(
        config.kafka_bootstrap,
        linger_ms=config.linger_ms,
        delivery_timeout_ms=config.delivery_timeout_ms,
        request_timeout_ms=config.request_timeout_ms,
        max_block_ms=config.max_block_ms,
        extra=extra,
    )


@pytest.mark.parametrize(
    "config",
    [
        DEFAULTS,
        # tests.support.fast_publisher_flags
        replace(DEFAULTS, delivery_timeout_ms=3_000, request_timeout_ms=1_000, max_block_ms=2_000),
        replace(DEFAULTS, delivery_timeout_ms=10_000, request_timeout_ms=1, max_block_ms=1),
        replace(
            DEFAULTS, delivery_timeout_ms=120_000, request_timeout_ms=30_000, lease_seconds=300
        ),
    ],
    ids=["defaults", "fast", "tiny-request-timeout", "long"],
)
def test_every_record_is_given_up_before_its_batchs_write_deadline(
    config: PublisherConfig,
) -> None:
    """Handed over as late as allowed, a record's last possible write is within the deadline."""
    assert config.problems() == []
    timeout = message_timeout_ms(_sink_config(config))
    latest_stamp = config.hand_over_seconds + config.max_block_ms / 1000
    last_write = latest_stamp + (timeout + WRITE_MARGIN_MS) / 1000
    assert last_write <= config.write_deadline_seconds


def test_the_delivery_timeout_is_kept_where_the_request_timeout_covers_the_margin() -> None:
    """By default librdkafka gives each record the delivery timeout, as kafka-python does."""
    assert message_timeout_ms(_sink_config(DEFAULTS)) == DEFAULTS.delivery_timeout_ms


def test_the_delivery_timeout_is_shortened_where_the_request_timeout_is_below_the_margin() -> None:
    """3 s + 1 s leave 1.9 s once librdkafka's 2.1 s of late writing is taken off."""
    config = replace(DEFAULTS, delivery_timeout_ms=3_000, request_timeout_ms=1_000)
    assert message_timeout_ms(_sink_config(config)) == 1_900


def test_timeouts_that_leave_librdkafka_no_time_are_refused_naming_the_settings() -> None:
    """Checked with the settings (exit 2 from the CLI), and again before any producer exists:
    the error names both settings and the margin."""
    config = replace(DEFAULTS, delivery_timeout_ms=1_500, request_timeout_ms=500)
    assert replace(config, sink="kafka-python").problems() == []
    [problem] = replace(config, sink="confluent").problems()
    assert problem.fields == {"delivery_timeout_ms", "request_timeout_ms"}
    with pytest.raises(ConfigError) as refused:
        ConfluentSink(_sink_config(config))
    text = str(refused.value)
    assert "--delivery-timeout-ms" in text
    assert "--request-timeout-ms" in text
    assert f"{WRITE_MARGIN_MS} ms" in text


def test_a_librdkafka_timeout_in_extra_may_shorten_the_timeout() -> None:
    """A shorter ``message.timeout.ms`` among the librdkafka properties is kept."""
    assert message_timeout_ms(_sink_config(DEFAULTS, **{"message.timeout.ms": 5_000})) == 5_000


@pytest.mark.parametrize(
    ("name", "value"),
    [("message.timeout.ms", 38_000), ("delivery.timeout.ms", 60_000), ("message.timeout.ms", 0)],
)
def test_a_librdkafka_timeout_in_extra_that_outlasts_the_deadline_is_refused(
    name: str, value: int
) -> None:
    """Longer than the deadline allows, or 0 (never time out): refused, naming the property."""
    with pytest.raises(ConfigError, match=rf"{name}={value} .* between 1 and 37900 ms"):
        ConfluentSink(_sink_config(DEFAULTS, **{name: value}))


def test_a_linger_as_long_as_the_timeout_is_shortened_so_the_producer_can_be_made() -> None:
    """librdkafka refuses linger.ms >= message.timeout.ms; the sink lingers just below it."""
    config = replace(DEFAULTS, delivery_timeout_ms=3_000, request_timeout_ms=1_000, linger_ms=2_000)
    assert config.problems() == []
    sink = ConfluentSink(_sink_config(replace(config, kafka_bootstrap="127.0.0.1:1")))
    try:
        sink._get_producer()  # connects in the background; nothing is sent
    finally:
        sink.close()
