"""Status at scale: what an operator and a metrics scrape read, at 10 million messages.

One database is built at schema version 8 (before migration 0009): 10,000,000
delivered messages straight into ``outbox.messages`` with ``INSERT ...
SELECT generate_series`` (shaped like real rows: four topics of very
different sizes, keyed and unkeyed, a 120-byte value and a header, partition
and offset, UUIDv7 ids spread over the week before, one batch per 1,000),
then some thousands open: quarantined, uncertain (some escalated, some
overdue), pending (some waiting out a retry), in flight in ten open batches
(two with their lease expired), discarded with their decisions, many of them
holding their key back; a live publisher owns the lanes. Then ``VACUUM
ANALYZE``.

Timed there, before, and again after ``outbox migrate`` applied 0009, each
the median of several runs:

* ``SELECT * FROM outbox.status`` on an open connection;
* ``outbox status``, the command, as a subprocess (wall time: the
  interpreter, its imports, connecting, both statements, the table); before
  with the library as it was before 0009 (``--before``: by default the
  parent of the commit that added the migration, taken from git into a
  temporary directory), after with this checkout's; and its two statements
  alone (``outbox.status`` and ``outbox.held_keys``) on an open connection;
* the same command against an empty database migrated alike, alternating
  with the large one: the command's cost that does not depend on the table;
* the metrics' read (``read_open_status``: the ``open_status`` query);
* ``SELECT * FROM outbox.held_keys``.

Beside each median wall time, the CPU time per run, which depends less on
what else the shared machine runs: the PostgreSQL backend's for a statement
(from /proc, so PostgreSQL must run on this machine), the client process's
for the command.

After, every line of the status over the open states is checked against a
full count (the view as 0008 defined it, kept as ``pg_temp``), and the
estimated delivered line is compared with the real count. The plans of the
new status view are written to benchmarks/results/status_explain.txt. The
database is dropped at the end (it takes some 4 GB). Results go to
benchmarks/results/latest.json under "status_scale".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from common import RESULTS_DIR, cpu_seconds, environment, record_results, temporary_database

import outbox
from outbox.migrations import migrate

ROOT = Path(__file__).resolve().parent.parent
EXPLAIN_FILE = RESULTS_DIR / "status_explain.txt"
TARGET_SECONDS = 0.1
OPEN_TOPICS = ("orders", "payments", "shipments", "audit")

# Message i of the history was enqueued %(step)s seconds after message i - 1,
# the last an hour ago, and delivered 15 ms later. Topics: orders 60 %,
# payments 30 %, shipments 9.9 %, audit 0.1 %; one message in ten unkeyed.
HISTORY = """
INSERT INTO outbox.batches (publisher_id, claimed_at, send_began_at, write_deadline,
                            partition_counts, confirmed_offsets, settled_at)
SELECT %(publisher)s, at, at, at + interval '40 seconds', '{}'::jsonb, '{}'::jsonb,
       at + interval '15 ms'
FROM (SELECT to_timestamp(%(start)s + b * 1000 * %(step)s) AS at
      FROM generate_series(0, (%(rows)s - 1) / 1000) AS b) AS batch;

INSERT INTO outbox.messages
    (id, topic, key, value, header_names, header_values, state, created_at, available_at,
     fence, attempts, kafka_partition, kafka_offset, delivered_at, updated_at, batch_id)
SELECT (lpad(to_hex(ms), 12, '0') || '7' || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid,
       CASE WHEN i %% 1000 < 600 THEN 'orders' WHEN i %% 1000 < 900 THEN 'payments'
            WHEN i %% 1000 < 999 THEN 'shipments' ELSE 'audit' END,
       CASE WHEN i %% 10 <> 9
            THEN convert_to('customer-' || lpad((i %% 10000)::text, 5, '0'), 'UTF8') END,
       convert_to(rpad('{"event":"OrderPlaced","seq":' || i || ',"pad":"', 118, 'x') || '"}',
                  'UTF8'),
       '{content-type}', ARRAY[convert_to('application/json', 'UTF8')],
       'delivered', at, at, 1, 1, i %% 3, i / 3, at + interval '15 ms', at + interval '15 ms',
       i / 1000 + 1
FROM (SELECT i, md5(i::text) AS h,
             round((%(start)s + i * %(step)s) * 1000)::bigint AS ms,
             to_timestamp(round((%(start)s + i * %(step)s) * 1000) / 1000.0) AS at
      FROM generate_series(0, %(rows)s - 1) AS i) AS history
"""

# The open messages, enqueued in the last half hour in this order (j): 2,000
# quarantined, 2,000 uncertain (200 escalated, 200 overdue, the others within
# their write deadline), 500 discarded, 4,000 pending (400 waiting out a
# retry; the last 1,000 in flight). Keys repeat every 3,000 messages, so many
# keys have a quarantined or uncertain message with pending ones behind it.
OPEN = """
UPDATE outbox.lanes SET owner = %(publisher)s, lease_expires_at = now() + interval '1 day',
       fence = fence + 1;

INSERT INTO outbox.publishers (id, host, pid, version)
VALUES (%(publisher)s, 'bench', 1, 'bench');

INSERT INTO outbox.messages
    (id, topic, key, value, header_names, header_values, state, created_at, available_at,
     fence, attempts, failures, last_error, escalated_at, batch_id, updated_at)
SELECT (lpad(to_hex(ms), 12, '0') || '7' || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid,
       (%(topics)s::text[])[j %% 4 + 1],
       CASE WHEN j %% 10 <> 9
            THEN convert_to('account-' || lpad((j %% 3000)::text, 4, '0'), 'UTF8') END,
       convert_to('{"event":"OrderPlaced","open":' || j || '}', 'UTF8'),
       '{}', '{}',
       CASE WHEN j < 2000 THEN 'quarantined' WHEN j < 4000 THEN 'uncertain'
            WHEN j < 4500 THEN 'discarded' ELSE 'pending' END,
       at,
       CASE WHEN j BETWEEN 2200 AND 2399 THEN now() - interval '10 minutes'
            WHEN j BETWEEN 2000 AND 3999 THEN now() + interval '1 minute'
            WHEN j BETWEEN 4500 AND 4899 THEN now() + interval '1 hour'
            ELSE at END,
       CASE WHEN j >= 4500 THEN 0 ELSE 1 END,
       CASE WHEN j < 4000 THEN 1 WHEN j < 4500 THEN 1 WHEN j < 4900 THEN 1 ELSE 0 END,
       CASE WHEN j < 2000 THEN 5 WHEN j BETWEEN 4500 AND 4899 THEN 1 ELSE 0 END,
       CASE WHEN j < 2000 THEN 'MessageSizeTooLargeError: the message is 1048712 bytes'
            WHEN j < 2200 THEN 'escalated: the topic was deleted and created again'
            WHEN j < 4000 THEN 'KafkaTimeoutError: no answer within 30 s'
            WHEN j < 4500 THEN 'discarded by an operator: bench'
            WHEN j < 4900 THEN 'KafkaConnectionError: broker away' END,
       CASE WHEN j BETWEEN 2000 AND 2199 THEN now() - interval '1 minute' END,
       CASE WHEN j BETWEEN 2000 AND 3999 THEN 1 END,
       at
FROM (SELECT j, md5('open' || j) AS h,
             round((extract(epoch FROM now()) - 1800 + j * 0.1) * 1000)::bigint AS ms,
             to_timestamp(round((extract(epoch FROM now()) - 1800 + j * 0.1) * 1000) / 1000.0)
                 AS at
      FROM generate_series(0, 8499) AS j) AS open;

INSERT INTO outbox.decisions (message_id, decided_by, from_state, to_state, reason)
SELECT id, 'operator:bench', 'quarantined', 'discarded', 'bench'
FROM outbox.messages WHERE state = 'discarded';

INSERT INTO outbox.batches (publisher_id, claimed_at, send_began_at, write_deadline,
                            lease_expires_at, message_ids, key_hashes)
SELECT %(publisher)s, now(), now(), now() + interval '40 seconds',
       CASE WHEN b < 2 THEN now() - interval '1 minute' ELSE now() + interval '1 hour' END,
       array_agg(id ORDER BY seq),
       coalesce(array_agg(DISTINCT key_hash) FILTER (WHERE key_hash IS NOT NULL), '{}')
FROM (SELECT id, seq, key_hash, (row_number() OVER (ORDER BY seq) - 1) / 100 AS b
      FROM outbox.messages
      WHERE state = 'pending'
      ORDER BY seq DESC
      LIMIT 1000) AS claimed
GROUP BY b
"""


def build(url: str, rows: int) -> float:
    """Fill a database at schema version 8; return the seconds it took."""
    started = time.perf_counter()
    end = time.time() - 3600
    span = 7 * 86_400.0
    params = {
        "publisher": uuid.UUID(int=1),
        "rows": rows,
        "step": span / rows,
        "start": round(end - span, 3),
        "topics": list(OPEN_TOPICS),
    }
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in (HISTORY + ";\n\n" + OPEN).split(";\n\n"):
            with conn.transaction():
                conn.execute(statement, params)
        # The rows this session inserted reach the statistics when it next goes
        # idle, at most once a second: reported after VACUUM, they would be
        # counted twice in the live rows the estimate starts from.
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")
    return time.perf_counter() - started


def timed(
    run: Callable[[], object], runs: int, cpu: Callable[[], float]
) -> tuple[list[float], float]:
    """Seconds of each of ``runs`` calls (after one untimed call), and the CPU seconds
    ``cpu`` counts per call: less at the mercy of what else the machine runs."""
    run()
    seconds = []
    cpu_before = cpu()
    for _ in range(runs):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return seconds, (cpu() - cpu_before) / runs


def children_cpu() -> float:
    """CPU seconds of this process's finished children (the commands run)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reader(url: str, statement: str) -> tuple[psycopg.Connection[Any], Callable[[], object]]:
    """An open connection, and a call that runs ``statement`` on it and fetches every row."""
    conn = psycopg.connect(url, autocommit=True)
    return conn, lambda: conn.execute(statement).fetchall()


def command(url: str, code: Path) -> Callable[[], object]:
    """``outbox status`` as a subprocess, on the code under ``code``."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    argv = [sys.executable, "-m", "outbox.cli", "--database-url", url, "status"]

    def run() -> object:
        # Run from the code's own directory: ``-m`` puts the working directory first
        # on the path, where another checkout's ``outbox`` would shadow it.
        done = subprocess.run(argv, env=env, cwd=code, capture_output=True, text=True, check=False)
        if done.returncode not in (0, 1):
            raise SystemExit(f"outbox status failed ({done.returncode}): {done.stderr}")
        return done.stdout

    return run


@contextlib.contextmanager
def library_at(revision: str) -> Iterator[Path]:
    """The ``outbox`` package as of ``revision``, in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="outbox_before_") as directory:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", revision, "outbox"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
        yield Path(directory)


def before_0009() -> str:
    """The commit before the one that added the status migration (whatever its number)."""
    added = subprocess.run(
        [
            "git",
            "-C",
            str(ROOT),
            "log",
            "--diff-filter=A",
            "--format=%H",
            "-1",
            "--",
            ":(glob)schema/*_status_at_scale.sql",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not added:
        raise SystemExit("no commit adds schema/*_status_at_scale.sql: pass --before REV")
    return f"{added}^"


def compiled(code: Path) -> None:
    """Byte-compile the packages under ``code``, as an installed wheel ships them.

    The environment may forbid writing bytecode (PYTHONDONTWRITEBYTECODE): then
    a checkout's modules would be compiled again at every start of the command.
    """
    packages = [str(code / name) for name in ("outbox", "publisher") if (code / name).is_dir()]
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", *packages], check=True, stdout=subprocess.DEVNULL
    )


def measure(
    url: str, empty_url: str, code: Path, runs: int, command_runs: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Every figure, on the database as it is now: seconds of each run, and CPU
    seconds per run (the server's backend for a statement, the client for a command)."""
    from outbox.status import read_open_status  # noqa: PLC0415 - the code being measured

    figures: dict[str, list[float]] = {}
    cpu: dict[str, float] = {}
    conn, status = reader(url, "SELECT * FROM outbox.status")
    with conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        backend = row[0]

        def backend_cpu() -> float:
            seconds = cpu_seconds(backend)
            if seconds is None:
                raise SystemExit("cannot read the backend's CPU time: is PostgreSQL local?")
            return seconds

        held_sql = "SELECT * FROM outbox.held_keys ORDER BY topic, key"
        for name, run in (
            ("status_view", status),
            ("held_keys", lambda: conn.execute(held_sql).fetchall()),
            ("command_statements", lambda: (status(), conn.execute(held_sql).fetchall())),
            ("metrics_read", lambda: read_open_status(conn)),
        ):
            figures[name], cpu[name] = timed(run, runs, backend_cpu)
    big, empty = command(url, code), command(empty_url, code)
    big(), empty()  # warm
    figures["command"], figures["command_empty_database"] = [], []
    cpu["command"] = cpu["command_empty_database"] = 0.0
    for _ in range(command_runs):
        for name, run in (("command", big), ("command_empty_database", empty)):
            started, cpu_before = time.perf_counter(), children_cpu()
            run()
            figures[name].append(time.perf_counter() - started)
            cpu[name] += (children_cpu() - cpu_before) / command_runs
    return figures, cpu


OLD_STATUS_MARK = "CREATE OR REPLACE VIEW outbox.status AS"
OLD_HELD_MARK = "CREATE OR REPLACE VIEW outbox.held_keys AS"


def reference_views(conn: psycopg.Connection[Any]) -> None:
    """0008's held_keys and status, as pg_temp views: a full count to check against."""
    text = (ROOT / "schema" / "0008_current_commands.sql").read_text()
    held = text[text.index(OLD_HELD_MARK) : text.index("-- outbox.status as in 0007")]
    status = text[text.index(OLD_STATUS_MARK) :]
    conn.execute(held.replace("VIEW outbox.held_keys", "VIEW pg_temp.held_keys_0008"))
    conn.execute(
        status.replace("VIEW outbox.status", "VIEW pg_temp.status_0008").replace(
            "FROM outbox.held_keys", "FROM pg_temp.held_keys_0008"
        )
    )


def check(url: str) -> dict[str, Any]:
    """Compare the new status with 0008's full count: open lines equal, delivered close."""
    columns = (
        "topic, state, messages, oldest_created_at, waiting_retry, retrying, attempts, "
        "max_failures, lease_owners, next_lease_expiry, leases_expired, escalated, overdue, "
        "held_keys, live_publishers, healthy, next_action"
    )
    with psycopg.connect(url) as conn:
        reference_views(conn)
        open_states = "('pending', 'in_flight', 'uncertain', 'quarantined', 'discarded')"
        new = conn.execute(
            f"SELECT {columns} FROM outbox.status WHERE state IN {open_states}"
        ).fetchall()
        old = conn.execute(
            f"SELECT {columns} FROM pg_temp.status_0008 WHERE state IN {open_states}"
        ).fetchall()
        if new != old:
            raise SystemExit("the open and discarded lines differ from 0008's full count")
        held_new = conn.execute("SELECT * FROM outbox.held_keys ORDER BY topic, key").fetchall()
        held_old = conn.execute(
            "SELECT * FROM pg_temp.held_keys_0008 ORDER BY topic, key"
        ).fetchall()
        if held_new != held_old:
            raise SystemExit("outbox.held_keys differs from 0008's")
        delivered = conn.execute(
            "SELECT coalesce(topic, 'all topics'), messages, exact FROM outbox.status "
            "WHERE state = 'delivered' ORDER BY topic NULLS FIRST"
        ).fetchall()
        real: dict[str, int] = dict(
            conn.execute(
                "SELECT coalesce(topic, 'all topics'), count(*) FROM outbox.messages "
                "WHERE state = 'delivered' GROUP BY ROLLUP (topic)"
            ).fetchall()
        )
    return {
        "open_lines_checked": len(new),
        "held_keys_checked": len(held_new),
        "delivered_estimate": {
            topic: {"shown": n, "exact": exact, "real": real.get(topic)}
            for topic, n, exact in delivered
        },
    }


def explain(url: str) -> tuple[str, float]:
    """The status view's plan as it ran, and its estimated cost (JIT starts at 100,000)."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) SELECT * FROM outbox.status"
        ).fetchall()
        plan = conn.execute("EXPLAIN (FORMAT JSON) SELECT * FROM outbox.status").fetchone()
    assert plan is not None
    return "\n".join(r[0] for r in rows), float(plan[0][0]["Plan"]["Total Cost"])


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1)


def main() -> None:
    """Build, measure before, migrate, measure after, check, record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000_000, help="delivered messages")
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each statement")
    parser.add_argument("--before-runs", type=int, default=3, help="the same, before 0009")
    parser.add_argument("--command-runs", type=int, default=7, help="runs of the command")
    parser.add_argument(
        "--before",
        metavar="REV",
        help="the git revision whose library the command runs before 0009 "
        "(default: the parent of the commit that added the migration)",
    )
    args = parser.parse_args()
    base_url, _ = environment()
    if Path(outbox.__file__).resolve().parent != ROOT / "outbox":
        raise SystemExit(f"outbox is imported from {outbox.__file__}: run with PYTHONPATH={ROOT}")
    compiled(ROOT)
    load_start = [round(x, 1) for x in os.getloadavg()]
    with (
        library_at(args.before or before_0009()) as before_code,
        temporary_database(base_url, "outbox_bench_status", target=8) as (_, url),
        temporary_database(base_url, "outbox_bench_status_empty", target=8) as (_, empty_url),
    ):
        print(f"building {args.messages:,} delivered messages, 8,000 open and 500 discarded ...")
        seconds = build(url, args.messages)
        with psycopg.connect(url) as conn:
            size = conn.execute(
                "SELECT pg_size_pretty(pg_relation_size('outbox.messages')), "
                "pg_size_pretty(pg_total_relation_size('outbox.messages'))"
            ).fetchone()
        assert size is not None
        print(f"built in {seconds:.0f} s: outbox.messages {size[0]}, {size[1]} with indexes")
        compiled(before_code)
        before, before_cpu = measure(
            url, empty_url, before_code, args.before_runs, args.before_runs
        )
        started = time.perf_counter()
        applied = migrate(url)
        migrated = time.perf_counter() - started
        migrate(empty_url)
        print(
            f"migrated ({', '.join(f'{m.version:04d}_{m.name}' for m in applied)}) "
            f"in {migrated:.2f} s"
        )
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("ANALYZE outbox.decisions")
        after, after_cpu = measure(url, empty_url, ROOT, args.runs, args.command_runs)
        checked = check(url)
        plan, cost = explain(url)
    EXPLAIN_FILE.write_text(
        f"SELECT * FROM outbox.status after migration 0009, EXPLAIN (ANALYZE, BUFFERS, COSTS "
        f"OFF), {args.messages:,} delivered messages, 8,000 open and 500 discarded (see "
        f"benchmarks/status_scale.py); written {datetime.now(UTC):%Y-%m-%d}.\n\n{plan}\n"
    )
    print()
    print(f"{'median ms (CPU ms per run)':<28} {'before':>18} {'after':>14}")
    for name in before:
        print(
            f"{name:<28} {median_ms(before[name]):>9} ({before_cpu[name] * 1000:>6.1f}) "
            f"{median_ms(after[name]):>7} ({after_cpu[name] * 1000:>5.1f})"
        )
    print(
        "CPU: the PostgreSQL backend's for a statement, the client process's for a command "
        "(its statements' server time not included)"
    )
    print(f"delivered, as shown and counted: {checked['delivered_estimate']}")
    print(f"status view: estimated cost {cost:,.0f} (JIT from 100,000); plan in {EXPLAIN_FILE}")
    print(f"load average: at start {load_start}, at end {list(os.getloadavg())}")
    under = {
        name: median_ms(after[name]) < TARGET_SECONDS * 1000
        for name in ("status_view", "command_statements", "metrics_read", "held_keys")
    }
    record_results(
        "status_scale",
        {
            "messages": args.messages,
            "open_messages": 8_000,
            "discarded_messages": 500,
            "table": {"heap": size[0], "with_indexes": size[1]},
            "build_seconds": round(seconds),
            "migration_0009_seconds": round(migrated, 2),
            "before_ms": {k: [round(v * 1000, 1) for v in vs] for k, vs in before.items()},
            "after_ms": {k: [round(v * 1000, 1) for v in vs] for k, vs in after.items()},
            "median_before_ms": {k: median_ms(v) for k, v in before.items()},
            "median_after_ms": {k: median_ms(v) for k, v in after.items()},
            "cpu_ms_per_run_before": {k: round(v * 1000, 1) for k, v in before_cpu.items()},
            "cpu_ms_per_run_after": {k: round(v * 1000, 1) for k, v in after_cpu.items()},
            "check": checked,
            "status_estimated_cost": round(cost),
            "load_average": {"start": load_start, "end": [round(x, 1) for x in os.getloadavg()]},
            "target_ms": TARGET_SECONDS * 1000,
            "under_target_after": under,
        },
    )
    print(
        f"status_scale: outbox.status {median_ms(before['status_view'])} -> "
        f"{median_ms(after['status_view'])} ms at {args.messages:,} messages "
        f"(target under {TARGET_SECONDS * 1000:g} ms; {'met' if all(under.values()) else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
