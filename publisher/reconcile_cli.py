"""``outbox-publisher reconcile``: one recovery and reconciliation pass now, then exit.

Publishers recover expired leases and reconcile uncertain messages on their
own, at ``--recovery-interval`` and ``--reconcile-interval``. This command
runs one of each on demand, with no publisher running: it moves in-flight
messages whose lease expired by their evidence, then decides every uncertain
message that is due from what its Kafka partition holds. It lives on the
publisher's side because it reads Kafka; the ``outbox`` command needs only
PostgreSQL.

Exit codes: 0 when no message is left uncertain, 1 when some are (escalated,
or not yet due), 2 when the command could not run (bad usage, an unreachable
or unmigrated database, Kafka not answering).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Sequence

import psycopg
import psycopg.errors
from kafka.errors import KafkaError

from outbox.errors import OutboxError
from outbox.operator import operator_name
from outbox.redaction import SecretSafeArgumentParser
from outbox.states import State
from outbox.status import read_status
from publisher.config import SETTINGS, ConfigError, resolve
from publisher.connector import connect
from publisher.fencing import KafkaFencer
from publisher.kafka_security import KafkaAuthenticationFailed, KafkaSecurity, check_login
from publisher.reconciler import Reconciler
from publisher.scanner import KafkaLogScanner
from publisher.store import PublisherStore

#: How the command is called: ``outbox-publisher`` dispatches its first word here.
COMMAND = "outbox-publisher reconcile"

EXIT_OK = 0
EXIT_ACTION_NEEDED = 1
EXIT_ERROR = 2

#: The publisher's Kafka security settings, which this command takes too (same
#: flags, environment variables and password files).
_SECURITY_SETTINGS = tuple(s for s in SETTINGS if s.group == "Kafka security")
#: How long the command waits for Kafka to accept its login.
_LOGIN_TIMEOUT_MS = 15_000


def _parser() -> argparse.ArgumentParser:
    parser = SecretSafeArgumentParser(
        prog=COMMAND,
        allow_abbrev=False,  # as outbox-publisher: no --kafka-sasl-password for the -file flag
        description="Move in-flight messages whose lease expired (by their evidence), then look "
        "for every uncertain message whose producer can no longer write in its Kafka partition: "
        "found -> delivered, proven absent -> pending, evidence gone -> escalated to you. "
        "Publishers do this on their own at an interval; this runs one pass now.",
        epilog="Exit codes: 0 none left uncertain; 1 some left uncertain (decide them with "
        "`outbox resolve`, or wait for their producer's write deadline); 2 the command could "
        "not run (the reason is on stderr). See docs/operations.md.",
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_DATABASE_URL"),
        help="PostgreSQL URL, e.g. postgresql://user@host:5432/db (default: $OUTBOX_DATABASE_URL)",
    )
    parser.add_argument(
        "--kafka-bootstrap",
        default=os.environ.get("OUTBOX_KAFKA_BOOTSTRAP"),
        help="Kafka bootstrap servers, host:port[,...] (default: $OUTBOX_KAFKA_BOOTSTRAP)",
    )
    parser.add_argument(
        "--absence-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds after a write deadline before a record's absence from Kafka is proof; "
        "at least the brokers' replica.lag.time.max.ms (default: 30)",
    )
    security = parser.add_argument_group(
        "Kafka security",
        "as for outbox-publisher (docs/publisher.md, Kafka security); the passwords come from "
        "OUTBOX_KAFKA_SASL_PASSWORD / OUTBOX_KAFKA_SSL_KEY_PASSWORD or their -file flags",
    )
    for s in _SECURITY_SETTINGS:
        s.add_flag(security, show_default=False)
    return parser


def _security(args: argparse.Namespace) -> KafkaSecurity:
    """The Kafka security settings from the flags and the environment; ``ConfigError`` if wrong."""
    given = {s.name: getattr(args, s.name) for s in _SECURITY_SETTINGS if hasattr(args, s.name)}
    config = resolve(
        {**given, "database_url": args.database_url, "kafka_bootstrap": args.kafka_bootstrap},
        os.environ,
        only={"database_url", "kafka_bootstrap", *(s.name for s in _SECURITY_SETTINGS)},
    )
    return KafkaSecurity.from_config(config)


def _reconcile(
    database_url: str, kafka_bootstrap: str, absence_grace: float, security: KafkaSecurity
) -> int:
    # Refused credentials end the command before anything is moved.
    check_login(kafka_bootstrap, security, timeout_ms=_LOGIN_TIMEOUT_MS)
    store = PublisherStore(database_url, uuid.uuid4())
    scanner = KafkaLogScanner(kafka_bootstrap, security=security)
    try:
        moved = store.recover_expired_leases()
        to_pending = sum(1 for r in moved if r.state is State.PENDING)
        print(
            f"expired leases recovered: {len(moved)} "
            f"({to_pending} pending, {len(moved) - to_pending} uncertain)"
        )
        reconciler = Reconciler(
            store,
            scanner,
            f"{operator_name()} ({COMMAND})",
            absence_grace=absence_grace,
            fencer=KafkaFencer(kafka_bootstrap, security=security),
        )
        while True:
            report = reconciler.run_once()
            print(
                f"reconciled: {len(report.delivered)} delivered, {len(report.pending)} pending "
                f"(proven absent), {len(report.escalated)} escalated, "
                f"{len(report.deferred)} deferred"
            )
            if not reconciler.pages_left:
                break
        with connect(database_url) as conn:
            left = next(
                line.messages
                for line in read_status(conn)
                if line.topic is None and line.state == State.UNCERTAIN
            )
    finally:
        scanner.close()
        store.close()
    if left:
        print(
            f"{left} message(s) still uncertain: see last_error; decide with outbox resolve "
            "or wait for their producer's write deadline"
        )
        return EXIT_ACTION_NEEDED
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``outbox-publisher reconcile`` (``argv`` without that word); return its exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("no database: pass --database-url or set OUTBOX_DATABASE_URL")
    if not args.kafka_bootstrap:
        parser.error("no Kafka: pass --kafka-bootstrap or set OUTBOX_KAFKA_BOOTSTRAP")
    try:
        security = _security(args)
    except ConfigError as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        return _reconcile(args.database_url, args.kafka_bootstrap, args.absence_grace, security)
    except KafkaAuthenticationFailed as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except psycopg.errors.UndefinedTable as exc:
        print(
            f"{COMMAND}: the outbox tables are missing ({exc}); run `outbox migrate`",
            file=sys.stderr,
        )
        return EXIT_ERROR
    except (OutboxError, psycopg.Error) as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KafkaError as exc:
        print(f"{COMMAND}: Kafka did not answer ({exc}); check --kafka-bootstrap", file=sys.stderr)
        return EXIT_ERROR
