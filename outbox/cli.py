"""The ``outbox`` command: operator tools for the outbox tables.

Exit codes: 0 when the command succeeded and, for ``status``, when nothing
needs an operator; 1 when ``status`` finds messages that need action; 2 when
the command could not run (bad usage, unreachable or unmigrated database).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import psycopg
import psycopg.errors

from outbox.errors import OutboxError
from outbox.migrations import current_version, migrate
from outbox.status import StateCount, read_status

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
        help='print {"counts": {state: n}, "states": [...], "healthy": bool}',
    )
    return parser


def _status_json(lines: list[StateCount]) -> str:
    return json.dumps(
        {
            "counts": {line.state: line.messages for line in lines},
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``outbox`` command; return its exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("no database: pass --database-url or set OUTBOX_DATABASE_URL")
    try:
        if args.command == "migrate":
            applied = migrate(args.database_url)
            with psycopg.connect(args.database_url) as conn:
                version = current_version(conn)
            names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied) or "none"
            print(f"schema at version {version}; applied now: {names}")
            return EXIT_OK
        with psycopg.connect(args.database_url) as conn:
            lines = read_status(conn)
        print(_status_json(lines) if args.json else _status_table(lines))
        return EXIT_OK if all(line.healthy for line in lines) else EXIT_ACTION_NEEDED
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
