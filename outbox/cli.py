"""The ``outbox`` command: operator tools for the outbox tables.

Exit codes: 0 when the command succeeded and, for ``status``, when nothing
needs an operator; 1 when ``status`` or ``inspect`` finds messages that need
action; 2 when the command could not run (bad usage, a refused decision, an
unreachable or unmigrated database).

Every command here needs only PostgreSQL, so it runs wherever the library is
installed. Reconciling reads Kafka: that is ``outbox-publisher reconcile``,
installed with the ``publisher`` extra; ``outbox reconcile`` only says so.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import psycopg.errors

from outbox import render
from outbox.errors import OutboxError, said
from outbox.inspection import list_messages, read_timeline
from outbox.migrations import (
    DEFAULT_LOCK_ATTEMPTS,
    DEFAULT_LOCK_TIMEOUT,
    current_version,
    migrate,
    require_current_schema,
)
from outbox.operator import (
    Resolution,
    check_resolution,
    discard,
    overtaken_words,
    resolve,
    retry,
    retry_quarantined,
)
from outbox.queries import query
from outbox.redaction import (
    SecretSafeArgumentParser,
    check_conninfo,
    connect_errors_redacted,
    scrub,
)
from outbox.retention import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_EVIDENCE_AGE,
    check_windows,
    parse_duration,
    purge,
)
from outbox.roles import RoleNames, create_roles, granted_roles
from outbox.states import State
from outbox.status import read_held_keys, read_status

EXIT_OK = 0
EXIT_ACTION_NEEDED = 1
EXIT_ERROR = 2
#: The reader of the output went away (``outbox list | head``): what a command killed
#: by SIGPIPE exits with in a shell, 128 + 13. Not 1: nothing needs anyone.
EXIT_READER_GONE = 141


#: What ``outbox reconcile`` prints: the command moved to the publisher's side.
RECONCILE_MOVED = (
    "outbox: reconcile reads Kafka, so it is a publisher command: run `outbox-publisher "
    "reconcile` (installed with pip install 'pg-kafka-outbox[publisher]')"
)

_JSON_HELP = "print JSON instead of a table (the format is stable; see docs/operations.md)"


#: The largest count a command takes (PostgreSQL's integer, Kafka's partition number).
_INT32_MAX = 2**31 - 1
#: The largest offset (PostgreSQL's bigint, Kafka's offset).
_INT64_MAX = 2**63 - 1
#: The longest lock timeout PostgreSQL takes (``lock_timeout`` is in int32 milliseconds).
_LONGEST_LOCK_TIMEOUT = _INT32_MAX // 1000


def _whole(text: str, least: int, most: int) -> int:
    """``text`` as a whole number from ``least`` to ``most``, or a usage error saying so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not least <= value <= most:
        raise argparse.ArgumentTypeError(f"must be from {least} to {most:,}, got {value:,}")
    return value


def _positive_int(text: str) -> int:
    return _whole(text, 1, _INT32_MAX)


def _partition(text: str) -> int:
    return _whole(text, 0, _INT32_MAX)


def _offset(text: str) -> int:
    return _whole(text, 0, _INT64_MAX)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from exc
    if not 0 < value <= _LONGEST_LOCK_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"must be more than 0 seconds and at most {_LONGEST_LOCK_TIMEOUT:,}, got {text}"
        )
    return value


def _duration(text: str) -> timedelta:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _url_after_command() -> SecretSafeArgumentParser:
    """--database-url after the command too (`outbox status --database-url URL`); given
    there, it wins over one before the command."""
    after = SecretSafeArgumentParser(add_help=False)
    after.add_argument("--database-url", default=argparse.SUPPRESS, help="as before the command")
    return after


def _add_command(
    commands: argparse._SubParsersAction[SecretSafeArgumentParser], name: str, **kwargs: Any
) -> argparse.ArgumentParser:
    command = commands.add_parser(name, parents=[_url_after_command()], **kwargs)
    # Usage errors found after parsing are the command's: its usage, not the top one.
    command.set_defaults(command_parser=command)
    return command


def _parser() -> argparse.ArgumentParser:
    parser = SecretSafeArgumentParser(
        prog="outbox",
        description="Inspect and maintain the transactional outbox in PostgreSQL.",
        epilog="Start with `outbox status`: it names what needs you and the next safe action. "
        "Then `outbox list --state STATE` and `outbox inspect ID`. Exit codes: 0 done and "
        "nothing needs you; 1 something needs an operator (status, inspect); 2 the "
        "command could not run (the reason is on stderr). `outbox COMMAND --help` for each "
        "command; the runbook is docs/operations.md. Reconciling with Kafka is "
        "`outbox-publisher reconcile` (the publisher extra).",
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_DATABASE_URL"),
        help="PostgreSQL URL, e.g. postgresql://user@host:5432/db (default: $OUTBOX_DATABASE_URL)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_command = functools.partial(_add_command, commands)
    migrate_cmd = add_command(
        "migrate",
        help="create or upgrade the outbox tables (safe to repeat and to run concurrently)",
        description="Apply the schema migrations this version ships that the database lacks. "
        "Run it as the owner of the outbox schema (the role that ran it first). With "
        "--create-roles, then create the writer, publisher and operator roles (NOLOGIN) that "
        "do not exist and grant each exactly its privileges; run it so after every upgrade, "
        "since new tables and views get no grants otherwise (docs/security.md).",
    )
    migrate_cmd.add_argument(
        "--create-roles",
        action="store_true",
        help="also create the roles (needs CREATEROLE for a missing one) and renew their grants",
    )
    migrate_cmd.add_argument(
        "--lock-timeout",
        type=_positive_seconds,
        default=DEFAULT_LOCK_TIMEOUT,
        metavar="SECONDS",
        help="wait at most this long for a lock on an outbox table, so that enqueues never "
        "queue behind a migration for longer; then roll that migration back and try again "
        f"(default {DEFAULT_LOCK_TIMEOUT:g})",
    )
    migrate_cmd.add_argument(
        "--lock-attempts",
        type=_positive_int,
        default=DEFAULT_LOCK_ATTEMPTS,
        metavar="N",
        help="tries per migration before giving up, 1 s, 2 s, ... apart "
        f"(default {DEFAULT_LOCK_ATTEMPTS})",
    )
    defaults = RoleNames()
    for purpose, default in defaults.by_purpose().items():
        migrate_cmd.add_argument(
            f"--{purpose}-role",
            metavar="NAME",
            help=f"with --create-roles: the {purpose} role's name (default {default})",
        )
    status = add_command(
        "status",
        help="how many messages are in each state, per topic and overall, and the next safe "
        "action; exits 1 if something needs you",
        description="Read the outbox.status view: for each state, over all topics and per "
        "topic, the count, the age of the oldest, retries, held keys and in-flight leases, "
        "and what to do next. Exit code 0 when nothing needs an operator, 1 when something "
        "does (quarantined messages; uncertain ones that are escalated, overdue, or with no "
        "publisher running; expired leases; pending messages and no publisher running).",
    )
    status.add_argument("--topic", help="only this topic's lines and held keys")
    status.add_argument("--json", action="store_true", help=_JSON_HELP)
    inspect_cmd = add_command(
        "inspect",
        help="one message's whole story: every attempt, outcome, decision; and what to do next",
        description="Show one message and its timeline: when it was enqueued, each attempt "
        "(publisher, fence, batch, when sending began, outcome, error, where it landed), the "
        "claim it is in now, the key it waits behind, and every reconciler or operator "
        "decision with its evidence. Exit code 1 when the message needs a person, as "
        "`outbox status` would call its state's line unhealthy (quarantined; uncertain and "
        "escalated or overdue; in flight under an expired lease; or waiting for a publisher "
        "while none runs).",
    )
    inspect_cmd.add_argument("message_id", type=uuid.UUID, metavar="ID", help="the message id")
    inspect_cmd.add_argument("--json", action="store_true", help=_JSON_HELP)
    list_cmd = add_command(
        "list",
        help="the messages in one state, oldest first (ids to inspect, retry, resolve, discard)",
        description="List the messages in one state, oldest first, with what matters for that "
        "state: the error of a quarantined message, the lease of an in-flight one, where a "
        "delivered one landed.",
    )
    list_cmd.add_argument(
        "--state",
        type=_state,
        required=True,
        choices=list(State),
        metavar="STATE",
        help="one of: " + ", ".join(State),
    )
    list_cmd.add_argument("--topic", help="only this topic")
    list_cmd.add_argument(
        "--limit", type=_positive_int, default=50, help="at most this many (default 50)"
    )
    list_cmd.add_argument("--json", action="store_true", help=_JSON_HELP)
    purge_cmd = add_command(
        "purge",
        help="delete delivered messages older than a period, in small batches",
        description="Retention. Delete delivered messages enqueued and delivered longer ago "
        "than --delivered-older-than; then the attempts and decisions of purged messages, "
        "and batches no in-flight or uncertain message needs, once older than "
        "--evidence-older-than. Never deletes a message that is not delivered, nor the "
        "attempts and decisions of one that exists. Works in short transactions of "
        "--batch-size rows, so it can run next to the publishers. Note that a purged "
        "message's idempotency key can be used again.",
    )
    purge_cmd.add_argument(
        "--delivered-older-than",
        type=_duration,
        required=True,
        metavar="AGE",
        help="e.g. 7d; units s, m, h, d, w",
    )
    purge_cmd.add_argument(
        "--evidence-older-than",
        type=_duration,
        metavar="AGE",
        help="delete the evidence (attempts, decisions, batches) of purged messages once it is "
        "this old; never while its message is kept (default "
        f"{DEFAULT_EVIDENCE_AGE.days}d, or --delivered-older-than if longer)",
    )
    purge_cmd.add_argument(
        "--batch-size",
        type=_positive_int,
        default=DEFAULT_BATCH_SIZE,
        help=f"rows deleted per transaction (default {DEFAULT_BATCH_SIZE})",
    )
    purge_cmd.add_argument(
        "--dry-run", action="store_true", help="count what would be deleted, delete nothing"
    )
    purge_cmd.add_argument("--json", action="store_true", help=_JSON_HELP)
    # Kept as a name so that whoever types it (the status view's next action
    # says it) learns where it went; main() lets it through with its old flags.
    add_command(
        "reconcile",
        help="moved: `outbox-publisher reconcile` (pip install 'pg-kafka-outbox[publisher]')",
        description=RECONCILE_MOVED,
        add_help=False,
    )
    _add_decisions(add_command)
    return parser


def _add_decisions(add_command: Callable[..., argparse.ArgumentParser]) -> None:
    """The operator's decisions: resolve, retry, discard."""
    resolve_cmd = add_command(
        "resolve",
        help="decide an uncertain or quarantined message by hand, with a reason",
        description="Record an operator's decision on one uncertain (or quarantined) message. "
        "--delivered: it is in Kafka, do not send it; --pending: send it (again; a consumer may "
        "see it twice if it was in Kafka after all); --discard: never deliver it. The decision "
        "names the fence it was made from (--fence, as `outbox inspect ID` shows it; required "
        "with --delivered and --pending) and is refused if the message changed since. "
        "--pending and --discard are refused while the record of an uncertain message may "
        "still be written: "
        "before its write deadline, or, sent in a Kafka transaction, until its session is "
        "fenced (`outbox-publisher reconcile` fences it and decides the message); --pending "
        "until a minute after the deadline too (a record written by then may not be readable "
        "yet), --delivered while the session is unfenced (its record may yet be aborted). "
        "--pending is refused while later messages of its key may already be in Kafka "
        "(delivered with it, or uncertain) unless --out-of-order; --delivered of a message "
        "the reconciler proved absent is refused.",
    )
    resolve_cmd.add_argument("message_id", type=uuid.UUID, metavar="ID", help="the message id")
    decision = resolve_cmd.add_mutually_exclusive_group(required=True)
    decision.add_argument(
        "--delivered", dest="resolution", action="store_const", const=Resolution.DELIVERED
    )
    decision.add_argument(
        "--pending", dest="resolution", action="store_const", const=Resolution.PENDING
    )
    decision.add_argument(
        "--discard", dest="resolution", action="store_const", const=Resolution.DISCARD
    )
    resolve_cmd.add_argument("--reason", required=True, help="why; stored with the decision")
    _fence_argument(resolve_cmd, "required with --delivered and --pending")
    resolve_cmd.add_argument(
        "--partition",
        type=_partition,
        help="with --delivered: where it is (the partition inspect shows, when it shows one)",
    )
    resolve_cmd.add_argument("--offset", type=_offset, help="with --delivered: its offset")
    resolve_cmd.add_argument(
        "--force-before-deadline",
        action="store_true",
        help="UNSAFE: skip the check that the producer that sent it can no longer write it "
        "(write deadline and a minute passed, or its Kafka transaction session fenced); "
        "--pending may then deliver it twice, --discard after later messages of its key, "
        "--delivered a record its transaction aborts",
    )
    _out_of_order_argument(resolve_cmd, "with --pending")
    retry_cmd = add_command(
        "retry",
        help="send a quarantined message again (releases the key it holds)",
        description="Move one quarantined message, or all of them (--quarantined, optionally "
        "of one --topic), back to pending with a fresh retry budget. Fix what made Kafka refuse "
        "it first. Each decision is recorded. With --fence, one message moves only if it has "
        "not changed since you read that fence. A message that later messages of its key may "
        "already have overtaken in Kafka (delivered with it) is refused unless --out-of-order, "
        "and left quarantined by --quarantined, which names it.",
    )
    target = retry_cmd.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "message_id", type=uuid.UUID, metavar="ID", nargs="?", help="the message id"
    )
    target.add_argument("--quarantined", action="store_true", help="every quarantined message")
    retry_cmd.add_argument("--topic", help="with --quarantined: only this topic")
    retry_cmd.add_argument(
        "--reason", default="retried by an operator", help="stored with the decision"
    )
    _fence_argument(retry_cmd, "with ID; without it, a warning")
    _out_of_order_argument(retry_cmd, "with ID")
    discard_cmd = add_command(
        "discard",
        help="never deliver a pending, quarantined or uncertain message (releases its key)",
        description="Decide that one message will not be delivered. Later messages of its key "
        "then go on without it, so consumers see the key's stream with a gap. Recorded with "
        "the reason. With --fence, only if the message has not changed since you read that "
        "fence. An uncertain message is refused while its record may still be written (before "
        "its write deadline, or until its Kafka transaction session is fenced): it could land "
        "after later messages of its key.",
    )
    discard_cmd.add_argument("message_id", type=uuid.UUID, metavar="ID", help="the message id")
    discard_cmd.add_argument("--reason", required=True, help="why; stored with the decision")
    _fence_argument(discard_cmd, "without it, a warning")


def _out_of_order_argument(command: argparse.ArgumentParser, applies: str) -> None:
    command.add_argument(
        "--out-of-order",
        action="store_true",
        help=f"{applies}: send it even though later messages of its key may already be in "
        "Kafka; their consumers then see it after them",
    )


def _state(text: str) -> State:
    try:
        return State(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a state; one of: {', '.join(State)}"
        ) from None


def _fence_argument(command: argparse.ArgumentParser, when: str) -> None:
    command.add_argument(
        "--fence",
        type=_fence,
        metavar="N",
        help="the message's fence this decision was made from, as `outbox inspect ID` or "
        f"`outbox list` shows it; refused if the message changed since ({when})",
    )


def _fence(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a fence is a whole number (as `outbox inspect ID` shows it), got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a fence is never negative, got {value}")
    if value > _INT64_MAX:
        raise argparse.ArgumentTypeError(f"a fence is at most {_INT64_MAX:,}, got {value:,}")
    return value


def _warn_if_unfenced(args: argparse.Namespace) -> None:
    """After a decision that named no fence: say that it was not checked against a reading."""
    if args.fence is None:
        print(
            "outbox: warning: no --fence given, so this decision was not checked against the "
            "message as you read it; next time pass the fence `outbox inspect "
            f"{args.message_id}` shows, to have it refused if the message changed since",
            file=sys.stderr,
        )


def _connect(url: str) -> psycopg.Connection[tuple[Any, ...]]:
    """A connection to ``url`` at READ COMMITTED, whatever the server's default (operator
    decisions need it), resolving names in pg_catalog only (``pin_search_path``); an
    error opening it repeats nothing secret of the URL."""
    with connect_errors_redacted(url):
        conn = psycopg.connect(url)
    try:
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        conn.execute(query("pin_search_path"), (False,))
        conn.commit()
    except BaseException:
        conn.close()
        raise
    return conn


def _connect_to_decide(args: argparse.Namespace) -> psycopg.Connection[tuple[Any, ...]]:
    """``_connect``, refusing a schema behind this version: a decision writes what the
    latest migration added (``held``, since 0013), and says so before it starts."""
    conn = _connect(args.database_url)
    try:
        require_current_schema(conn, f"`outbox {args.command}`")
    except BaseException:
        conn.close()
        raise
    return conn


def _migrate(args: argparse.Namespace) -> int:
    applied = migrate(
        args.database_url, lock_timeout=args.lock_timeout, lock_attempts=args.lock_attempts
    )
    with _connect(args.database_url) as conn:
        version = current_version(conn)
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied) or "none"
        print(f"schema at version {version}; applied now: {names}")
        if args.create_roles:
            for line in create_roles(conn, _role_names(args)).lines():
                print(line)
        elif applied and (granted := granted_roles(conn)):
            print(
                f"note: roles {', '.join(granted)} have grants on the outbox schema; what this "
                "migration created has none yet: run `outbox migrate --create-roles` (with "
                "their names) to renew them"
            )
    return EXIT_OK


def _role_names(args: argparse.Namespace) -> RoleNames:
    """The role names ``migrate --create-roles`` was given, the defaults for the others."""
    defaults = RoleNames()
    return RoleNames(
        *(
            default if given is None else given
            for given, default in (
                (args.writer_role, defaults.writer),
                (args.publisher_role, defaults.publisher),
                (args.operator_role, defaults.operator),
            )
        )
    )


def _resolution_options(args: argparse.Namespace) -> dict[str, Any]:
    """``outbox resolve``'s options, as ``resolve`` and ``check_resolution`` take them."""
    return {
        "fence": args.fence,
        "partition": args.partition,
        "offset": args.offset,
        "force_before_deadline": args.force_before_deadline,
        "out_of_order": args.out_of_order,
    }


def _usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the command's arguments themselves, found before connecting (the
    checks the library repeats when it is called), or ``None``."""
    try:
        if args.command == "purge":
            check_windows(args.delivered_older_than, args.evidence_older_than, args.batch_size)
        elif args.command == "resolve":
            check_resolution(args.message_id, args.resolution, **_resolution_options(args))
        elif args.command == "retry" and args.quarantined and args.fence is not None:
            return "--fence goes with one message ID, not with --quarantined"
        elif args.command == "retry" and args.quarantined and args.out_of_order:
            return (
                "--out-of-order goes with one message ID, not with --quarantined: decide "
                "each message that later ones of its key overtook by itself"
            )
        elif args.command == "retry" and args.topic and not args.quarantined:
            return "--topic only goes with --quarantined"
        elif args.command == "migrate" and args.create_roles:
            return _role_names(args).problem()
    except ValueError as exc:
        return str(exc)
    return None


def _status(args: argparse.Namespace) -> int:
    with _connect(args.database_url) as conn:
        conn.execute(query("jit_off"))
        lines = read_status(conn)
        held = read_held_keys(conn)
    show = render.status_json if args.json else render.status_text
    print(show(lines, held, topic=args.topic))
    shown = [line for line in lines if args.topic in (None, line.topic)]
    return EXIT_OK if all(line.healthy for line in shown) else EXIT_ACTION_NEEDED


def _inspect(args: argparse.Namespace) -> int:
    with _connect(args.database_url) as conn:
        timeline = read_timeline(conn, args.message_id)
    if timeline is None:
        raise OutboxError(f"no message {args.message_id} (and no evidence of one)")
    print(render.timeline_json(timeline) if args.json else render.timeline_text(timeline))
    return EXIT_ACTION_NEEDED if timeline.needs_action else EXIT_OK


def _list(args: argparse.Namespace) -> int:
    with _connect(args.database_url) as conn:
        listing = list_messages(conn, args.state, topic=args.topic, limit=args.limit)
        now = conn.execute(query("database_now")).fetchone()
    if args.json:
        print(render.listing_json(listing))
    else:
        print(render.listing_text(listing, now=now[0] if now else datetime.now(UTC)))
    return EXIT_OK


def _purge(args: argparse.Namespace) -> int:
    with _connect(args.database_url) as conn:
        try:
            report = purge(
                conn,
                delivered_older_than=args.delivered_older_than,
                evidence_older_than=args.evidence_older_than,
                batch_size=args.batch_size,
                dry_run=args.dry_run,
            )
        except ValueError as exc:
            raise OutboxError(str(exc)) from exc
    if args.json:
        print(render.purge_json(report, dry_run=args.dry_run))
    else:
        print(render.purge_text(report, dry_run=args.dry_run))
    return EXIT_OK


def _resolve(args: argparse.Namespace) -> int:
    with _connect_to_decide(args) as conn:
        try:
            before = resolve(
                conn, args.message_id, args.resolution, args.reason, **_resolution_options(args)
            )
        except ValueError as exc:
            raise OutboxError(str(exc)) from exc
    print(f"message {args.message_id}: {before.value} -> {args.resolution.value} ({args.reason})")
    _warn_if_unfenced(args)
    return EXIT_OK


def _retry(args: argparse.Namespace) -> int:
    with _connect_to_decide(args) as conn:
        if args.quarantined:
            try:
                retried = retry_quarantined(conn, topic=args.topic, reason=args.reason)
            except ValueError as exc:
                raise OutboxError(str(exc)) from exc
            scope = f" of topic {args.topic}" if args.topic else ""
            print(f"{len(retried.moved)} quarantined message(s){scope} -> pending ({args.reason})")
            for message_id, later in retried.overtaken.items():
                print(
                    f"left quarantined: {message_id}: {overtaken_words(later)}; "
                    f"`outbox retry {message_id} --out-of-order` sends it after them, "
                    "`outbox discard` drops it"
                )
            return EXIT_ACTION_NEEDED if retried.overtaken else EXIT_OK
        try:
            before = retry(
                conn, args.message_id, args.reason, fence=args.fence, out_of_order=args.out_of_order
            )
        except ValueError as exc:
            raise OutboxError(str(exc)) from exc
    print(f"message {args.message_id}: {before.value} -> pending ({args.reason})")
    _warn_if_unfenced(args)
    return EXIT_OK


def _discard(args: argparse.Namespace) -> int:
    with _connect_to_decide(args) as conn:
        try:
            before = discard(conn, args.message_id, args.reason, fence=args.fence)
        except ValueError as exc:
            raise OutboxError(str(exc)) from exc
    print(f"message {args.message_id}: {before.value} -> discarded ({args.reason})")
    _warn_if_unfenced(args)
    return EXIT_OK


#: The role each command needs, said when the database refuses it.
NEEDS = {
    "migrate": "`outbox migrate` runs as the owner of the outbox schema",
    "status": "`outbox status` needs the operator (or publisher) role",
    "inspect": "`outbox inspect` needs the operator (or publisher) role",
    "list": "`outbox list` needs the operator (or publisher) role",
    "purge": "`outbox purge` is retention and needs the publisher role",
    "resolve": "`outbox resolve` needs the operator role",
    "retry": "`outbox retry` needs the operator role",
    "discard": "`outbox discard` needs the operator role",
}

COMMANDS = {
    "migrate": _migrate,
    "status": _status,
    "inspect": _inspect,
    "list": _list,
    "purge": _purge,
    "resolve": _resolve,
    "retry": _retry,
    "discard": _discard,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``outbox`` command; return its exit code."""
    try:
        code = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # What was left to print goes nowhere: Python would otherwise print a
        # traceback at exit, flushing into the closed pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_READER_GONE
    return code


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "reconcile":
        print(RECONCILE_MOVED, file=sys.stderr)
        return EXIT_ERROR
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not (args.database_url or "").strip():
        args.command_parser.error("no database: pass --database-url or set OUTBOX_DATABASE_URL")
    if args.command == "migrate" and not args.create_roles:
        named = [f"--{p}-role" for p in RoleNames().by_purpose() if getattr(args, f"{p}_role")]
        if named:
            verb = "goes" if len(named) == 1 else "go"
            args.command_parser.error(
                f"{', '.join(named)} {verb} only with --create-roles: nothing else reads it"
            )
    problem = _usage_problem(args)
    if problem:
        args.command_parser.error(problem)
    url = args.database_url
    try:
        check_conninfo(url)
        return COMMANDS[args.command](args)
    except psycopg.errors.UndefinedTable as exc:
        shown = scrub(said(exc), url)
        print(
            f"outbox: the outbox tables are missing ({shown}); run `outbox migrate`",
            file=sys.stderr,
        )
        return EXIT_ERROR
    except psycopg.errors.InsufficientPrivilege as exc:
        shown = scrub(said(exc), url)
        print(f"outbox: {shown}; {NEEDS[args.command]} (see docs/security.md)", file=sys.stderr)
        return EXIT_ERROR
    except (OutboxError, psycopg.Error) as exc:
        # Every message printed is scrubbed: no form of the URL's password shows.
        print(f"outbox: {scrub(said(exc), url)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
