"""``outbox-publisher``: settings, logging, the HTTP endpoints, signals.

Settings come from flags, environment variables and an optional TOML file
(``publisher.config``). SIGTERM or SIGINT stops claiming; the batch in hand
is sent, its outcomes are recorded, and the process exits 0. Exit code 2
means the configuration was refused (every problem is printed), 1 that the
publisher failed (including an HTTP address it cannot listen on).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import uuid
from collections.abc import Mapping, Sequence
from types import FrameType

from prometheus_client import disable_created_metrics

import outbox
from outbox.retention import parse_duration
from publisher.config import (
    CONFIG_ENV,
    GROUPS,
    SETTINGS,
    ConfigError,
    PublisherConfig,
    redact,
    resolve,
)
from publisher.endpoints import EndpointServer
from publisher.faults import Faults, FaultSpecError
from publisher.fencing import KafkaFencer
from publisher.health import KafkaClusterCheck
from publisher.logs import configure_logging
from publisher.loop import Publisher
from publisher.metrics import StatusReader
from publisher.reconciler import Reconciler
from publisher.retention import RetentionRunner
from publisher.scanner import KafkaLogScanner
from publisher.sink import KafkaSink, KafkaSinkConfig, Sink
from publisher.store import PublisherStore
from publisher.waker import Waker

log = logging.getLogger("publisher")


def _parser() -> argparse.ArgumentParser:
    """Every setting of ``SETTINGS`` as a flag; a flag not given is left out of the result.

    Values stay text here: ``resolve`` converts them, so that a malformed
    flag is reported with every other problem instead of alone.
    """
    p = argparse.ArgumentParser(
        prog="outbox-publisher",
        description="Deliver committed outbox intents from PostgreSQL to Apache Kafka.",
        epilog="Each setting can also be set with the environment variable in brackets or "
        "in a TOML file (--config), under the flag's name with underscores "
        "(batch_size = 500). A flag beats its variable, which beats the file, which beats "
        "the default. See docs/publisher.md.",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"read settings from this TOML file [{CONFIG_ENV}]",
    )
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for s in SETTINGS:
        group = groups[s.group]
        if s.flag_sets is not None:
            group.add_argument(
                s.flag,
                dest=s.name,
                action="store_const",
                const=s.flag_sets,
                default=argparse.SUPPRESS,
                help=f"{s.help} [{s.env}={str(s.flag_sets).lower()}]",
            )
            continue
        default = s.default
        shown = (
            s.unset
            if default in (None, "")
            else f"{default:g}"
            if isinstance(default, float)
            else default
        )
        group.add_argument(
            s.flag,
            dest=s.name,
            metavar=s.metavar,
            default=argparse.SUPPRESS,
            help=f"{s.help} (default {shown}) [{s.env}]",
        )
    return p


def config_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> PublisherConfig:
    """Parse flags, environment and config file into a validated config."""
    environ = os.environ if environ is None else environ
    given = vars(_parser().parse_args(argv))
    config_file = given.pop("config", None) or environ.get(CONFIG_ENV) or None
    return resolve(given, environ, config_file)


def build_publisher(
    config: PublisherConfig,
    publisher_id: uuid.UUID | None = None,
    *,
    faults: Faults | None = None,
) -> Publisher:
    """Wire a publisher to PostgreSQL and Kafka from its config."""
    publisher_id = publisher_id or uuid.uuid4()
    store = PublisherStore(config.database_url, publisher_id)
    reconciler = None
    if config.reconcile_interval > 0:
        reconciler = Reconciler(
            store,
            KafkaLogScanner(config.kafka_bootstrap),
            f"reconciler {publisher_id}",
            absence_grace=config.absence_grace,
            fencer=KafkaFencer(config.kafka_bootstrap, timeout_ms=config.max_block_ms),
        )
    publisher = Publisher(
        config,
        store,
        _sink(config, publisher_id),
        Waker(config.database_url),
        reconciler=reconciler,
        heartbeat_store=PublisherStore(config.database_url, publisher_id),
        claim_ahead_store=PublisherStore(config.database_url, publisher_id),
        faults=faults,
        version=outbox.__version__,
        pid=os.getpid(),
        status_reader=StatusReader(config.database_url),
        kafka_check=KafkaClusterCheck(
            config.kafka_bootstrap, timeout_ms=min(config.request_timeout_ms, 5_000)
        ),
    )
    if config.purge_delivered_after:
        publisher.retention = RetentionRunner(
            config.database_url,
            interval=config.purge_interval,
            delivered_older_than=parse_duration(config.purge_delivered_after),
            evidence_older_than=parse_duration(config.purge_evidence_after),
            on_report=publisher.metrics.count_purge,
        )
    return publisher


def _sink(config: PublisherConfig, publisher_id: uuid.UUID) -> Sink:
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
    )
    if config.sink == "confluent":
        # Only with the confluent extra installed (the config checked it).
        from publisher.confluent_sink import ConfluentSink  # noqa: PLC0415

        return ConfluentSink(sink_config)
    return KafkaSink(sink_config)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the publisher until SIGTERM/SIGINT (or idle); return the exit code."""
    try:
        config = config_from_args(argv)
        faults = Faults.from_env()
    except (ConfigError, FaultSpecError) as exc:
        print(f"outbox-publisher: {exc}", file=sys.stderr)
        return 2
    publisher_id = uuid.uuid4()
    configure_logging(
        config.log_level, config.log_format, fields={"publisher_id": str(publisher_id)}
    )
    # Every counter would also get a <name>_created series; they only add noise.
    disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus-client
    publisher = build_publisher(config, publisher_id, faults=faults)
    server = None
    if config.http_port:
        try:
            server = EndpointServer(
                config.http_host, config.http_port, publisher.metrics.registry, publisher.health
            )
        except OSError as exc:
            log.error(
                "cannot serve metrics and health on %s:%d: %s (--http-port 0 serves none)",
                config.http_host,
                config.http_port,
                exc.strerror or exc,
            )
            return 1
        server.start()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info(
            "%s received: finishing the batch in hand, then stopping", signal.Signals(signum).name
        )
        publisher.request_stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    log.info(
        "publisher %s: database %s, Kafka %s",
        publisher.publisher_id,
        redact(config.database_url),
        config.kafka_bootstrap,
    )
    try:
        publisher.run()
    except Exception:
        log.exception("publisher failed")
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if server is not None:
            server.stop()
    return 0
