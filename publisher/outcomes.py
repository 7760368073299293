"""Classifying a send's outcome, and what each outcome does to the message.

The question for every record is not "did it fail?" but "could it have been
written?". Only a failure that proves the record never reached the broker
may be retried; anything that leaves the question open is ``UNCERTAIN`` and
is decided later from evidence, never by resending blindly.
"""

from __future__ import annotations

import random
from enum import Enum, StrEnum

from kafka import errors as kafka_errors

from outbox.states import State


class SendOutcome(Enum):
    """What is known about one record after the producer reported on it."""

    #: The broker acknowledged it at a partition and offset.
    CONFIRMED = "confirmed"
    #: It provably never reached the broker; sending it again is safe.
    NOT_WRITTEN = "not_written"
    #: It may or may not be in the log.
    UNCERTAIN = "uncertain"
    #: The broker (or the producer, before sending) refused its content; resending cannot help.
    NON_RETRIABLE = "non_retriable"


#: The message state each outcome moves a message to.
NEXT_STATE: dict[SendOutcome, State] = {
    SendOutcome.CONFIRMED: State.DELIVERED,
    SendOutcome.NOT_WRITTEN: State.PENDING,
    SendOutcome.UNCERTAIN: State.UNCERTAIN,
    SendOutcome.NON_RETRIABLE: State.QUARANTINED,
}


class AttemptOutcome(StrEnum):
    """How one attempt to deliver a message ended (``outbox.attempts.outcome``)."""

    #: The broker confirmed it. No attempt row is written: its batch is the record.
    DELIVERED = "delivered"
    #: Not written (a retry follows), or refused for its content (quarantined).
    FAILED = "failed"
    #: It may be in Kafka: the reconciler decides.
    UNCERTAIN = "uncertain"
    #: Given back unsent (held back, the hand-over window closed, the publisher
    #: stopping, its transaction aborted): no failure is counted.
    ABANDONED = "abandoned"
    #: Ended by recovery after its batch's lease expired (written by the
    #: ``recover_expired_leases`` query, since 0016): no failure is counted,
    #: but a second in a row marks the message suspect.
    RECOVERED = "recovered"


#: The attempt outcome recorded for each send outcome.
ATTEMPT_OUTCOME: dict[SendOutcome, AttemptOutcome] = {
    SendOutcome.CONFIRMED: AttemptOutcome.DELIVERED,
    SendOutcome.NOT_WRITTEN: AttemptOutcome.FAILED,
    SendOutcome.UNCERTAIN: AttemptOutcome.UNCERTAIN,
    SendOutcome.NON_RETRIABLE: AttemptOutcome.FAILED,
}


class TransactionEnd(Enum):
    """How a batch's Kafka transaction ended (transactional delivery)."""

    #: Committed: every record it carried is visible to read_committed consumers.
    COMMITTED = "committed"
    #: Aborted: none of its records is visible to read_committed consumers.
    ABORTED = "aborted"
    #: The answer was lost (broker away, timed out): the reconciler fences the
    #: session's transactional.id and reads the log to decide.
    UNKNOWN = "unknown"
    #: Another producer took the transactional.id over: this session is a
    #: zombie, and its word on the batch must not be recorded.
    FENCED = "fenced"


#: What a broker answers a producer session whose transactional.id was taken over.
FENCING_ERRORS: tuple[type[BaseException], ...] = (
    kafka_errors.ProducerFencedError,
    kafka_errors.InvalidProducerEpochError,
)


def after_transaction(outcome: SendOutcome, end: TransactionEnd) -> SendOutcome:
    """A record's outcome once the Kafka transaction that carried it ended.

    Committed: as the producer reported it (a batch commits only when every
    record was confirmed). Aborted: no record of it is visible to a
    read_committed consumer, so what was confirmed or left open was not
    written (a content refusal stays one). Unknown: what was confirmed may
    or may not be committed, so it is uncertain, for the reconciler to decide
    after it fences the session. Fenced: the caller records nothing.
    """
    if end is TransactionEnd.ABORTED and outcome in (SendOutcome.CONFIRMED, SendOutcome.UNCERTAIN):
        return SendOutcome.NOT_WRITTEN
    if end is TransactionEnd.UNKNOWN and outcome is SendOutcome.CONFIRMED:
        return SendOutcome.UNCERTAIN
    return outcome


def may_land_after_abort(error: BaseException | None, *, handed_to_producer: bool) -> bool:
    """Whether a produce request of a record left unanswered in an aborted transaction may
    still reach its partition leader after the abort.

    The abort hides what the partition held before it; a request still on its
    way (timed out at the producer, on a connection that dropped) is appended
    when it arrives. Should this session's next transaction have added that
    partition by then, the broker takes it as that transaction's, and commits
    it beside the record sent again: a second copy for read_committed
    consumers. A new session is a new producer id, and the broker refuses a
    request of one that has no transaction open (transaction verification,
    Kafka 3.6 and later by default). Only an uncertain record's request can
    be on its way: one confirmed was written before the abort, one refused
    or never handed over sent nothing that could still land.
    """
    return classify(error, handed_to_producer=handed_to_producer) is SendOutcome.UNCERTAIN


class TopicMissing(kafka_errors.KafkaError):  # type: ignore[misc]  # kafka-python is untyped
    """The topic does not exist and the publisher may not (or the broker will not) create it."""


class LibrdkafkaError(kafka_errors.KafkaError):  # type: ignore[misc]  # kafka-python is untyped
    """One of librdkafka's own (local, negative-coded) errors, named as librdkafka names it."""

    def __init__(self, text: str, name: str = "") -> None:
        super().__init__(text)
        #: librdkafka's name of the error (``_TRANSPORT``, ``_MSG_TIMED_OUT``...).
        self.name = name


# Errors that say the record cannot be applied as it is. Returned for a record
# that the broker rejected as a whole, they also prove it was not appended.
# (kafka-python splits a batch the broker finds too large and retries, so a
# size error ends up reported for the one record that is too large.)
_CONTENT_ERRORS: tuple[type[BaseException], ...] = (
    TopicMissing,
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


# Errors that say the broker (or the cluster) could not take the record now,
# whatever the record is: no broker to talk to, a connection that failed, no
# answer in time (kafka-python's KafkaTimeoutError on a metadata wait or a
# full buffer, a request that timed out), no leader for the partition, too few
# replicas in sync, metadata not known yet. They say nothing about the content.
_OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    kafka_errors.KafkaConnectionError,
    kafka_errors.NodeNotReadyError,
    kafka_errors.KafkaTimeoutError,
    kafka_errors.RequestTimedOutError,
    kafka_errors.NotLeaderForPartitionError,
    kafka_errors.LeaderNotAvailableError,
    kafka_errors.BrokerNotAvailableError,
    kafka_errors.NotEnoughReplicasError,
    kafka_errors.UnknownTopicOrPartitionError,
    kafka_errors.StaleMetadata,
    kafka_errors.NotControllerError,
    kafka_errors.CoordinatorNotAvailableError,
    ConnectionError,
    TimeoutError,
)

# Errors that say the broker refuses this publisher itself, whatever the record:
# no right to its TransactionalIds (transactional delivery) or to the cluster
# (idempotent writes, on brokers that still ask for it), or its login was
# refused. Every record would meet them, so they say nothing about the content.
_PUBLISHER_REFUSALS: tuple[type[BaseException], ...] = (
    kafka_errors.TransactionalIdAuthorizationFailedError,
    kafka_errors.ClusterAuthorizationFailedError,
    kafka_errors.SaslAuthenticationFailedError,
    kafka_errors.UnsupportedSaslMechanismError,
)

#: librdkafka's own errors that say the cluster could not be reached in time.
_LIBRDKAFKA_OUTAGES = frozenset(
    {
        "_TRANSPORT",
        "_ALL_BROKERS_DOWN",
        "_TIMED_OUT",
        "_MSG_TIMED_OUT",
        "_QUEUE_FULL",
        "_RESOLVE",
        "_WAIT_COORD",
        "_LEADER_NOT_AVAILABLE",
        "_NOT_LEADER_FOR_PARTITION",
        "_AUTHENTICATION",  # the login was refused: the publisher's, not the record's
    }
)


#: What to do about a refusal of the publisher itself, recorded with it.
_REFUSAL_ACTIONS: dict[type[BaseException], str] = {
    kafka_errors.TransactionalIdAuthorizationFailedError: (
        "grant the publisher's Kafka principal Write and Describe on TransactionalIds "
        "prefixed outbox- (docs/security.md); it counts toward --max-attempts once at most"
    ),
    kafka_errors.ClusterAuthorizationFailedError: (
        "grant the publisher's Kafka principal IdempotentWrite on the cluster "
        "(docs/security.md); it counts toward --max-attempts once at most"
    ),
    kafka_errors.MessageSizeTooLargeError: (
        "the record is larger than the topic's max.message.bytes (or the broker's "
        "message.max.bytes) allows: raise that limit and retry it, or discard it "
        "(docs/operations.md)"
    ),
}

#: What to do about a record the producer itself refused as too large, before handing
#: it over: no broker setting lets it through.
_OVER_PRODUCER_LIMIT = (
    "the record is larger than the publisher's producer accepts (its max_request_size, "
    "1 MiB by default): it cannot be sent as it is; discard it"
)


def error_text(error: BaseException, *, handed_to_producer: bool = True) -> str:
    """How a send's error is recorded (``last_error``, ``outbox.attempts.error``): its
    class, then what it says ("MessageSizeTooLargeError: ..."); for a missing ACL, what
    to grant.

    kafka-python's errors name their class themselves ("KafkaTimeoutError: Expiring
    1 record(s)", or with the broker's code first, "[Error 10]
    MessageSizeTooLargeError: ..."): the class is named once, first.
    """
    name = type(error).__name__
    said = str(error).strip()
    if said.startswith("[Error "):
        _, _, rest = said.partition("] ")
        if rest == name or rest.startswith(f"{name}: "):
            said = rest
    said = "" if said == name else said.removeprefix(f"{name}: ")
    said = "" if said == "None" else said  # kafka-python's error raised with None
    action = next((a for kind, a in _REFUSAL_ACTIONS.items() if isinstance(error, kind)), None)
    if isinstance(error, kafka_errors.MessageSizeTooLargeError) and not handed_to_producer:
        action = _OVER_PRODUCER_LIMIT
    said = "; ".join(part for part in (said, action) if part)
    return f"{name}: {said}" if said else name


def is_outage(error: BaseException | None) -> bool:
    """Whether ``error`` says the broker would take no record from this publisher now
    (unreachable, unavailable, or refusing the publisher itself), not that the record is bad.

    A record given back for such a reason goes back to pending without a
    failure counted: a broker outage, however long, never exhausts
    ``--max-attempts`` (which counts only what may be the record's fault),
    nor does a missing TransactionalId or cluster ACL (each record's
    ``last_error`` names it until it is granted). Besides the errors listed
    above, any error kafka-python marks as retriable (the broker may take the
    same record later) counts, except the content errors; an unknown error
    does not (it may be the record's).
    """
    if error is None or isinstance(error, (*_CONTENT_ERRORS, TypeError, ValueError)):
        return False
    if isinstance(error, LibrdkafkaError):
        return error.name in _LIBRDKAFKA_OUTAGES
    if isinstance(error, (*_OUTAGE_ERRORS, *_PUBLISHER_REFUSALS)):
        return True
    return isinstance(error, kafka_errors.KafkaError) and bool(getattr(error, "retriable", False))


def answered_for_topic(error: BaseException | None) -> bool:
    """Whether ``error`` is an answer only a broker gives, about a topic: it does not
    exist, or this publisher may not use it. Kafka was reached (``/readyz``)."""
    return isinstance(error, (TopicMissing, kafka_errors.TopicAuthorizationFailedError))


#: Errors that say no broker could be reached at all, whatever the topic.
_UNREACHABLE_ERRORS: tuple[type[BaseException], ...] = (
    kafka_errors.KafkaTimeoutError,
    kafka_errors.KafkaConnectionError,
    kafka_errors.NodeNotReadyError,
    ConnectionError,
    TimeoutError,
)
_LIBRDKAFKA_UNREACHABLE = frozenset({"_TRANSPORT", "_ALL_BROKERS_DOWN", "_TIMED_OUT", "_RESOLVE"})


def is_unreachable(error: BaseException | None) -> bool:
    """Whether ``error`` says the cluster could not be reached at all (not one topic's
    trouble): another topic's lookup would wait out the same timeouts."""
    if isinstance(error, LibrdkafkaError):
        return error.name in _LIBRDKAFKA_UNREACHABLE
    return isinstance(error, _UNREACHABLE_ERRORS)


def refuses_publisher(error: BaseException | None) -> bool:
    """Whether ``error`` is the broker refusing this publisher itself (its TransactionalIds,
    the cluster, its login), whatever the record: every other lookup would meet it too.
    An error raised from such a refusal (a producer that could not be opened) is one."""
    if error is not None and error.__cause__ is not None and refuses_publisher(error.__cause__):
        return True
    if isinstance(error, LibrdkafkaError):
        return error.name == "_AUTHENTICATION"
    return isinstance(error, _PUBLISHER_REFUSALS)


def counts_as_failure(outcome: SendOutcome, error: BaseException | None) -> bool:
    """Whether an outcome counts toward ``--max-attempts`` (``messages.failures``).

    Only a record not written for a reason that may be its own counts: an
    outage (``is_outage``) does not, nor does a confirmed or uncertain one
    (a refusal shared by several records is counted by the loop, which knows).
    """
    return outcome is SendOutcome.NOT_WRITTEN and not is_outage(error)


def classify(error: BaseException | None, *, handed_to_producer: bool) -> SendOutcome:
    """Classify one record's outcome.

    ``error`` is ``None`` when the broker confirmed the record.
    ``handed_to_producer`` says whether ``send()`` accepted the record into the
    producer's buffer: if it raised (or the record never got that far), the
    record cannot have been written, whatever the error says.
    """
    if error is None:
        return SendOutcome.CONFIRMED
    if isinstance(error, (*_CONTENT_ERRORS, TypeError, ValueError)):
        # A deterministic refusal: before sending (record larger than
        # max_request_size, a value the producer cannot encode) or by the broker.
        return SendOutcome.NON_RETRIABLE
    if not handed_to_producer:
        # Metadata timeout, buffer full (max_block_ms), closed producer: the
        # record never left this process.
        return SendOutcome.NOT_WRITTEN
    # Once handed over, everything else leaves the question open: expired
    # batches (kafka-python cannot tell "expired before send" from "expired in
    # flight"), request timeouts, lost connections, NotEnoughReplicasAfterAppend,
    # sequence and producer-id errors, a forced close, anything unexpected.
    return SendOutcome.UNCERTAIN


def from_librdkafka(code: int, name: str, reason: str) -> BaseException:
    """The exception ``classify`` knows a librdkafka (confluent-kafka) error by.

    librdkafka reports the broker's errors under Kafka's protocol codes
    (positive): each becomes kafka-python's exception for that code, so the
    one table above classifies both producers alike (``MSG_SIZE_TOO_LARGE``
    is ``MessageSizeTooLargeError``, ``TOPIC_AUTHORIZATION_FAILED`` is
    ``TopicAuthorizationFailedError``, ``UNKNOWN_TOPIC_OR_PART`` stays
    retriable, hence uncertain, as in kafka-python).

    Its own errors (negative codes) become ``LibrdkafkaError``: refused by
    ``produce()`` they are not written, reported for a record handed over
    they are uncertain, every one of them. A timed-out message
    (``_MSG_TIMED_OUT``) may have been sent and retried, a lost connection
    (``_TRANSPORT``) may have lost only the answer, a record purged in flight
    (``_PURGE_INFLIGHT``) may still be appended, and even one purged from the
    local queue (``_PURGE_QUEUE``) or failed there for a topic or partition
    that vanished (``_UNKNOWN_TOPIC``, ``_UNKNOWN_PARTITION``) may be a retry
    that librdkafka put back in that queue after an attempt that was written.
    Only librdkafka's per-message persistence status tells these apart, and
    confluent-kafka's Python API does not expose it.
    """
    text = f"{reason} (librdkafka {name})"
    if code > 0:
        error: BaseException = kafka_errors.for_code(code)(text)
        return error
    return LibrdkafkaError(text, name)


def retry_delay(
    attempt: int,
    *,
    base_seconds: float = 0.5,
    cap_seconds: float = 60.0,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before retrying a message that failed ``attempt`` times.

    Exponential backoff with full jitter: uniform in ``[0, min(cap, base * 2**(attempt-1))]``,
    so that many publishers retrying at once spread out instead of colliding.
    """
    # The exponent is clamped so that a message retried thousands of times
    # cannot overflow a float; by then the cap applies anyway.
    ceiling = min(cap_seconds, base_seconds * 2.0 ** min(max(attempt - 1, 0), 64))
    return (rng or random).uniform(0, ceiling)
