"""librdkafka's errors classify as kafka-python's do; the ``sink`` setting chooses the producer."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from kafka import errors as kafka_errors

from publisher.app import build_publisher
from publisher.config import PublisherConfig
from publisher.outcomes import LibrdkafkaError, SendOutcome, classify, from_librdkafka

ck = pytest.importorskip("confluent_kafka", reason="the confluent extra is not installed")
E = ck.KafkaError


def _outcome(code: int, *, handed_to_producer: bool = True) -> SendOutcome:
    error = ck.KafkaError(code)
    return classify(
        from_librdkafka(error.code(), error.name(), error.str()),
        handed_to_producer=handed_to_producer,
    )


@pytest.mark.parametrize(
    "code",
    [
        E.MSG_SIZE_TOO_LARGE,
        E.RECORD_LIST_TOO_LARGE,
        E.TOPIC_AUTHORIZATION_FAILED,
        E.TOPIC_EXCEPTION,  # INVALID_TOPIC_EXCEPTION
        E.INVALID_MSG,  # CORRUPT_MESSAGE
        E.INVALID_RECORD,
        E.INVALID_TIMESTAMP,
        E.POLICY_VIOLATION,
    ],
)
@pytest.mark.parametrize("handed_to_producer", [True, False])
def test_content_refusals_are_non_retriable(code: int, handed_to_producer: bool) -> None:
    """The broker (or produce()) refused the record for what it is: quarantine it."""
    assert _outcome(code, handed_to_producer=handed_to_producer) is SendOutcome.NON_RETRIABLE


@pytest.mark.parametrize(
    "code",
    [
        E._MSG_TIMED_OUT,
        E._TRANSPORT,
        E._ALL_BROKERS_DOWN,
        E._TIMED_OUT,
        E._PURGE_INFLIGHT,
        E._PURGE_QUEUE,  # may be a retry put back in the queue after a written attempt
        E._UNKNOWN_TOPIC,
        E._UNKNOWN_PARTITION,
        E._FATAL,
        E._DESTROY,
        E.UNKNOWN_TOPIC_OR_PART,
        E.NOT_ENOUGH_REPLICAS,
        E.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        E.REQUEST_TIMED_OUT,
        E.OUT_OF_ORDER_SEQUENCE_NUMBER,
        E.INVALID_PRODUCER_EPOCH,
        E.NOT_LEADER_FOR_PARTITION,
    ],
)
def test_other_failures_of_a_record_handed_over_are_uncertain(code: int) -> None:
    """Without librdkafka's persistence status, none of these proves the record was not written."""
    assert _outcome(code) is SendOutcome.UNCERTAIN


@pytest.mark.parametrize("code", [E._QUEUE_FULL, E._UNKNOWN_PARTITION, E._FATAL, E._TRANSPORT])
def test_a_refusal_by_produce_is_not_written(code: int) -> None:
    """produce() raised: the record never entered the producer."""
    assert _outcome(code, handed_to_producer=False) is SendOutcome.NOT_WRITTEN


def test_broker_errors_become_kafka_pythons_classes_and_keep_librdkafkas_name() -> None:
    """The error text names kafka-python's class (as operators see it) and librdkafka's code."""
    error = from_librdkafka(E.MSG_SIZE_TOO_LARGE, "MSG_SIZE_TOO_LARGE", "Broker: too large")
    assert isinstance(error, kafka_errors.MessageSizeTooLargeError)
    assert "MSG_SIZE_TOO_LARGE" in str(error)
    local = from_librdkafka(E._MSG_TIMED_OUT, "_MSG_TIMED_OUT", "Local: Message timed out")
    assert isinstance(local, LibrdkafkaError)
    assert str(local).endswith("Local: Message timed out (librdkafka _MSG_TIMED_OUT)")


def _config(**overrides: Any) -> PublisherConfig:
    return PublisherConfig("postgresql://localhost/outbox", "localhost:9092", **overrides)


@pytest.mark.parametrize("sink", ["kafka-python", "confluent"])
def test_either_sink_is_accepted(sink: str) -> None:
    """Both producers are valid choices (the confluent one with its extra installed)."""
    assert _config(sink=sink).problems() == []


def test_an_unknown_sink_is_refused() -> None:
    """A misspelt sink names the choices."""
    [problem] = _config(sink="librdkafka").problems()
    assert problem.text == "sink 'librdkafka' is not one of kafka-python, confluent"


def test_the_confluent_sink_without_its_package_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without confluent-kafka installed, choosing it is a config error saying what to install."""
    find_spec = importlib.util.find_spec

    def without_confluent(name: str, package: str | None = None) -> Any:
        return None if name == "confluent_kafka" else find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_confluent)
    [problem] = _config(sink="confluent").problems()
    assert "pip install 'pg-kafka-outbox[confluent]'" in problem.text
    assert problem.fields == {"sink"}
    assert _config(sink="kafka-python").problems() == []


@pytest.mark.parametrize(
    ("sink", "kind"), [("kafka-python", "KafkaSink"), ("confluent", "ConfluentSink")]
)
def test_the_publisher_is_built_with_the_sink_the_config_names(sink: str, kind: str) -> None:
    """build_publisher wires the chosen producer (nothing is contacted until it runs)."""
    publisher = build_publisher(_config(sink=sink))
    assert type(publisher.sink).__name__ == kind


def test_a_local_queue_full_past_max_block_is_an_outage_not_the_records_fault() -> None:
    """confluent-kafka raises a Python BufferError for a full local queue: it is taken as
    librdkafka's _QUEUE_FULL, an outage that counts no failure, as kafka-python's timeout."""
    from publisher.confluent_sink import ConfluentSink  # noqa: PLC0415 - the confluent extra
    from publisher.outcomes import counts_as_failure, is_outage  # noqa: PLC0415
    from publisher.sink import KafkaSinkConfig  # noqa: PLC0415

    sink = ConfluentSink(KafkaSinkConfig("127.0.0.1:1"))
    error = sink._refusal(BufferError("Local: Queue full"))

    assert isinstance(error, LibrdkafkaError)
    assert error.name == "_QUEUE_FULL"
    assert is_outage(error)
    outcome = classify(error, handed_to_producer=False)
    assert not counts_as_failure(outcome, error)
