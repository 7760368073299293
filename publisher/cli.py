"""``outbox-publisher``: settings from flags and environment, signals, logging.

SIGTERM or SIGINT stops claiming; the batch in hand is sent, its outcomes
are recorded, and the process exits 0. Exit code 2 means the configuration
was refused (every problem is printed), 1 that the publisher failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from types import FrameType

import outbox
from publisher.config import ConfigError, PublisherConfig
from publisher.faults import Faults, FaultSpecError
from publisher.loop import Publisher
from publisher.reconciler import Reconciler
from publisher.scanner import KafkaLogScanner
from publisher.sink import KafkaSink, KafkaSinkConfig
from publisher.store import PublisherStore
from publisher.waker import Waker

log = logging.getLogger("publisher")


def _setting(
    parser: argparse.ArgumentParser, flag: str, kind: type, default: object, help_text: str
) -> None:
    """Add ``--flag``, defaulting to ``$OUTBOX_FLAG`` (upper case, '-' -> '_') or ``default``."""
    env = "OUTBOX_" + flag.removeprefix("--").replace("-", "_").upper()
    raw = os.environ.get(env)
    try:
        value = default if raw is None else kind(raw)
    except ValueError:
        parser.error(f"{env}={raw!r} is not a valid {kind.__name__}")
    shown = "none" if default is None else f"{default:g}" if isinstance(default, float) else default
    parser.add_argument(
        flag, type=kind, default=value, help=f"{help_text} (default {shown}) [{env}]"
    )


def _parser() -> argparse.ArgumentParser:
    d = PublisherConfig(database_url="", kafka_bootstrap="")
    p = argparse.ArgumentParser(
        prog="outbox-publisher",
        description="Deliver committed outbox intents from PostgreSQL to Apache Kafka. "
        "Each flag can also be set with the environment variable in brackets.",
    )
    _setting(p, "--database-url", str, None, "PostgreSQL URL")
    _setting(p, "--kafka-bootstrap", str, None, "Kafka bootstrap servers, host:port[,host:port]")
    _setting(p, "--batch-size", int, d.batch_size, "messages claimed and sent together")
    _setting(p, "--lease-seconds", float, d.lease_seconds, "how long a claim is owned")
    _setting(
        p,
        "--poll-interval",
        float,
        d.poll_interval,
        "seconds between claims when no NOTIFY arrives",
    )
    _setting(
        p,
        "--heartbeat-interval",
        float,
        d.heartbeat_interval,
        "seconds between heartbeats and lease renewals",
    )
    _setting(
        p,
        "--recovery-interval",
        float,
        d.recovery_interval,
        "seconds between passes that recover expired leases",
    )
    _setting(
        p,
        "--reconcile-interval",
        float,
        d.reconcile_interval,
        "seconds between reconciliation passes over uncertain messages, 0 for none",
    )
    _setting(p, "--delivery-timeout-ms", int, d.delivery_timeout_ms, "producer delivery timeout")
    _setting(p, "--request-timeout-ms", int, d.request_timeout_ms, "producer request timeout")
    _setting(p, "--linger-ms", int, d.linger_ms, "producer linger")
    _setting(p, "--max-block-ms", int, d.max_block_ms, "longest a send or a topic lookup may block")
    _setting(
        p,
        "--retry-base-seconds",
        float,
        d.retry_base_seconds,
        "first retry delay of a message Kafka did not take; doubles per attempt",
    )
    _setting(p, "--retry-cap-seconds", float, d.retry_cap_seconds, "longest retry delay")
    _setting(
        p,
        "--max-attempts",
        int,
        d.max_attempts,
        "attempts after which a message Kafka keeps refusing is quarantined",
    )
    p.add_argument(
        "--no-auto-create-topics",
        dest="auto_create_topics",
        action="store_false",
        default=os.environ.get("OUTBOX_AUTO_CREATE_TOPICS", "true").lower() not in {"0", "false"},
        help="never create a missing topic: its messages are quarantined "
        "[OUTBOX_AUTO_CREATE_TOPICS=false]",
    )
    p.add_argument(
        "--exit-when-idle",
        action="store_true",
        help="exit 0 once nothing is pending, in flight or awaiting reconciliation "
        "(for scripts and tests)",
    )
    p.add_argument(
        "--log-level",
        default=os.environ.get("OUTBOX_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (default INFO) [OUTBOX_LOG_LEVEL]",
    )
    return p


def config_from_args(argv: Sequence[str] | None = None) -> tuple[PublisherConfig, str]:
    """Parse flags and environment into a validated config; also return the log level."""
    args = _parser().parse_args(argv)
    config = PublisherConfig(
        database_url=args.database_url or "",
        kafka_bootstrap=args.kafka_bootstrap or "",
        batch_size=args.batch_size,
        lease_seconds=args.lease_seconds,
        poll_interval=args.poll_interval,
        exit_when_idle=args.exit_when_idle,
        linger_ms=args.linger_ms,
        delivery_timeout_ms=args.delivery_timeout_ms,
        request_timeout_ms=args.request_timeout_ms,
        heartbeat_interval=args.heartbeat_interval,
        recovery_interval=args.recovery_interval,
        reconcile_interval=args.reconcile_interval,
        retry_base_seconds=args.retry_base_seconds,
        retry_cap_seconds=args.retry_cap_seconds,
        max_attempts=args.max_attempts,
        max_block_ms=args.max_block_ms,
        auto_create_topics=args.auto_create_topics,
    )
    config.validate()
    return config, args.log_level


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
            store, KafkaLogScanner(config.kafka_bootstrap), f"reconciler {publisher_id}"
        )
    sink = KafkaSink(
        KafkaSinkConfig(
            bootstrap_servers=config.kafka_bootstrap,
            client_id=f"outbox-publisher-{publisher_id}",
            linger_ms=config.linger_ms,
            delivery_timeout_ms=config.delivery_timeout_ms,
            request_timeout_ms=config.request_timeout_ms,
            max_block_ms=config.max_block_ms,
            allow_auto_create_topics=config.auto_create_topics,
        )
    )
    return Publisher(
        config,
        store,
        sink,
        Waker(config.database_url),
        reconciler=reconciler,
        heartbeat_store=PublisherStore(config.database_url, publisher_id),
        faults=faults,
        version=outbox.__version__,
        pid=os.getpid(),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the publisher until SIGTERM/SIGINT (or idle); return the exit code."""
    try:
        config, level = config_from_args(argv)
        faults = Faults.from_env()
    except (ConfigError, FaultSpecError) as exc:
        print(f"outbox-publisher: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # kafka-python logs every reconnect at INFO/ERROR; our own lines say what matters.
    logging.getLogger("kafka").setLevel(max(logging.WARNING, logging.getLevelName(level)))
    # ... and an ERROR for every topic it has not seen yet, even where the broker
    # creates it on first use; a topic that really is missing is reported per message.
    logging.getLogger("kafka.cluster").setLevel(logging.CRITICAL)
    publisher = build_publisher(config, faults=faults)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info(
            "%s received: finishing the batch in hand, then stopping", signal.Signals(signum).name
        )
        publisher.request_stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        publisher.run()
    except Exception:
        log.exception("publisher failed")
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
