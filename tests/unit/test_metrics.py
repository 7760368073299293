"""The publisher's metrics (publisher/metrics.py and what publisher/loop.py counts)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import psycopg
from kafka import errors as kafka_errors
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from outbox.states import OPEN_STATES
from publisher.metrics import PublisherMetrics, StatusCollector, StatusRow
from publisher.reconciler import ReconcileReport
from publisher.sink import SendReport
from tests.unit.test_loop import CONFIG, FakeSink, FakeStore, _batch, _message, _publisher, _setup


@dataclass(frozen=True)
class Line:
    """A status line as outbox.status.read_status returns it (the fields the metrics use)."""

    topic: str | None
    state: str
    messages: int
    oldest_age_seconds: float | None = None
    escalated: int = 0
    overdue: int = 0
    leases_expired: int = 0


class FakeReader:
    """Returns prepared lines, or raises; counts the reads."""

    def __init__(self, lines: Sequence[StatusRow] = (), error: Exception | None = None) -> None:
        self.lines = lines
        self.error = error
        self.reads = 0

    def __call__(self) -> Sequence[StatusRow]:
        self.reads += 1
        if self.error is not None:
            raise self.error
        return self.lines


class FakeClock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def _scrape(metrics: PublisherMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape in the text format, parsed back, by name and labels."""
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(metrics: PublisherMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


LINES = [
    Line(None, "pending", 5, 30.0),  # all-topics lines, if a reader gives them, are not exported
    Line("orders", "pending", 3, 30.0),
    Line("orders", "quarantined", 1),
    Line("payments", "pending", 2, 4.5),
    Line("payments", "delivered", 2),  # finished states are not gauges (deliveries are counted)
]


def test_status_gauges_come_from_the_reader_per_topic_and_state() -> None:
    """Each topic gets a count for every open state (0 where none) and its oldest pending age."""
    metrics = PublisherMetrics()
    metrics.watch_status(FakeReader(LINES))
    samples = _scrape(metrics)
    assert samples[("outbox_database_up", ())] == 1
    counts = {
        labels: value for (name, labels), value in samples.items() if name == "outbox_messages"
    }
    assert counts[(("state", "pending"), ("topic", "orders"))] == 3
    assert (("state", "delivered"), ("topic", "payments")) not in counts
    assert counts[(("state", "quarantined"), ("topic", "orders"))] == 1
    assert counts[(("state", "uncertain"), ("topic", "orders"))] == 0
    assert counts[(("state", "pending"), ("topic", "payments"))] == 2
    assert counts[(("state", "in_flight"), ("topic", "payments"))] == 0
    assert len(counts) == 2 * len(OPEN_STATES)
    assert samples[("outbox_oldest_pending_age_seconds", (("topic", "orders"),))] == 30.0
    assert samples[("outbox_oldest_pending_age_seconds", (("topic", "payments"),))] == 4.5


def test_stuck_messages_are_a_gauge_by_topic_and_reason_zero_where_none() -> None:
    """Escalated and overdue uncertain messages and expired leases: one series per reason
    for each topic with open messages, so an alert on any of them fires at once."""
    metrics = PublisherMetrics()
    metrics.watch_status(
        FakeReader(
            [
                Line("orders", "uncertain", 4, escalated=1, overdue=2),
                Line("orders", "in_flight", 3, leases_expired=3),
                Line("payments", "pending", 2, 4.5),
                Line(None, "uncertain", 4, escalated=1, overdue=2),  # not exported
            ]
        )
    )
    stuck = {
        labels: value
        for (name, labels), value in _scrape(metrics).items()
        if name == "outbox_messages_stuck"
    }
    assert stuck == {
        (("reason", "escalated"), ("topic", "orders")): 1,
        (("reason", "overdue"), ("topic", "orders")): 2,
        (("reason", "lease_expired"), ("topic", "orders")): 3,
        (("reason", "escalated"), ("topic", "payments")): 0,
        (("reason", "overdue"), ("topic", "payments")): 0,
        (("reason", "lease_expired"), ("topic", "payments")): 0,
    }


def test_a_failing_database_does_not_break_the_scrape() -> None:
    """When the reader raises, the scrape still answers: outbox_database_up 0, no state gauges."""
    metrics = PublisherMetrics()
    metrics.watch_status(FakeReader(error=psycopg.OperationalError("connection refused")))
    metrics.deliveries.labels("orders").inc()
    samples = _scrape(metrics)
    assert samples[("outbox_database_up", ())] == 0
    assert not any(name == "outbox_messages" for name, _ in samples)
    assert samples[("outbox_deliveries_total", (("topic", "orders"),))] == 1


def test_status_reads_are_cached_for_a_few_seconds_failures_too() -> None:
    """Scrapes within cache_seconds share one read, a failed one included; later ones read again."""
    clock = FakeClock()
    reader = FakeReader(error=psycopg.OperationalError("down"))
    collector = StatusCollector(reader, cache_seconds=5, clock=clock)
    assert collector.rows() is None
    clock.now += 4.9
    assert collector.rows() is None
    assert reader.reads == 1
    clock.now += 0.1
    reader.error = None
    reader.lines = LINES
    assert collector.rows() == LINES
    clock.now += 1
    assert collector.rows() == LINES
    assert reader.reads == 2


def test_two_publishers_in_one_process_have_separate_registries() -> None:
    """Metrics of one publisher never show up in, or collide with, another's."""
    first, second = PublisherMetrics(), PublisherMetrics()
    first.deliveries.labels("orders").inc(3)
    assert _value(first, "outbox_deliveries_total", topic="orders") == 3
    assert _value(second, "outbox_deliveries_total", topic="orders") is None


# --- what the loop counts ---------------------------------------------------------


def test_a_batch_counts_deliveries_failures_by_class_and_latencies() -> None:
    """Confirmed, not written, uncertain and refused records each land in their counter."""
    created = datetime.now(UTC) - timedelta(seconds=2)
    ok, refused, unknown, too_large = (
        replace(_message(attempt=2, key=f"k{i}".encode()), created_at=created) for i in range(4)
    )
    _, _, sink, publisher = _setup(ok, refused, unknown, too_large)
    sink.reports = {
        refused.id: SendReport(None, None, kafka_errors.IllegalStateError("closed"), False),
        unknown.id: SendReport(None, None, kafka_errors.KafkaTimeoutError("Expiring"), True),
        too_large.id: SendReport(None, None, kafka_errors.MessageSizeTooLargeError(), True),
    }

    publisher.run_once()

    m = publisher.metrics
    assert _value(m, "outbox_batches_total") == 1
    assert _value(m, "outbox_deliveries_total", topic="orders") == 1
    for failure_class in ("not_written", "uncertain", "non_retriable"):
        assert _value(m, "outbox_failures_total", topic="orders", **{"class": failure_class}) == 1
    assert _value(m, "outbox_uncertain_found_total", source="send") == 1
    assert _value(m, "outbox_batch_duration_seconds_count") == 1
    # Only the confirmed record has an acknowledgement, about two seconds after its commit.
    assert _value(m, "outbox_commit_to_ack_seconds_count") == 1
    ack = _value(m, "outbox_commit_to_ack_seconds_sum")
    assert ack is not None
    assert 2 <= ack < 60
    assert (_value(m, "outbox_last_delivery_timestamp_seconds") or 0) > 0
    assert publisher.health.kafka.ok is True


def test_a_message_that_ran_out_of_attempts_counts_as_attempts_exhausted() -> None:
    """Not written at max_attempts: quarantined, counted in its own class."""
    message = _message(attempt=5)
    events: list[str] = []
    sink = FakeSink(events)
    publisher = _publisher(
        FakeStore(events, [_batch(message)]), sink, replace(CONFIG, max_attempts=5)
    )
    sink.reports[message.id] = SendReport(None, None, kafka_errors.IllegalStateError("x"), False)

    publisher.run_once()

    m = publisher.metrics
    labels = {"topic": "orders", "class": "attempts_exhausted"}
    assert _value(m, "outbox_failures_total", **labels) == 1
    assert _value(m, "outbox_failures_total", topic="orders", **{"class": "not_written"}) is None


def test_lease_losses_are_counted_before_sending_and_at_settle() -> None:
    """A message recovered before sending began and one settled under a stale fence are losses."""
    lost, stale, kept = _message(), _message(), _message()
    _, store, _, publisher = _setup(lost, stale, kept)
    store.lost_before_sending = {lost.id}
    store.stale_ids = {stale.id}

    publisher.run_once()

    m = publisher.metrics
    assert _value(m, "outbox_lease_losses_total", when="before_send") == 1
    assert _value(m, "outbox_lease_losses_total", when="at_settle") == 1
    assert _value(m, "outbox_deliveries_total", topic="orders") == 1


def test_kafka_that_does_not_answer_is_recorded_as_a_failed_contact() -> None:
    """When every record of a send timed out, the last Kafka contact counts as failed."""
    message = _message()
    _, _, sink, publisher = _setup(message)
    sink.reports[message.id] = SendReport(
        None, None, kafka_errors.KafkaTimeoutError("no answer from the broker in time"), True
    )

    publisher.run_once()

    assert publisher.health.kafka.ok is False
    assert publisher.health.kafka.error_type == "KafkaTimeoutError"


def test_a_refusal_by_the_broker_still_counts_as_a_kafka_contact() -> None:
    """A record the broker refused for its content proves the broker answered."""
    message = _message()
    _, _, sink, publisher = _setup(message)
    sink.reports[message.id] = SendReport(None, None, kafka_errors.MessageSizeTooLargeError(), True)

    publisher.run_once()

    assert publisher.health.kafka.ok is True


def test_reconciliation_decisions_are_counted_by_the_state_they_lead_to() -> None:
    """uncertain_resolved counts delivered, pending and escalated decisions apart."""
    _, _, _, publisher = _setup()
    a, b, c, d = (_message().id for _ in range(4))
    publisher._count_reconciled(ReconcileReport(delivered=[a, b], pending=[c], escalated=[d]))

    m = publisher.metrics
    assert _value(m, "outbox_uncertain_resolved_total", to_state="delivered") == 2
    assert _value(m, "outbox_uncertain_resolved_total", to_state="pending") == 1
    assert _value(m, "outbox_uncertain_resolved_total", to_state="escalated") == 1
    assert publisher.totals.reconciled == 4


def test_every_documented_reason_of_a_lease_loss_is_a_series_from_the_start() -> None:
    """Alerts and rate() see each `when` of outbox_lease_losses_total at 0 before the first
    loss, fenced sessions included."""
    m = PublisherMetrics()
    for when in ("before_send", "at_settle", "fenced"):
        assert _value(m, "outbox_lease_losses_total", when=when) == 0
