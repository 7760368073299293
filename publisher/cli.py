"""``outbox-publisher``: settings, logging, signals and exit codes.

Settings come from flags, environment variables and an optional TOML file
(``publisher.config``); ``publisher.app`` builds and runs what they
describe. SIGTERM or SIGINT stops claiming; the batch in hand is sent, its
outcomes are recorded, and the process exits 0. Exit code 2 means the
configuration was refused (every problem is printed), the database lacks a
migration this version ships, or the login lacks the publisher role; 1 that
the publisher failed (including an HTTP address it cannot listen on).

``outbox-publisher reconcile`` runs one recovery and reconciliation pass
and exits (``publisher.reconcile_cli``): the operator command that reads
Kafka, hence on this side of the package.
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

import psycopg.errors
from prometheus_client import disable_created_metrics

from outbox.errors import said
from outbox.migrations import SchemaBehind
from outbox.redaction import SecretSafeArgumentParser
from publisher.app import build_app
from publisher.config import (
    CONFIG_ENV,
    GROUPS,
    SETTINGS,
    ConfigError,
    PublisherConfig,
    config_file_named,
    resolve,
)
from publisher.faults import Faults, FaultSpecError
from publisher.kafka_security import KafkaAuthenticationFailed
from publisher.logs import configure_logging
from publisher.reconcile_cli import NEEDS_PUBLISHER_ROLE
from publisher.reconcile_cli import main as reconcile_main

log = logging.getLogger("publisher")


def _parser() -> argparse.ArgumentParser:
    """Every setting of ``SETTINGS`` as a flag; a flag not given is left out of the result.

    Values stay text here: ``resolve`` converts them, so that a malformed
    flag is reported with every other problem instead of alone.
    """
    p = SecretSafeArgumentParser(
        prog="outbox-publisher",
        # No abbreviations: --kafka-sasl-password would otherwise be taken for
        # --kafka-sasl-password-file, and a password typed there treated as a path.
        allow_abbrev=False,
        description="Deliver committed outbox intents from PostgreSQL to Apache Kafka.",
        epilog="Each setting can also be set with the environment variable in brackets or "
        "in a TOML file (--config), under the flag's name with underscores "
        "(batch_size = 500). A flag beats its variable, which beats the file, which beats "
        "the default. See docs/publisher.md. `outbox-publisher reconcile` runs one "
        "reconciliation pass now and exits (`outbox-publisher reconcile --help`).",
    )
    p.known_words = {
        "reconcile": "reconcile comes first: outbox-publisher reconcile [OPTIONS]",
    }
    p.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"read settings from this TOML file [{CONFIG_ENV}]",
    )
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for s in SETTINGS:
        s.add_flag(groups[s.group])
    return p


def config_from_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> PublisherConfig:
    """Parse flags, environment and config file into a validated config."""
    environ = os.environ if environ is None else environ
    given = vars(_parser().parse_args(argv))
    config_file = config_file_named(given, environ)
    return resolve(given, environ, config_file)


def main(argv: Sequence[str] | None = None) -> int:  # noqa: PLR0911 - one exit per outcome
    """Run the publisher until SIGTERM/SIGINT (or idle); return the exit code.

    With ``reconcile`` as the first argument, run that command instead.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["reconcile"]:
        return reconcile_main(argv[1:])
    try:
        config = config_from_args(argv)
    except ConfigError as exc:
        print(f"outbox-publisher: {exc}", file=sys.stderr)
        return 2
    publisher_id = uuid.uuid4()
    configure_logging(
        config.log_level, config.log_format, fields={"publisher_id": str(publisher_id)}
    )
    try:
        # After the logging is set up: ignored switches are reported as a warning.
        faults = Faults.from_env()
    except FaultSpecError as exc:
        print(f"outbox-publisher: {exc}", file=sys.stderr)
        return 2
    # Every counter would also get a <name>_created series; they only add noise.
    disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus-client
    try:
        app = build_app(config, publisher_id, faults=faults)
    except ConfigError as exc:  # what only the sink can judge (its producer's settings)
        print(f"outbox-publisher: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # only the HTTP endpoints' socket is opened while building
        log.error(
            "cannot serve metrics and health on %s:%d: %s (--http-port 0 serves none)",
            config.http_host,
            config.http_port,
            exc.strerror or exc,
        )
        return 1

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info(
            "%s received: finishing the batch in hand, then stopping", signal.Signals(signum).name
        )
        app.request_stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        app.run()
    except KafkaAuthenticationFailed as exc:
        log.error("%s", exc)  # one line: a traceback would add nothing
        return 1
    except SchemaBehind as exc:
        log.error("%s", exc)
        return 2
    except psycopg.errors.InsufficientPrivilege as exc:
        log.error("%s; %s", said(exc), NEEDS_PUBLISHER_ROLE.format(command="outbox-publisher"))
        return 2
    except Exception:
        log.exception("publisher failed")
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
