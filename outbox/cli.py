"""The ``outbox`` command: operator tools for the outbox tables.

Exit codes: 0 when the command succeeded and, for ``status``, when nothing
needs an operator; 1 when ``status`` finds messages that need action or
``reconcile`` leaves messages uncertain; 2 when the command could not run
(bad usage, a refused decision, an unreachable or unmigrated database).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Sequence

import psycopg
import psycopg.errors

from outbox.errors import OutboxError
from outbox.migrations import current_version, migrate
from outbox.operator import (
    Resolution,
    discard,
    operator_name,
    resolve,
    retry,
    retry_quarantined,
)
from outbox.states import State
from outbox.status import HeldKey, StateCount, read_held_keys, read_status

EXIT_OK = 0
EXIT_ACTION_NEEDED = 1
EXIT_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox",
        description="Inspect and maintain the transactional outbox in PostgreSQL.",
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_DATABASE_URL"),
        help="PostgreSQL URL, e.g. postgresql://user@host:5432/db (default: $OUTBOX_DATABASE_URL)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "migrate",
        help="create or upgrade the outbox tables (safe to repeat and to run concurrently)",
        description="Apply the schema migrations this version ships that the database lacks.",
    )
    status = commands.add_parser(
        "status",
        help="message counts by state and the next safe action; exits 1 if action is needed",
        description="Print the outbox.status view. Exit code 1 when a state needs an operator.",
    )
    status.add_argument(
        "--json",
        action="store_true",
        help='print {"counts": {state: n}, "held_keys": [...], "states": [...], "healthy": bool}',
    )
    reconcile = commands.add_parser(
        "reconcile",
        help="recover expired leases and decide uncertain messages from Kafka; "
        "exits 1 if some stay uncertain",
        description="Move in-flight messages whose lease expired (by their evidence), then look "
        "for every uncertain message whose producer can no longer write in its Kafka partition: "
        "found -> delivered, proven absent -> pending, evidence gone -> escalated to you. "
        "Publishers do this on their own at an interval; this runs one pass now.",
    )
    reconcile.add_argument(
        "--kafka-bootstrap",
        default=os.environ.get("OUTBOX_KAFKA_BOOTSTRAP"),
        help="Kafka bootstrap servers, host:port[,...] (default: $OUTBOX_KAFKA_BOOTSTRAP)",
    )
    resolve_cmd = commands.add_parser(
        "resolve",
        help="decide an uncertain or quarantined message by hand, with a reason",
        description="Record an operator's decision on one uncertain (or quarantined) message. "
        "--delivered: it is in Kafka, do not send it; --pending: send it (again; a consumer may "
        "see it twice if it was in Kafka after all); --discard: never deliver it.",
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
    resolve_cmd.add_argument("--partition", type=int, help="with --delivered: where it is")
    resolve_cmd.add_argument("--offset", type=int, help="with --delivered: its offset")
    retry_cmd = commands.add_parser(
        "retry",
        help="send a quarantined message again (releases the key it holds)",
        description="Move one quarantined message, or all of them (--quarantined, optionally "
        "of one --topic), back to pending with a fresh retry budget. Fix what made Kafka refuse "
        "it first. Each decision is recorded.",
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
    discard_cmd = commands.add_parser(
        "discard",
        help="never deliver a pending, quarantined or uncertain message (releases its key)",
        description="Decide that one message will not be delivered. Later messages of its key "
        "then go on without it, so consumers see the key's stream with a gap. Recorded with "
        "the reason.",
    )
    discard_cmd.add_argument("message_id", type=uuid.UUID, metavar="ID", help="the message id")
    discard_cmd.add_argument("--reason", required=True, help="why; stored with the decision")
    return parser


def _key_text(key: bytes) -> str:
    try:
        return key.decode()
    except UnicodeDecodeError:
        return "0x" + key.hex()


def _status_json(lines: list[StateCount], held: list[HeldKey]) -> str:
    return json.dumps(
        {
            "counts": {line.state: line.messages for line in lines},
            "held_keys": [
                {
                    "topic": h.topic,
                    "key": _key_text(h.key),
                    "held_by": str(h.held_by),
                    "state": h.state,
                    "waiting": h.waiting,
                    "reason": h.reason,
                    "next_action": h.next_action,
                }
                for h in held
            ],
            "healthy": all(line.healthy for line in lines),
            "states": [
                {
                    "state": line.state,
                    "messages": line.messages,
                    "oldest_created_at": line.oldest_created_at.isoformat()
                    if line.oldest_created_at
                    else None,
                    "healthy": line.healthy,
                    "next_action": line.next_action,
                }
                for line in lines
            ],
        },
        indent=2,
    )


def _held_table(held: list[HeldKey]) -> str:
    if not held:
        return ""
    out = [f"\nHELD KEYS ({len(held)}): later messages of these keys wait"]
    for h in held:
        out.append(
            f"  {h.topic} / {_key_text(h.key)}: held by {h.held_by} ({h.state}), "
            f"{h.waiting} waiting\n    why: {h.reason}\n    next: {h.next_action}"
        )
    return "\n".join(out)


def _status_table(lines: list[StateCount]) -> str:
    rows = [("STATE", "MESSAGES", "OLDEST", "NEXT ACTION")]
    for line in lines:
        oldest = "-"
        if line.oldest_created_at is not None:
            oldest = line.oldest_created_at.strftime("%Y-%m-%d %H:%M:%S")
        action = "-" if line.healthy else line.next_action
        rows.append((line.state, str(line.messages), oldest, action))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip()
        for r in rows
    )


def _migrate(args: argparse.Namespace) -> int:
    applied = migrate(args.database_url)
    with psycopg.connect(args.database_url) as conn:
        version = current_version(conn)
    names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied) or "none"
    print(f"schema at version {version}; applied now: {names}")
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    with psycopg.connect(args.database_url) as conn:
        lines = read_status(conn)
        held = read_held_keys(conn)
    if args.json:
        print(_status_json(lines, held))
    else:
        print(_status_table(lines) + _held_table(held))
    return EXIT_OK if all(line.healthy for line in lines) else EXIT_ACTION_NEEDED


def _reconcile(args: argparse.Namespace) -> int:
    if not args.kafka_bootstrap:
        raise OutboxError("no Kafka: pass --kafka-bootstrap or set OUTBOX_KAFKA_BOOTSTRAP")
    # The reconciler reads Kafka, which is the publisher's side of the package.
    from publisher.reconciler import Reconciler  # noqa: PLC0415
    from publisher.scanner import KafkaLogScanner  # noqa: PLC0415
    from publisher.store import PublisherStore  # noqa: PLC0415

    store = PublisherStore(args.database_url, uuid.uuid4())
    scanner = KafkaLogScanner(args.kafka_bootstrap)
    try:
        moved = store.recover_expired_leases()
        to_pending = sum(1 for state in moved.values() if state is State.PENDING)
        print(
            f"expired leases recovered: {len(moved)} "
            f"({to_pending} pending, {len(moved) - to_pending} uncertain)"
        )
        reconciler = Reconciler(store, scanner, f"{operator_name()} (outbox reconcile)")
        while True:
            report = reconciler.run_once()
            print(
                f"reconciled: {len(report.delivered)} delivered, {len(report.pending)} pending "
                f"(proven absent), {len(report.escalated)} escalated, "
                f"{len(report.deferred)} deferred"
            )
            if report.decided < reconciler.limit:
                break
        with psycopg.connect(args.database_url) as conn:
            left = {line.state: line.messages for line in read_status(conn)}[State.UNCERTAIN]
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


def _resolve(args: argparse.Namespace) -> int:
    with psycopg.connect(args.database_url) as conn:
        try:
            before = resolve(
                conn,
                args.message_id,
                args.resolution,
                args.reason,
                partition=args.partition,
                offset=args.offset,
            )
        except ValueError as exc:
            raise OutboxError(str(exc)) from exc
    print(f"message {args.message_id}: {before.value} -> {args.resolution.value} ({args.reason})")
    return EXIT_OK


def _retry(args: argparse.Namespace) -> int:
    with psycopg.connect(args.database_url) as conn:
        if args.quarantined:
            ids = retry_quarantined(conn, topic=args.topic, reason=args.reason)
            scope = f" of topic {args.topic}" if args.topic else ""
            print(f"{len(ids)} quarantined message(s){scope} -> pending ({args.reason})")
            return EXIT_OK
        if args.topic:
            raise OutboxError("--topic only goes with --quarantined")
        try:
            before = retry(conn, args.message_id, args.reason)
        except ValueError as exc:
            raise OutboxError(str(exc)) from exc
    print(f"message {args.message_id}: {before.value} -> pending ({args.reason})")
    return EXIT_OK


def _discard(args: argparse.Namespace) -> int:
    with psycopg.connect(args.database_url) as conn:
        try:
            before = discard(conn, args.message_id, args.reason)
        except ValueError as exc:
            raise OutboxError(str(exc)) from exc
    print(f"message {args.message_id}: {before.value} -> discarded ({args.reason})")
    return EXIT_OK


COMMANDS = {
    "migrate": _migrate,
    "status": _status,
    "reconcile": _reconcile,
    "resolve": _resolve,
    "retry": _retry,
    "discard": _discard,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``outbox`` command; return its exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("no database: pass --database-url or set OUTBOX_DATABASE_URL")
    try:
        return COMMANDS[args.command](args)
    except psycopg.errors.UndefinedTable as exc:
        print(
            f"outbox: the outbox tables are missing ({exc}); run `outbox migrate`", file=sys.stderr
        )
        return EXIT_ERROR
    except (OutboxError, psycopg.Error) as exc:
        print(f"outbox: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
