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
or unmigrated database, a login without the publisher role, Kafka not
answering).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC

import psycopg
import psycopg.errors
from kafka.errors import KafkaError

from outbox.errors import OutboxError, said
from outbox.migrations import require_current_schema
from outbox.operator import operator_name
from outbox.queries import query
from outbox.redaction import SecretSafeArgumentParser
from outbox.states import State
from publisher.config import (
    CONFIG_ENV,
    SETTINGS,
    ConfigError,
    PublisherConfig,
    config_file_named,
    resolve,
)
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

#: What a command of this package says when PostgreSQL refuses its login a table.
NEEDS_PUBLISHER_ROLE = "`{command}` needs the publisher role (see docs/security.md)"

#: The publisher's settings this command takes too, with the same flags,
#: environment variables, config file keys and password files: where to
#: connect, how to log in to Kafka, and the absence grace. A deployment that
#: sets a longer grace for its brokers gets it here as in the publisher.
_SETTINGS = tuple(
    s
    for s in SETTINGS
    if s.name in {"database_url", "kafka_bootstrap", "absence_grace"} or s.group == "Kafka security"
)
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
        epilog="Each setting is taken as outbox-publisher takes it: the flag, else the "
        "environment variable in brackets, else the TOML file (--config), else the default "
        "(docs/publisher.md). Exit codes: 0 none left uncertain; 1 some left uncertain (decide "
        "them with `outbox resolve`, or wait for their producer's write deadline); 2 the "
        "command could not run (the reason is on stderr). See docs/operations.md.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"read settings from this TOML file, as outbox-publisher does [{CONFIG_ENV}]",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in _SETTINGS:
        if s.group not in groups:
            groups[s.group] = parser.add_argument_group(s.group)
        s.add_flag(groups[s.group])
    return parser


def config_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> PublisherConfig:
    """This command's settings from its flags, the environment and the config file;
    ``ConfigError`` naming every problem."""
    environ = os.environ if environ is None else environ
    given = vars(_parser().parse_args(argv))
    config_file = config_file_named(given, environ)
    return resolve(given, environ, config_file, only={s.name for s in _SETTINGS})


def _say(line: str) -> None:
    """Print a line of the report. A reader that went away (``| head``) does not stop the
    work: what is left to print goes nowhere, and the passes go on to their end."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _reconcile(config: PublisherConfig, security: KafkaSecurity) -> int:
    database_url, kafka_bootstrap = config.database_url, config.kafka_bootstrap
    # Refused credentials end the command before anything is moved.
    check_login(kafka_bootstrap, security, timeout_ms=_LOGIN_TIMEOUT_MS)
    store = PublisherStore(database_url, uuid.uuid4())
    scanner = KafkaLogScanner(kafka_bootstrap, security=security)
    try:
        # Its statements read the latest schema, as the publisher's do.
        require_current_schema(store.conn, COMMAND)
        moved = []
        while recovered := store.recover_expired_leases():  # a page of batches at a time
            moved += recovered
        to_pending = sum(1 for r in moved if r.state is State.PENDING)
        _say(
            f"expired leases recovered: {len(moved)} "
            f"({to_pending} pending, {len(moved) - to_pending} uncertain)"
        )
        reconciler = Reconciler(
            store,
            scanner,
            f"{operator_name()} ({COMMAND})",
            absence_grace=config.absence_grace,
            held_back_note_after=config.held_back_note_seconds,
            fencer=KafkaFencer(kafka_bootstrap, security=security),
        )
        for report in reconciler.run_cycle():
            _say(
                f"reconciled: {len(report.delivered)} delivered, {len(report.pending)} pending "
                f"(proven absent), {len(report.escalated)} escalated, "
                f"{len(report.deferred)} deferred"
            )
            for note, count in report.waiting.items():
                _say(f"  {count} of them: {note}")
        with connect(database_url) as conn:
            row = conn.execute(query("uncertain_left"), {"grace": config.absence_grace}).fetchone()
    finally:
        scanner.close()
        store.close()
    escalated, waiting, until, other = row or (0, 0, None, 0)
    if escalated:
        _say(
            f"{escalated} escalated: the reconciler could not decide them; decide each with "
            "`outbox resolve` (`outbox inspect ID` shows why, and what fits)"
        )
    if waiting and until is not None:
        _say(
            f"{waiting} wait for their write deadline and the absence grace, until "
            f"{until.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC at the latest: run this again "
            "then, or leave them to a running publisher"
        )
    if other:
        _say(
            f"{other} undecided for now: their last_error says why "
            "(`outbox list --state uncertain`)"
        )
    return EXIT_ACTION_NEEDED if escalated or waiting or other else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``outbox-publisher reconcile`` (``argv`` without that word); return its exit code."""
    try:
        config = config_from_args(argv)
        # Every Kafka client gets the same security settings (password files read once).
        security = KafkaSecurity.from_config(config)
    except ConfigError as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        return _reconcile(config, security)
    except KafkaAuthenticationFailed as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except psycopg.errors.UndefinedTable as exc:
        print(
            f"{COMMAND}: the outbox tables are missing ({said(exc)}); run `outbox migrate`",
            file=sys.stderr,
        )
        return EXIT_ERROR
    except (OutboxError, psycopg.Error) as exc:
        text = said(exc)
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            text += "; " + NEEDS_PUBLISHER_ROLE.format(command=COMMAND)
        print(f"{COMMAND}: {text}", file=sys.stderr)
        return EXIT_ERROR
    except KafkaError as exc:
        print(f"{COMMAND}: Kafka did not answer ({exc}); check --kafka-bootstrap", file=sys.stderr)
        return EXIT_ERROR
