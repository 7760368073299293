"""The publisher's Prometheus metrics.

``PublisherMetrics`` keeps every metric on a ``CollectorRegistry`` of its
own, not prometheus_client's global one, so that several publishers in one
process (tests, benchmarks) never collide. Three kinds live there:

* what this publisher did, counted by the loop as it happens (deliveries,
  failures by class, uncertain found and resolved, lease losses, batch and
  commit-to-acknowledgement latencies);
* what the whole outbox holds, read from the database at scrape time by
  ``StatusCollector`` (messages by topic and state, oldest pending age),
  cached for a few seconds so that frequent scrapes do not load PostgreSQL,
  and never failing a scrape: a database that does not answer shows as
  ``outbox_database_up 0``;
* health, read from ``publisher.health.Health`` at scrape time.

docs/publisher.md lists every metric.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import psycopg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from outbox.queries import query
from outbox.retention import PurgeReport
from outbox.states import OPEN_STATES, State
from outbox.status import read_open_status
from publisher.connector import connect
from publisher.health import Health

log = logging.getLogger(__name__)

#: Seconds; from a fast local batch to a broker that took its whole delivery timeout.
BATCH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
#: Seconds; a healthy outbox acknowledges within a second, a backlog or an outage takes longer.
COMMIT_TO_ACK_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 21600,
)  # fmt: skip


class StatusRow(Protocol):
    """A state's count in one topic (``outbox.status.read_open_status``), or overall."""

    @property
    def topic(self) -> str | None:
        """The topic; ``None`` on the lines that sum every topic."""
        ...

    @property
    def state(self) -> str:
        """The message state."""
        ...

    @property
    def messages(self) -> int:
        """How many messages are in that state."""
        ...

    @property
    def oldest_age_seconds(self) -> float | None:
        """Age of the oldest of them, by its commit time; ``None`` if there is none."""
        ...

    @property
    def escalated(self) -> int:
        """Uncertain ones the reconciler could not decide: an operator must."""
        ...

    @property
    def overdue(self) -> int:
        """Uncertain ones undecided 5 minutes after they became decidable."""
        ...

    @property
    def leases_expired(self) -> int:
        """In-flight ones under an expired lease, not recovered yet."""
        ...


#: The reasons of ``outbox_messages_stuck``, and the field of a status row each is.
STUCK_REASONS = {
    "escalated": "escalated",
    "overdue": "overdue",
    "lease_expired": "leases_expired",
}


StatusRead = Callable[[], Sequence[StatusRow]]


class PublisherMetrics:
    """Every metric of one publisher, on ``self.registry``."""

    def __init__(self, health: Health | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.info = Gauge(
            "outbox_publisher_info",
            "Always 1; labels say which publisher process this is.",
            ["publisher_id", "version"],
            registry=r,
        )
        self.batches = Counter(
            "outbox_batches",
            "Batches claimed, sent and settled by this publisher.",
            registry=r,
        )
        self.deliveries = Counter(
            "outbox_deliveries",
            "Messages this publisher delivered (acknowledged by the broker and recorded).",
            ["topic"],
            registry=r,
        )
        self.failures = Counter(
            "outbox_failures",
            "Messages this publisher sent without a recorded delivery, by outcome class: "
            "not_written (pending again, retried after a backoff), broker_unavailable (not "
            "written because the broker was unavailable: pending again, not counted toward "
            "--max-attempts), uncertain (reconciled later), non_retriable (refused by the "
            "broker for its content: quarantined), attempts_exhausted (not written, or its "
            "claims ended its publisher, --max-attempts times: quarantined).",
            ["topic", "class"],
            registry=r,
        )
        self.uncertain_found = Counter(
            "outbox_uncertain_found",
            "Messages that became uncertain here: source=send (no answer from the broker) or "
            "source=recovery (an expired lease after sending began).",
            ["source"],
            registry=r,
        )
        self.uncertain_resolved = Counter(
            "outbox_uncertain_resolved",
            "Uncertain messages this publisher's reconciler decided: to_state=delivered (found "
            "in Kafka), pending (proven absent, sent again) or escalated (evidence gone, an "
            "operator decides).",
            ["to_state"],
            registry=r,
        )
        self.lease_losses = Counter(
            "outbox_lease_losses",
            "Messages this publisher claimed but lost to recovery: when=before_send (recovered "
            "before sending began, not sent), when=at_settle (a stale fence: the outcome "
            "changed nothing) or when=fenced (its Kafka transaction's session was fenced: "
            "nothing of it is recorded).",
            ["when"],
            registry=r,
        )
        self.recovered = Counter(
            "outbox_recovered",
            "In-flight messages with an expired lease that this publisher's recovery moved on.",
            ["to_state"],
            registry=r,
        )
        self.purged = Counter(
            "outbox_purged_rows",
            "Rows deleted by this publisher's retention passes: table=messages (delivered "
            "messages), attempts, decisions or batches (evidence of purged messages).",
            ["table"],
            registry=r,
        )
        self.holds = Counter(
            "outbox_held_messages",
            "Pending messages this publisher's hold pass marked held behind an uncertain or "
            "quarantined message of their key (event=held), or released with nothing stuck "
            "before them any more (event=released).",
            ["event"],
            registry=r,
        )
        self.batch_seconds = Histogram(
            "outbox_batch_duration_seconds",
            "Seconds of one loop turn that claimed something, from the claim to its settle "
            "(with every batch that joined its Kafka transaction).",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.commit_to_ack_seconds = Histogram(
            "outbox_commit_to_ack_seconds",
            "Seconds from a message's created_at (the timestamp of the transaction that "
            "enqueued it, by the database's clock) to the broker's acknowledgement (by this "
            "host's clock, when the producer's flush returned; in a Kafka transaction, when "
            "it committed).",
            buckets=COMMIT_TO_ACK_BUCKETS,
            registry=r,
        )
        self.last_delivery_time = Gauge(
            "outbox_last_delivery_timestamp_seconds",
            "When this publisher last recorded a delivery (epoch seconds; 0: never).",
            registry=r,
        )
        for source in ("send", "recovery"):
            self.uncertain_found.labels(source)
        for to_state in ("delivered", "pending", "escalated"):
            self.uncertain_resolved.labels(to_state)
        for when in ("before_send", "at_settle", "fenced"):
            self.lease_losses.labels(when)
        for state in (State.PENDING, State.UNCERTAIN):
            self.recovered.labels(state.value)
        for event in ("held", "released"):
            self.holds.labels(event)
        self._status: StatusCollector | None = None
        if health is not None:
            r.register(HealthCollector(health))

    def count_purge(self, report: PurgeReport) -> None:
        """Count what one retention pass deleted, by table."""
        for table, rows in (
            ("messages", report.messages),
            ("attempts", report.attempts),
            ("decisions", report.decisions),
            ("batches", report.batches),
        ):
            self.purged.labels(table).inc(rows)

    def count_holds(self, held: int, released: int) -> None:
        """Count what one hold pass marked held and released."""
        self.holds.labels("held").inc(held)
        self.holds.labels("released").inc(released)

    def watch_status(self, read: StatusRead, *, cache_seconds: float = 5.0) -> StatusCollector:
        """Export the outbox's message counts, read by ``read`` at scrape time."""
        self._status = StatusCollector(read, cache_seconds=cache_seconds)
        self.registry.register(self._status)
        return self._status


class StatusCollector(Collector):
    """Messages by topic and state, and the oldest pending age, from the database.

    The answer is cached for ``cache_seconds`` from the end of its read (a
    failure too, so a database that does not answer is not asked by every
    scrape); a scrape during a read is answered from the last one.
    """

    def __init__(
        self,
        read: StatusRead,
        *,
        cache_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._cache_seconds = cache_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._rows: Sequence[StatusRow] | None = None
        self._failing = False

    def describe(self) -> list[Metric]:
        """The metric names, without reading the database."""
        return [
            GaugeMetricFamily("outbox_database_up", ""),
            GaugeMetricFamily("outbox_messages", "", labels=["topic", "state"]),
            GaugeMetricFamily("outbox_oldest_pending_age_seconds", "", labels=["topic"]),
            GaugeMetricFamily("outbox_messages_stuck", "", labels=["topic", "reason"]),
        ]

    def rows(self) -> Sequence[StatusRow] | None:
        """The status lines, fresh or cached; ``None`` if the database did not answer.

        A scrape that comes while another one reads is answered from the last
        read at once instead of waiting (a read can take as long as a silent
        database holds it); only the very first read is waited for.
        """
        if not self._lock.acquire(blocking=self._read_at is None):
            return self._rows
        try:
            if self._read_at is None or self._clock() - self._read_at >= self._cache_seconds:
                try:
                    self._rows = self._read()
                except Exception as exc:  # noqa: BLE001 - a scrape must answer whatever failed
                    if not self._failing:
                        log.warning("metrics: could not read the outbox status: %s", exc)
                    self._rows, self._failing = None, True
                else:
                    self._failing = False
                # From the read's end: one that took longer than the cache lasts is
                # still reused for a while, not redone by every scrape waiting.
                self._read_at = self._clock()
            return self._rows
        finally:
            self._lock.release()

    def collect(self) -> Iterator[Metric]:
        """The status gauges; only ``outbox_database_up 0`` when the database did not answer."""
        rows = self.rows()
        up = GaugeMetricFamily(
            "outbox_database_up",
            "1 if the outbox status could be read from PostgreSQL for this scrape, else 0 "
            "(then the message gauges are absent).",
        )
        up.add_metric([], 0 if rows is None else 1)
        yield up
        if rows is None:
            return
        counts: dict[str, dict[str, int]] = {}
        oldest: dict[str, float] = {}
        stuck: dict[str, dict[str, int]] = {}
        for row in rows:
            if row.topic is None or row.state not in OPEN_STATES:
                continue  # all-topics lines (sum gives them) and finished states
            states = counts.setdefault(row.topic, {s.value: 0 for s in OPEN_STATES})
            states[row.state] = states.get(row.state, 0) + int(row.messages)
            reasons = stuck.setdefault(row.topic, dict.fromkeys(STUCK_REASONS, 0))
            for reason, field in STUCK_REASONS.items():
                reasons[reason] += int(getattr(row, field))
            if row.state == State.PENDING.value and row.oldest_age_seconds is not None:
                oldest[row.topic] = max(oldest.get(row.topic, 0.0), float(row.oldest_age_seconds))
        messages = GaugeMetricFamily(
            "outbox_messages",
            "Messages in the open states (pending, in_flight, uncertain, quarantined) by topic, "
            "for each topic with open messages (read from the database at scrape time, cached "
            "a few seconds; outbox_deliveries_total counts deliveries).",
            labels=["topic", "state"],
        )
        age = GaugeMetricFamily(
            "outbox_oldest_pending_age_seconds",
            "Age of the oldest pending message of the topic, by the database's clock (0: none).",
            labels=["topic"],
        )
        stuck_gauge = GaugeMetricFamily(
            "outbox_messages_stuck",
            "Open messages that will not move on by themselves, by topic and reason: "
            "escalated (uncertain, an operator decides), overdue (uncertain, undecided 5 "
            "minutes after it became decidable), lease_expired (in flight, not recovered yet).",
            labels=["topic", "reason"],
        )
        for topic in sorted(counts):
            for state, n in counts[topic].items():
                messages.add_metric([topic, state], n)
            age.add_metric([topic], oldest.get(topic, 0.0))
            for reason, n in stuck[topic].items():
                stuck_gauge.add_metric([topic, reason], n)
        yield messages
        yield age
        yield stuck_gauge


class HealthCollector(Collector):
    """Readiness and the last contacts with PostgreSQL and Kafka, read at scrape time."""

    def __init__(self, health: Health) -> None:
        self._health = health

    def collect(self) -> Iterator[Metric]:
        """The health gauges."""
        h = self._health
        ready = GaugeMetricFamily(
            "outbox_ready",
            "1 when /readyz answers 200 (registered, dependencies answer, writes to Kafka go "
            "through, loop moving), else 0.",
        )
        ready.add_metric([], 1 if h.readiness().ok else 0)
        kafka = GaugeMetricFamily(
            "outbox_kafka_up",
            "1 if this publisher's last contact with Kafka succeeded (the broker answered; "
            "whether it takes writes: outbox_kafka_writes_failing_seconds), else 0.",
        )
        kafka.add_metric([], 1 if h.kafka.ok else 0)
        # The brokers may answer every question of the probe while no write goes
        # through (leaders out of reach): only this says so.
        writes_failing = GaugeMetricFamily(
            "outbox_kafka_writes_failing_seconds",
            "Seconds since this publisher's contacts with Kafka began failing, counted until "
            "a write goes through, while it has something to write (0: none failing, or "
            "idle); at the lease, /readyz says "
            "kafka_writes_failing and the heartbeat steps back if another publisher reaches "
            "Kafka.",
        )
        writes_failing.add_metric([], h.writes_failing_for() or 0.0)
        last = GaugeMetricFamily(
            "outbox_last_contact_success_timestamp_seconds",
            "When this publisher last talked to the dependency successfully (epoch seconds).",
            labels=["dependency"],
        )
        for contact in (h.database, h.kafka):
            if contact.last_success_time is not None:
                last.add_metric([contact.name], contact.last_success_time)
        turn = GaugeMetricFamily(
            "outbox_loop_last_turn_timestamp_seconds",
            "When the publisher loop last went round or moved a batch on (epoch seconds).",
        )
        if h.last_turn_time is not None:
            turn.add_metric([], h.last_turn_time)
        yield from (ready, kafka, writes_failing, last, turn)


class StatusReader:
    """Reads ``outbox.status`` for the metrics, on a connection of its own.

    The connection is opened on the first scrape and reopened after a
    failure; it is short on patience (connect and statement timeouts of a few
    seconds) so that a slow database cannot hold a scrape for long.

    Its settings are sent as statements once connected, not as the startup
    parameter ``options``: that would replace the URL's own ``options`` (a
    ``search_path``, say), and PgBouncer refuses it.
    """

    def __init__(
        self,
        conninfo: str,
        read: Callable[[psycopg.Connection[Any]], Sequence[StatusRow]] | None = None,
        *,
        timeout_seconds: int = 5,
    ) -> None:
        self._conninfo = conninfo
        self._read = read or read_open_status
        self._timeout = timeout_seconds
        self._conn: psycopg.Connection[Any] | None = None
        self._closed = False

    def __call__(self) -> Sequence[StatusRow]:
        """The status lines now; raises ``psycopg.Error`` if the database does not answer."""
        if self._closed:
            raise psycopg.OperationalError("the publisher has stopped")
        if self._conn is None or self._conn.closed:
            self._conn = connect(
                self._conninfo,
                autocommit=True,
                connect_timeout=self._timeout,
                application_name="outbox-publisher metrics",
            )
        try:
            with self._conn.transaction():
                # Both for the read's transaction only (a pooler in
                # transaction mode may hand the session to another client):
                # a bound on the read, and JIT off, as for outbox status (with
                # a large backlog the counts' estimated cost passes
                # jit_above_cost, and compiling them could take longer than
                # the scrape may).
                self._conn.execute(query("statement_timeout"), {"timeout": f"{self._timeout}s"})
                self._conn.execute(query("jit_off_local"))
                return self._read(self._conn)
        except psycopg.Error:
            self._conn.close()
            raise

    def close(self) -> None:
        """Close the connection for good."""
        self._closed = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None
