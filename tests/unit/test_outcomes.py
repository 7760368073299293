"""Classifying a send's outcome and the retry backoff (publisher/outcomes.py).

The rule under test: only a failure that proves a record never reached the
broker is retried; anything that leaves the question open is UNCERTAIN.
"""

from __future__ import annotations

import inspect
import random

import pytest
from kafka import errors as kafka_errors

from outbox.states import State
from publisher.outcomes import (
    ATTEMPT_OUTCOME,
    NEXT_STATE,
    LibrdkafkaError,
    SendOutcome,
    TopicMissing,
    TransactionEnd,
    after_transaction,
    classify,
    counts_as_failure,
    error_text,
    from_librdkafka,
    is_outage,
    is_unreachable,
    retry_delay,
)

#: Errors that say the content itself is unacceptable (design brief: quarantine with the reason).
CONTENT_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.InvalidTopicError,
    kafka_errors.CorruptRecordError,
    kafka_errors.InvalidRecordError,
    kafka_errors.InvalidTimestampError,
    kafka_errors.UnsupportedForMessageFormatError,
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.PolicyViolationError,
)

#: Every KafkaError class kafka-python defines, KafkaError itself included.
ALL_KAFKA_ERRORS = sorted(
    (
        cls
        for _, cls in inspect.getmembers(kafka_errors, inspect.isclass)
        if issubclass(cls, kafka_errors.KafkaError)
    ),
    key=lambda cls: cls.__name__,
)


def _instance(cls: type[BaseException]) -> BaseException:
    """An instance of ``cls``, also for the few classes whose constructor needs arguments."""
    try:
        return cls()
    except TypeError:
        return cls.__new__(cls)


def test_the_sweep_sees_kafka_pythons_error_classes() -> None:
    """The sweep below covers kafka-python's whole error hierarchy, not a handful of classes."""
    assert len(ALL_KAFKA_ERRORS) > 100
    assert set(CONTENT_ERRORS) <= set(ALL_KAFKA_ERRORS)


@pytest.mark.parametrize("handed_to_producer", [True, False])
def test_no_error_is_confirmed(handed_to_producer: bool) -> None:
    """A record the broker acknowledged (no error) is CONFIRMED."""
    assert classify(None, handed_to_producer=handed_to_producer) is SendOutcome.CONFIRMED


@pytest.mark.parametrize(
    "error",
    [
        kafka_errors.KafkaTimeoutError("Failed to update metadata after 10.0 secs."),
        kafka_errors.NodeNotReadyError(),
        kafka_errors.KafkaConnectionError(),
        kafka_errors.IllegalStateError("producer is closed"),
        kafka_errors.UnknownTopicOrPartitionError(),
        RuntimeError("anything else"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_a_synchronous_refusal_is_not_written(error: BaseException) -> None:
    """A non-content error raised before the record reached the producer is NOT_WRITTEN."""
    assert classify(error, handed_to_producer=False) is SendOutcome.NOT_WRITTEN


@pytest.mark.parametrize("handed_to_producer", [True, False])
@pytest.mark.parametrize(
    "error_type", [*CONTENT_ERRORS, TypeError, ValueError], ids=lambda t: t.__name__
)
def test_content_errors_are_non_retriable_wherever_they_come_from(
    error_type: type[Exception], handed_to_producer: bool
) -> None:
    """A content error (or a TypeError/ValueError) is NON_RETRIABLE, handed over or not."""
    assert (
        classify(error_type(), handed_to_producer=handed_to_producer) is SendOutcome.NON_RETRIABLE
    )


@pytest.mark.parametrize(
    "error",
    [
        kafka_errors.KafkaTimeoutError("Expiring 1 record(s) for orders-0: 30000 ms has passed"),
        kafka_errors.RequestTimedOutError(),
        kafka_errors.KafkaConnectionError(),
        kafka_errors.NotEnoughReplicasAfterAppendError(),
        kafka_errors.NotEnoughReplicasError(),
        kafka_errors.OutOfOrderSequenceNumberError(),
        kafka_errors.UnknownProducerIdError(),
        kafka_errors.InvalidProducerEpochError(),
        kafka_errors.NotLeaderForPartitionError(),
        kafka_errors.UnknownTopicOrPartitionError(),
        kafka_errors.KafkaError("forced close"),
        RuntimeError("unexpected"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_an_unproven_failure_after_handing_over_is_uncertain(error: BaseException) -> None:
    """A non-content failure of a record the producer accepted is UNCERTAIN, never retried."""
    assert classify(error, handed_to_producer=True) is SendOutcome.UNCERTAIN


@pytest.mark.parametrize("error_type", ALL_KAFKA_ERRORS, ids=lambda t: t.__name__)
def test_every_kafka_error_after_handing_over_is_uncertain_unless_content(
    error_type: type[BaseException],
) -> None:
    """Once handed over, any KafkaError is UNCERTAIN, or NON_RETRIABLE only for a content error."""
    outcome = classify(_instance(error_type), handed_to_producer=True)
    assert outcome in {SendOutcome.UNCERTAIN, SendOutcome.NON_RETRIABLE}
    is_content = issubclass(error_type, CONTENT_ERRORS)
    assert (outcome is SendOutcome.NON_RETRIABLE) == is_content


@pytest.mark.parametrize("error_type", ALL_KAFKA_ERRORS, ids=lambda t: t.__name__)
def test_every_kafka_error_before_handing_over_is_not_written_unless_content(
    error_type: type[BaseException],
) -> None:
    """Before handing over, a KafkaError is NOT_WRITTEN, or NON_RETRIABLE if a content error."""
    outcome = classify(_instance(error_type), handed_to_producer=False)
    expected = (
        SendOutcome.NON_RETRIABLE
        if issubclass(error_type, CONTENT_ERRORS)
        else SendOutcome.NOT_WRITTEN
    )
    assert outcome is expected


@pytest.mark.parametrize(
    ("outcome", "state", "attempt_outcome"),
    [
        (SendOutcome.CONFIRMED, State.DELIVERED, "delivered"),
        (SendOutcome.NOT_WRITTEN, State.PENDING, "failed"),
        (SendOutcome.UNCERTAIN, State.UNCERTAIN, "uncertain"),
        (SendOutcome.NON_RETRIABLE, State.QUARANTINED, "failed"),
    ],
)
def test_each_outcome_moves_the_message_to_its_state(
    outcome: SendOutcome, state: State, attempt_outcome: str
) -> None:
    """Each send outcome maps to the designed message state and attempt outcome."""
    assert NEXT_STATE[outcome] is state
    assert ATTEMPT_OUTCOME[outcome] == attempt_outcome


def test_outcome_tables_cover_every_send_outcome() -> None:
    """NEXT_STATE and ATTEMPT_OUTCOME have an entry for every SendOutcome and nothing else."""
    assert set(NEXT_STATE) == set(SendOutcome)
    assert set(ATTEMPT_OUTCOME) == set(SendOutcome)


# --- retry_delay ------------------------------------------------------------------------------


@pytest.mark.parametrize(("base", "cap"), [(0.5, 60.0), (0.1, 5.0), (2.0, 2.0)])
def test_retry_delay_stays_within_the_full_jitter_window(base: float, cap: float) -> None:
    """For attempts 1..40 every delay is within [0, min(cap, base * 2**(attempt-1))]."""
    rng = random.Random(1234)
    for attempt in range(1, 41):
        ceiling = min(cap, base * 2 ** (attempt - 1))
        for _ in range(50):
            delay = retry_delay(attempt, base_seconds=base, cap_seconds=cap, rng=rng)
            assert 0 <= delay <= ceiling, (attempt, delay)


def test_first_retry_delay_is_bounded_by_the_base() -> None:
    """At attempt 1 no delay exceeds the base delay."""
    rng = random.Random(7)
    delays = [retry_delay(1, base_seconds=0.5, cap_seconds=60.0, rng=rng) for _ in range(1_000)]
    assert max(delays) <= 0.5
    assert min(delays) >= 0


@pytest.mark.parametrize("attempt", [8, 20, 64, 500, 1_000])
def test_late_retry_delays_are_bounded_by_the_cap(attempt: int) -> None:
    """At large attempt numbers the delay never exceeds the cap."""
    rng = random.Random(attempt)
    delays = [retry_delay(attempt, base_seconds=0.5, cap_seconds=60.0, rng=rng) for _ in range(200)]
    assert max(delays) <= 60.0
    assert max(delays) > 30.0  # the window is the cap itself, not something smaller


@pytest.mark.parametrize("attempt", [1_100, 10_000])
def test_retry_delay_of_a_very_late_attempt_is_bounded_by_the_cap(attempt: int) -> None:
    """Even after thousands of attempts the delay is a number within [0, cap]."""
    delay = retry_delay(attempt, base_seconds=0.5, cap_seconds=60.0, rng=random.Random(1))
    assert 0 <= delay <= 60.0


def test_retry_delays_are_spread_over_the_window() -> None:
    """1,000 delays at attempt 5 spread over more than half of the window (jitter, not constant)."""
    rng = random.Random(42)
    ceiling = 0.5 * 2**4
    delays = [retry_delay(5, base_seconds=0.5, cap_seconds=60.0, rng=rng) for _ in range(1_000)]
    assert max(delays) - min(delays) > ceiling / 2
    assert len(set(delays)) > 990


@pytest.mark.parametrize("attempt", [0, -3])
def test_retry_delay_before_the_first_attempt_is_bounded_by_the_base(attempt: int) -> None:
    """An attempt number below 1 is treated as the first attempt, not as a smaller window."""
    rng = random.Random(3)
    delays = [retry_delay(attempt, base_seconds=0.5, rng=rng) for _ in range(200)]
    assert max(delays) <= 0.5
    assert max(delays) > 0.25


@pytest.mark.parametrize(
    ("outcome", "end", "expected"),
    [
        (SendOutcome.CONFIRMED, TransactionEnd.COMMITTED, SendOutcome.CONFIRMED),
        (SendOutcome.CONFIRMED, TransactionEnd.ABORTED, SendOutcome.NOT_WRITTEN),
        (SendOutcome.UNCERTAIN, TransactionEnd.ABORTED, SendOutcome.NOT_WRITTEN),
        (SendOutcome.NON_RETRIABLE, TransactionEnd.ABORTED, SendOutcome.NON_RETRIABLE),
        (SendOutcome.NOT_WRITTEN, TransactionEnd.ABORTED, SendOutcome.NOT_WRITTEN),
        (SendOutcome.CONFIRMED, TransactionEnd.UNKNOWN, SendOutcome.UNCERTAIN),
        (SendOutcome.UNCERTAIN, TransactionEnd.UNKNOWN, SendOutcome.UNCERTAIN),
        (SendOutcome.NON_RETRIABLE, TransactionEnd.UNKNOWN, SendOutcome.NON_RETRIABLE),
    ],
)
def test_a_records_outcome_after_its_transaction_ended(
    outcome: SendOutcome, end: TransactionEnd, expected: SendOutcome
) -> None:
    """Aborted: nothing visible was written; unknown: a confirmation proves nothing yet."""
    assert after_transaction(outcome, end) is expected


#: Errors that say the broker could not be reached or could not take a record now.
OUTAGE_ERRORS: tuple[BaseException, ...] = (
    kafka_errors.KafkaTimeoutError("Failed to update metadata after 60.0 secs."),
    kafka_errors.KafkaTimeoutError("Failed to allocate memory within max_block_ms"),
    kafka_errors.KafkaConnectionError("Connection refused"),
    kafka_errors.NodeNotReadyError(),
    kafka_errors.RequestTimedOutError(),
    kafka_errors.NotLeaderForPartitionError(),
    kafka_errors.LeaderNotAvailableError(),
    kafka_errors.BrokerNotAvailableError(),
    kafka_errors.NotEnoughReplicasError(),
    kafka_errors.UnknownTopicOrPartitionError(),
    ConnectionRefusedError(),
    TimeoutError(),
    from_librdkafka(-195, "_TRANSPORT", "Broker transport failure"),
    from_librdkafka(-187, "_ALL_BROKERS_DOWN", "All broker connections are down"),
    from_librdkafka(-192, "_MSG_TIMED_OUT", "Local: Message timed out"),
    from_librdkafka(-184, "_QUEUE_FULL", "Local: Queue full"),
)


@pytest.mark.parametrize("error", OUTAGE_ERRORS, ids=lambda e: f"{type(e).__name__}:{e}"[:60])
def test_an_outage_before_handing_over_is_not_written_and_counts_no_failure(
    error: BaseException,
) -> None:
    """An unreachable or unavailable broker says nothing of the record: no failure is counted."""
    outcome = classify(error, handed_to_producer=False)
    assert outcome is SendOutcome.NOT_WRITTEN
    assert is_outage(error)
    assert counts_as_failure(outcome, error) is False


@pytest.mark.parametrize(
    "error",
    [
        kafka_errors.TransactionalIdAuthorizationFailedError(),
        kafka_errors.ClusterAuthorizationFailedError(),
        kafka_errors.SaslAuthenticationFailedError("wrong password"),
        from_librdkafka(53, "TRANSACTIONAL_ID_AUTHORIZATION_FAILED", "not authorized"),
    ],
    ids=lambda e: f"{type(e).__name__}:{e}"[:60],
)
@pytest.mark.parametrize("handed_to_producer", [False, True])
def test_a_refusal_of_the_publisher_itself_counts_no_failure(
    error: BaseException, handed_to_producer: bool
) -> None:
    """No right to its TransactionalIds or the cluster, a refused login: every record
    would meet it, so none is charged (a batch aborted for it is not written)."""
    outcome = classify(error, handed_to_producer=handed_to_producer)
    if handed_to_producer:
        outcome = after_transaction(outcome, TransactionEnd.ABORTED)
    assert outcome is SendOutcome.NOT_WRITTEN
    assert is_outage(error)
    assert counts_as_failure(outcome, error) is False


@pytest.mark.parametrize(
    "error",
    [
        kafka_errors.IllegalStateError("producer closed"),
        kafka_errors.KafkaError("unexpected"),
        RuntimeError("unexpected"),
        from_librdkafka(-191, "_PARTITION_EOF", "Local: Partition EOF"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_refusal_that_may_be_the_records_own_counts_as_a_failure(error: BaseException) -> None:
    """A not-written outcome that is no outage counts toward --max-attempts."""
    outcome = classify(error, handed_to_producer=False)
    assert outcome is SendOutcome.NOT_WRITTEN
    assert not is_outage(error)
    assert counts_as_failure(outcome, error) is True


@pytest.mark.parametrize("error_class", CONTENT_ERRORS)
def test_a_content_error_is_never_an_outage(error_class: type[Exception]) -> None:
    """A refusal of the content is the record's, even when kafka-python calls it retriable."""
    assert not is_outage(error_class())


def test_only_a_not_written_outcome_can_count_as_a_failure() -> None:
    """Confirmed, uncertain and content-refused outcomes never add to the failures."""
    error = kafka_errors.IllegalStateError("x")
    for outcome in (SendOutcome.CONFIRMED, SendOutcome.UNCERTAIN, SendOutcome.NON_RETRIABLE):
        assert counts_as_failure(outcome, error) is False


def test_a_librdkafka_error_keeps_its_name() -> None:
    """The name classifies librdkafka's own errors: it is kept on the exception."""
    error = from_librdkafka(-195, "_TRANSPORT", "Broker transport failure")
    assert isinstance(error, LibrdkafkaError)
    assert error.name == "_TRANSPORT"


@pytest.mark.parametrize(
    ("error", "unreachable"),
    [
        (kafka_errors.KafkaTimeoutError("Unable to bootstrap from 127.0.0.1:1"), True),
        (kafka_errors.KafkaConnectionError("connection refused"), True),
        (ConnectionRefusedError(), True),
        (LibrdkafkaError("all brokers down", "_ALL_BROKERS_DOWN"), True),
        (LibrdkafkaError("transport", "_TRANSPORT"), True),
        # One topic's trouble, not the cluster's: other topics are still looked up.
        (kafka_errors.UnknownTopicOrPartitionError(), False),
        (kafka_errors.LeaderNotAvailableError(), False),
        (LibrdkafkaError("unknown partition", "_UNKNOWN_PARTITION"), False),
        (TopicMissing("topic 'x' does not exist"), False),
        (None, False),
    ],
)
def test_unreachable_means_no_broker_at_all(error: BaseException | None, unreachable: bool) -> None:
    """Only errors that say no broker answered stand for every topic of a batch."""
    assert is_unreachable(error) is unreachable


@pytest.mark.parametrize(
    ("error", "recorded"),
    [
        (
            kafka_errors.KafkaTimeoutError("Expiring 1 record(s)"),
            "KafkaTimeoutError: Expiring 1 record(s)",
        ),
        (kafka_errors.NotLeaderForPartitionError(), "NotLeaderForPartitionError"),
        (
            kafka_errors.MessageSizeTooLargeError("over max.message.bytes"),
            "MessageSizeTooLargeError: over max.message.bytes; the record is larger than the "
            "topic's max.message.bytes (or the broker's message.max.bytes) allows: raise that "
            "limit and retry it, or discard it (docs/operations.md)",
        ),
        (  # as kafka-python raises it for the broker's refusal: no "None" recorded
            kafka_errors.MessageSizeTooLargeError(None),
            "MessageSizeTooLargeError: the record is larger than the topic's max.message.bytes "
            "(or the broker's message.max.bytes) allows: raise that limit and retry it, or "
            "discard it (docs/operations.md)",
        ),
        (kafka_errors.KafkaTimeoutError(), "KafkaTimeoutError"),
        (TopicMissing("topic 'x' does not exist"), "TopicMissing: topic 'x' does not exist"),
        (
            LibrdkafkaError("Local: Message timed out", "_MSG_TIMED_OUT"),
            "LibrdkafkaError: Local: Message timed out",
        ),
        (
            ValueError("a value the producer cannot encode"),
            "ValueError: a value the producer cannot encode",
        ),
        (TimeoutError(), "TimeoutError"),
        (
            kafka_errors.TransactionalIdAuthorizationFailedError(),
            "TransactionalIdAuthorizationFailedError: grant the publisher's Kafka principal "
            "Write and Describe on TransactionalIds prefixed outbox- (docs/security.md); it "
            "counts toward --max-attempts once at most",
        ),
        (ValueError("ValueErrors galore"), "ValueError: ValueErrors galore"),
        (ValueError(""), "ValueError"),
    ],
)
def test_an_error_is_recorded_with_its_class_named_once(
    error: BaseException, recorded: str
) -> None:
    """kafka-python's errors name their class themselves; others get it in front."""
    assert error_text(error) == recorded


def test_a_record_the_producer_refused_as_too_large_is_not_told_to_raise_the_topic_limit() -> None:
    """Refused before it was handed over, a record is over the publisher's own producer
    limit: no broker setting lets it through, so the action is to discard it."""
    refused = kafka_errors.MessageSizeTooLargeError(
        "The message is 2000000 bytes when serialized which is larger than the maximum "
        "request size you have configured with the max_request_size configuration"
    )
    local = error_text(refused, handed_to_producer=False)
    assert "the publisher's producer accepts (its max_request_size" in local
    assert "max.message.bytes" not in local
    assert "max.message.bytes" in error_text(refused)  # refused by the broker
