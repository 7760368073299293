"""The composition root: the one place that builds a publisher from its config.

Everything ``outbox-publisher`` runs is wired here: the stores (the loop's,
the heartbeat's, the claim-ahead worker's), the sink the config names, the
reconciler and its scanner, the waker, the status reader, the Kafka check,
retention and the HTTP endpoints. ``publisher.cli`` only turns flags into a
``PublisherConfig``, configures the process (logging, signals) and maps the
outcome to an exit code; tests and benchmarks build their publishers here
too, so that they run what the command runs.

The loop itself builds the parts that need its own state (the heartbeat
reads its progress and the batches in hand; the Kafka probe writes its
health), from the stores and the check it is given here.
"""

from __future__ import annotations

import logging
import os
import uuid

import outbox
from outbox.inspection import OVERDUE_AFTER
from outbox.retention import parse_duration
from publisher.config import KAFKA_DEFAULT_HIDDEN_SECONDS, PublisherConfig, redact
from publisher.endpoints import EndpointServer
from publisher.faults import Faults
from publisher.fencing import KafkaFencer
from publisher.health import KafkaClusterCheck
from publisher.holds import HoldRunner
from publisher.kafka_security import KafkaSecurity, check_login
from publisher.loop import Publisher, Totals
from publisher.metrics import StatusReader
from publisher.reconciler import Reconciler
from publisher.retention import RetentionRunner
from publisher.scanner import KafkaLogScanner
from publisher.sink import KafkaSink, KafkaSinkConfig, Sink
from publisher.store import IDLE_TRANSACTION_LIMIT, PublisherStore
from publisher.waker import Waker

log = logging.getLogger("publisher")


def build_publisher(
    config: PublisherConfig,
    publisher_id: uuid.UUID | None = None,
    *,
    faults: Faults | None = None,
    security: KafkaSecurity | None = None,
) -> Publisher:
    """Wire a publisher to PostgreSQL and Kafka from its config (nothing is contacted yet).

    ``security``: the Kafka security settings already read from ``config``
    (``build_app`` reads them once for the clients and its login check).
    """
    publisher_id = publisher_id or uuid.uuid4()
    # Every Kafka client below gets the same security settings (password files read once).
    security = security or KafkaSecurity.from_config(config)
    store = PublisherStore(config.database_url, publisher_id)
    reconciler = None
    if config.reconcile_interval > 0:
        reconciler = Reconciler(
            store,
            KafkaLogScanner(config.kafka_bootstrap, security=security),
            f"reconciler {publisher_id}",
            absence_grace=config.absence_grace,
            held_back_note_after=config.held_back_note_seconds,
            fencer=KafkaFencer(
                config.kafka_bootstrap, timeout_ms=config.max_block_ms, security=security
            ),
        )
    publisher = Publisher(
        config,
        store,
        build_sink(config, publisher_id, security),
        Waker(
            config.database_url,
            # An announcement lasts about a poll interval (see Waker.wait).
            idle_transaction_limit=max(IDLE_TRANSACTION_LIMIT, 3 * config.poll_interval),
        ),
        reconciler=reconciler,
        heartbeat_store=PublisherStore(config.database_url, publisher_id),
        claim_ahead_store=PublisherStore(config.database_url, publisher_id),
        faults=faults,
        version=outbox.__version__,
        pid=os.getpid(),
        status_reader=StatusReader(config.database_url),
        kafka_check=KafkaClusterCheck(
            config.kafka_bootstrap,
            timeout_ms=min(config.request_timeout_ms, 5_000),
            security=security,
        ),
    )
    publisher.holds = HoldRunner(
        PublisherStore(config.database_url, publisher_id),
        interval=config.recovery_interval,
        on_pass=publisher.metrics.count_holds,
    )
    if config.purge_delivered_after:
        publisher.retention = RetentionRunner(
            config.database_url,
            interval=config.purge_interval,
            delivered_older_than=parse_duration(config.purge_delivered_after),
            evidence_older_than=(
                parse_duration(config.purge_evidence_after) if config.purge_evidence_after else None
            ),
            on_report=publisher.metrics.count_purge,
        )
    return publisher


def start_warnings(config: PublisherConfig) -> list[str]:
    """What a publisher with ``config`` says at start about settings that leave work to
    someone else (valid, but easy to set by mistake)."""
    warnings = []
    if config.reconcile_interval <= 0:
        warnings.append(
            "reconciliation is off (--reconcile-interval 0): uncertain messages wait for "
            "another publisher or `outbox-publisher reconcile`"
            + (
                ", and the producer sessions of those sent in transactions stay unfenced"
                if config.delivery == "transactional"
                else ""
            )
        )
    if (
        config.delivery == "idempotent"
        and config.transaction_records != PublisherConfig.transaction_records
    ):
        warnings.append(
            f"--transaction-records ({config.transaction_records}) is ignored: it applies to "
            "transactional delivery (--delivery transactional), and this publisher delivers "
            "idempotently"
        )
    if (
        config.delivery == "idempotent"
        and config.reconcile_interval > 0
        and config.absence_grace < KAFKA_DEFAULT_HIDDEN_SECONDS
    ):
        warnings.append(
            f"the absence grace ({config.absence_grace:g}s, --absence-grace) is shorter than a "
            "follower that stopped copying keeps a written record unreadable with Kafka's "
            f"defaults ({KAFKA_DEFAULT_HIDDEN_SECONDS:g}s, 1.5 times replica.lag.time.max.ms): "
            "such a record could be proven absent and sent twice"
        )
    overdue = OVERDUE_AFTER.total_seconds()
    if (
        config.delivery == "idempotent"
        and config.reconcile_interval > 0
        and config.absence_grace + config.reconcile_interval >= overdue
    ):
        warnings.append(
            f"the absence grace and the reconcile interval ({config.absence_grace:g}s and "
            f"{config.reconcile_interval:g}s) reach the {overdue:g}s past its write deadline "
            "after which outbox.status calls an undecided uncertain message overdue: a message "
            "whose record is absent is called overdue (unhealthy, an alert) while it only "
            "waits out the grace"
        )
    return warnings


def build_sink(
    config: PublisherConfig, publisher_id: uuid.UUID, security: KafkaSecurity | None = None
) -> Sink:
    """The producer the config names (``--sink``), with the publisher's settings."""
    sink_config = KafkaSinkConfig(
        bootstrap_servers=config.kafka_bootstrap,
        client_id=f"outbox-publisher-{publisher_id}",
        linger_ms=config.linger_ms,
        delivery_timeout_ms=config.delivery_timeout_ms,
        request_timeout_ms=config.request_timeout_ms,
        max_block_ms=config.max_block_ms,
        allow_auto_create_topics=config.auto_create_topics,
        transactional_id_prefix=(
            f"outbox-{publisher_id}" if config.delivery == "transactional" else None
        ),
        security=security or KafkaSecurity.from_config(config),
    )
    if config.sink == "confluent":
        # Only with the confluent extra installed (the config checked it).
        from publisher.confluent_sink import ConfluentSink  # noqa: PLC0415

        return ConfluentSink(sink_config)
    return KafkaSink(sink_config)


class PublisherApp:
    """A publisher and the HTTP endpoints that expose it: what ``outbox-publisher`` runs."""

    def __init__(
        self,
        publisher: Publisher,
        endpoints: EndpointServer | None,
        security: KafkaSecurity | None = None,
    ) -> None:
        self.publisher = publisher
        #: The settings the publisher's Kafka clients were built with: the login check
        #: checks those, not a password file read again later.
        self.security = security or KafkaSecurity.from_config(publisher.config)
        #: ``/metrics``, ``/healthz`` and ``/readyz``; ``None`` with ``--http-port 0``.
        self.endpoints = endpoints

    def request_stop(self) -> None:
        """Stop claiming; the batch in hand is finished and settled first (signal-safe)."""
        self.publisher.request_stop()

    def run(self) -> Totals:
        """Serve the endpoints and deliver until stopped; the endpoints stop with the loop.

        Raises ``KafkaAuthenticationFailed`` at once when the brokers refuse
        the publisher's credentials (``check_login``): that never heals.
        """
        config = self.publisher.config
        security = self.security
        log.info(
            "publisher %s: database %s, Kafka %s (%s)",
            self.publisher.publisher_id,
            redact(config.database_url),
            config.kafka_bootstrap,
            security.describe(),
        )
        for warning in start_warnings(config):
            log.warning("%s", warning)
        if self.endpoints is not None:
            self.endpoints.start()
        try:
            check_login(config.kafka_bootstrap, security, timeout_ms=config.max_block_ms)
            return self.publisher.run()
        finally:
            if self.endpoints is not None:
                self.endpoints.stop()


def build_app(
    config: PublisherConfig,
    publisher_id: uuid.UUID | None = None,
    *,
    faults: Faults | None = None,
) -> PublisherApp:
    """The publisher of ``build_publisher`` with its endpoints on ``--http-host:--http-port``.

    Raises ``OSError`` when that address cannot be listened on: the socket is
    bound here, so that the process fails at start rather than in a thread.
    """
    security = KafkaSecurity.from_config(config)
    publisher = build_publisher(config, publisher_id, faults=faults, security=security)
    endpoints = None
    if config.http_port:
        endpoints = EndpointServer(
            config.http_host, config.http_port, publisher.metrics.registry, publisher.health
        )
    return PublisherApp(publisher, endpoints, security)
