"""Enqueue cost: a business transaction with and without one ``outbox.enqueue``.

The business transaction is two statements on tables of the benchmark's own
(insert an order, update its customer's row), committed. The same
transaction with one ``outbox.enqueue`` added (a keyed JSON event of about
70 bytes) is timed side by side: blocks of 100 of each alternate, so the
noise of a shared machine hits both alike, 3,000 of each by default, on one
psycopg 3 connection (the type the library documents), after a warm-up. The
ratio of the means is the figure to judge.

Then the protocol itself: libpq's trace of a few transactions of each kind
counts the round trips (each Sync or simple Query waits for the server),
statements and commits per transaction, and PostgreSQL's own count of
commits in the database (``pg_stat_database.xact_commit``) checks the
commits. The enqueue should add one statement, one round trip and no
commit.

The same comparison runs once more with ``synchronous_commit = off`` (no
wait for the WAL flush at commit), where the enqueue's own cost is a larger
share. Results go to benchmarks/results/latest.json under "enqueue_cost".
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from common import (
    database_url,
    environment,
    percentile,
    record_results,
    temporary_database,
)
from psycopg import pq

import outbox

TARGET_RATIO = 1.2
CUSTOMERS = 1_000
TOPIC = "orders"


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds of one transaction: in all, in the enqueue call, in the commit."""

    total: float
    enqueue: float
    commit: float


TABLES = """
CREATE TABLE bench_customers (
    id         integer PRIMARY KEY,
    name       text NOT NULL,
    orders     integer NOT NULL DEFAULT 0,
    spent      numeric(12, 2) NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO bench_customers (id, name)
SELECT i, 'customer ' || i FROM generate_series(0, {customers} - 1) AS i;
CREATE TABLE bench_orders (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer_id integer NOT NULL REFERENCES bench_customers (id),
    total       numeric(10, 2) NOT NULL,
    status      text NOT NULL DEFAULT 'placed',
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX bench_orders_customer ON bench_orders (customer_id);
VACUUM ANALYZE bench_customers;
"""


def transaction(conn: psycopg.Connection[Any], n: int, *, enqueue: bool) -> Timing:
    """One business transaction, committed; seconds from its first statement to the commit."""
    customer = n % CUSTOMERS
    total = f"{(n % 9_000) / 100 + 10:.2f}"
    start = time.perf_counter()
    row = conn.execute(
        "INSERT INTO bench_orders (customer_id, total) VALUES (%s, %s) RETURNING id",
        (customer, total),
    ).fetchone()
    conn.execute(
        "UPDATE bench_customers SET orders = orders + 1, spent = spent + %s, updated_at = now() "
        "WHERE id = %s",
        (total, customer),
    )
    before_enqueue = time.perf_counter()
    if enqueue:
        assert row is not None
        outbox.enqueue(
            conn,
            TOPIC,
            {"type": "OrderPlaced", "order": row[0], "customer": customer, "total": total},
            key=f"customer-{customer:04d}",
        )
    before_commit = time.perf_counter()
    conn.commit()
    end = time.perf_counter()
    return Timing(end - start, before_commit - before_enqueue, end - before_commit)


def timed(
    conn: psycopg.Connection[Any], iterations: int, block: int, warmup: int
) -> tuple[list[Timing], list[Timing]]:
    """Per-transaction seconds without and with the enqueue, in alternating blocks."""
    n = 0
    for _ in range(warmup):
        for enqueue in (False, True):
            transaction(conn, n, enqueue=enqueue)
            n += 1
    plain: list[Timing] = []
    with_enqueue: list[Timing] = []
    while len(plain) < iterations:
        size = min(block, iterations - len(plain))
        for enqueue, into in ((False, plain), (True, with_enqueue)):
            for _ in range(size):
                into.append(transaction(conn, n, enqueue=enqueue))
                n += 1
    return plain, with_enqueue


def protocol(url: str, count: int) -> dict[str, dict[str, float]]:
    """Round trips, statements and commits per transaction, from libpq's trace."""
    figures = {}
    for enqueue in (False, True):
        with psycopg.connect(url) as conn, tempfile.TemporaryDirectory() as tmp:
            for n in range(10):  # past psycopg's prepare threshold, as in a long-lived service
                transaction(conn, n, enqueue=enqueue)
            path = Path(tmp) / "trace"
            with path.open("w") as f:
                conn.pgconn.trace(f.fileno())
                conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
                for n in range(count):
                    transaction(conn, 100 + n, enqueue=enqueue)
                conn.pgconn.untrace()
            sent: Counter[str] = Counter()
            transactions = 0
            for line in path.read_text().splitlines():
                parts = line.split("\t")
                if len(parts) < 3:  # direction, length, message
                    continue
                direction, message = parts[0], parts[2].strip()
                detail = parts[3].strip() if len(parts) > 3 else ""
                if direction == "F":
                    sent[message] += 1
                    if message == "Query":
                        sent[detail.strip('"').upper()] += 1
                elif message == "ReadyForQuery" and detail == "I":
                    transactions += 1
        if transactions != count:
            raise SystemExit(f"trace shows {transactions} transactions, expected {count}")
        figures["with_enqueue" if enqueue else "plain"] = {
            "round_trips": (sent["Sync"] + sent["Query"]) / count,
            # Besides BEGIN and COMMIT, which psycopg sends as simple queries.
            "statements": (sent["Execute"] + sent["Query"] - sent["BEGIN"] - sent["COMMIT"])
            / count,
            "commits": sent["COMMIT"] / count,
        }
    return figures


def commits_counted(base_url: str, url: str, name: str, count: int) -> dict[str, int]:
    """PostgreSQL's own count of commits in the database for ``count`` transactions of each kind.

    The transactions run on a connection that is closed before reading (a
    backend flushes its statistics when it exits); the reader sits in another
    database, and autovacuum is off for the tables written. Whatever else
    commits in the database meanwhile can only add, so each kind is counted
    three times and the least is kept.
    """
    with psycopg.connect(url, autocommit=True) as conn:
        for table in ("bench_orders", "bench_customers", "outbox.messages"):
            conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    counted = {}
    with psycopg.connect(database_url(base_url, "postgres"), autocommit=True) as stats:

        def commits() -> int:
            row = stats.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (name,)
            ).fetchone()
            assert row is not None
            return int(row[0])

        def settled() -> int:
            """The count once it has stood still for half a second (flushes arrive late)."""
            last, deadline = commits(), time.monotonic() + 10
            while True:
                time.sleep(0.5)
                now = commits()
                if now == last or time.monotonic() > deadline:
                    return now
                last = now

        for kind, transactions in (
            ("connection only", 0),
            ("plain", count),
            ("with_enqueue", count),
        ):
            deltas = []
            for _ in range(3):
                before = settled()
                with psycopg.connect(url) as conn:
                    for n in range(transactions):
                        transaction(conn, 1_000 + n, enqueue=kind == "with_enqueue")
                deltas.append(settled() - before)
            counted[kind] = min(deltas)
    return counted


def compare(url: str, args: argparse.Namespace, *, synchronous: bool) -> dict[str, Any]:
    with psycopg.connect(url) as conn:
        if not synchronous:
            conn.execute("SET synchronous_commit = off")
            conn.commit()
        plain, with_enqueue = timed(conn, args.iterations, args.block, args.warmup)
    label = "synchronous_commit on" if synchronous else "synchronous_commit off"
    print(f"{label}: {args.iterations} transactions each, in alternating blocks of {args.block}")
    result: dict[str, Any] = {}
    for name, timings in (("plain", plain), ("with_enqueue", with_enqueue)):
        ms = [t.total * 1000 for t in timings]
        figures = {
            "mean_ms": round(statistics.fmean(ms), 4),
            "median_ms": round(statistics.median(ms), 4),
            "p99_ms": round(percentile(ms, 99), 4),
            "enqueue_call_mean_ms": round(statistics.fmean(t.enqueue for t in timings) * 1000, 4),
            "commit_mean_ms": round(statistics.fmean(t.commit for t in timings) * 1000, 4),
        }
        result[name] = figures
        print(
            f"  {name.replace('_', ' '):<13} mean {figures['mean_ms']:.3f} ms  "
            f"median {figures['median_ms']:.3f} ms  p99 {figures['p99_ms']:.3f} ms  "
            f"(commit {figures['commit_mean_ms']:.3f} ms)"
        )
    a, b = result["plain"], result["with_enqueue"]
    result["ratio_of_means"] = round(b["mean_ms"] / a["mean_ms"], 3)
    result["ratio_of_medians"] = round(b["median_ms"] / a["median_ms"], 3)
    added = b["mean_ms"] - a["mean_ms"]
    print(
        f"  ratio with / without: means {result['ratio_of_means']:.3f}, medians "
        f"{result['ratio_of_medians']:.3f}; the enqueue adds {added:.3f} ms a transaction: "
        f"{b['enqueue_call_mean_ms']:.3f} ms in the call, "
        f"{b['commit_mean_ms'] - a['commit_mean_ms']:.3f} ms more in the commit"
    )
    return result


def main() -> None:
    """Time both kinds of transaction, count their round trips, print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3_000, help="transactions of each kind")
    parser.add_argument("--block", type=int, default=100, help="transactions per block")
    parser.add_argument("--warmup", type=int, default=200, help="untimed transactions of each kind")
    parser.add_argument("--trace", type=int, default=50, help="transactions of each kind traced")
    args = parser.parse_args()
    base_url, _ = environment()
    with temporary_database(base_url, "outbox_bench_enqueue") as (name, url):
        with psycopg.connect(url, autocommit=True) as conn:
            for statement in TABLES.format(customers=CUSTOMERS).split(";\n"):
                if statement.strip():
                    conn.execute(statement)
        durable = compare(url, args, synchronous=True)
        relaxed = compare(url, args, synchronous=False)
        trips = protocol(url, args.trace)
        commits = commits_counted(base_url, url, name, args.trace)

    print(f"protocol, from libpq's trace of {args.trace} transactions of each kind:")
    for kind, figures in trips.items():
        print(
            f"  {kind:<13} round trips {figures['round_trips']:.2f}  statements "
            f"{figures['statements']:.2f}  commits {figures['commits']:.2f} per transaction"
        )
    added_trips = trips["with_enqueue"]["round_trips"] - trips["plain"]["round_trips"]
    added_statements = trips["with_enqueue"]["statements"] - trips["plain"]["statements"]
    added_commits = trips["with_enqueue"]["commits"] - trips["plain"]["commits"]
    print(
        f"  the enqueue adds {added_statements:g} statement(s), {added_trips:g} round trip(s), "
        f"{added_commits:g} commit(s)"
    )
    print(
        f"pg_stat_database.xact_commit for a connection with {args.trace} transactions of each "
        f"kind: plain {commits['plain']}, with enqueue {commits['with_enqueue']} (a connection "
        f"with none: {commits['connection only']})"
    )
    ratio = durable["ratio_of_means"]
    record_results(
        "enqueue_cost",
        {
            "iterations": args.iterations,
            "block": args.block,
            "synchronous_commit_on": durable,
            "synchronous_commit_off": relaxed,
            "per_transaction": trips,
            "added_by_enqueue": {
                "statements": added_statements,
                "round_trips": added_trips,
                "commits": added_commits,
            },
            "xact_commit_delta": commits,
            "target_ratio": TARGET_RATIO,
            "target_met": ratio <= TARGET_RATIO,
        },
    )
    print(
        f"enqueue cost: ratio with / without enqueue {ratio:.3f} (target {TARGET_RATIO:g}; "
        f"{'met' if ratio <= TARGET_RATIO else 'MISSED'}), with synchronous_commit off "
        f"{relaxed['ratio_of_means']:.3f}; the enqueue adds {added_trips:g} round trip(s) "
        f"and {added_commits:g} commit(s)"
    )


if __name__ == "__main__":
    main()
