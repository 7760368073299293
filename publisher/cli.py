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
from publisher.loop import Publisher
from publisher.sink import KafkaSink, KafkaSinkConfig
from publisher.store import PublisherStore
from publisher.waker import Waker

log = logging.getLogger("publisher")


def _env_default(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _parser() -> argparse.ArgumentParser:
    d = PublisherConfig(database_url="", kafka_bootstrap="")
    p = argparse.ArgumentParser(
        prog="outbox-publisher",
        description="Deliver committed outbox intents from PostgreSQL to Apache Kafka. "
        "Each flag can also be set with the environment variable in brackets.",
    )
    p.add_argument(
        "--database-url",
        default=_env_default("OUTBOX_DATABASE_URL"),
        help="PostgreSQL URL [OUTBOX_DATABASE_URL]",
    )
    p.add_argument(
        "--kafka-bootstrap",
        default=_env_default("OUTBOX_KAFKA_BOOTSTRAP"),
        help="Kafka bootstrap servers, host:port[,host:port] [OUTBOX_KAFKA_BOOTSTRAP]",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=int(_env_default("OUTBOX_BATCH_SIZE", str(d.batch_size)) or 0),
        help=f"messages claimed and sent together (default {d.batch_size}) [OUTBOX_BATCH_SIZE]",
    )
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=float(_env_default("OUTBOX_LEASE_SECONDS", str(d.lease_seconds)) or 0),
        help=f"how long a claim is owned (default {d.lease_seconds:g}) [OUTBOX_LEASE_SECONDS]",
    )
    p.add_argument(
        "--poll-interval",
        type=float,
        default=float(_env_default("OUTBOX_POLL_INTERVAL", str(d.poll_interval)) or 0),
        help=f"seconds between claims when no NOTIFY arrives "
        f"(default {d.poll_interval:g}) [OUTBOX_POLL_INTERVAL]",
    )
    p.add_argument(
        "--delivery-timeout-ms",
        type=int,
        default=d.delivery_timeout_ms,
        help=f"producer delivery timeout (default {d.delivery_timeout_ms})",
    )
    p.add_argument(
        "--linger-ms",
        type=int,
        default=d.linger_ms,
        help=f"producer linger (default {d.linger_ms})",
    )
    p.add_argument(
        "--exit-when-idle",
        action="store_true",
        help="exit 0 once no message is pending (for scripts and tests)",
    )
    p.add_argument(
        "--log-level",
        default=_env_default("OUTBOX_LOG_LEVEL", "INFO"),
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
    )
    config.validate()
    return config, args.log_level


def build_publisher(config: PublisherConfig, publisher_id: uuid.UUID | None = None) -> Publisher:
    """Wire a publisher to PostgreSQL and Kafka from its config."""
    publisher_id = publisher_id or uuid.uuid4()
    sink = KafkaSink(
        KafkaSinkConfig(
            bootstrap_servers=config.kafka_bootstrap,
            client_id=f"outbox-publisher-{publisher_id}",
            linger_ms=config.linger_ms,
            delivery_timeout_ms=config.delivery_timeout_ms,
            request_timeout_ms=config.request_timeout_ms,
        )
    )
    return Publisher(
        config,
        PublisherStore(config.database_url, publisher_id),
        sink,
        Waker(config.database_url),
        version=outbox.__version__,
        pid=os.getpid(),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the publisher until SIGTERM/SIGINT (or idle); return the exit code."""
    try:
        config, level = config_from_args(argv)
    except ConfigError as exc:
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
    publisher = build_publisher(config)

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
