"""Growth: end-to-end throughput on an empty table vs one holding a large history.

The throughput benchmark's records (``throughput.make_records``: about 200
bytes, keyed over 1,000 keys) are enqueued as pending intents and delivered
by one in-process publisher with ``--exit-when-idle``, timed from its start
until the last confirmation is stored, as in ``throughput.py``. Once into a
database whose outbox is empty, once into one whose ``outbox.messages``
already holds 1,000,000 delivered and 100,000 quarantined messages of
another topic (shaped like real rows: key, 200-byte value, content-type
header, partition and offset, delivered_at or last_error, UUIDv7 ids in the
past, with their attempt and batch records), vacuumed and analysed.

Both databases are built once as templates and copied for every round
(``CREATE DATABASE ... TEMPLATE``); rounds alternate (empty, history,
history, empty, ...) so drift on a shared machine hits both alike. The
ratio of the median rates, history / empty, is the figure to judge.

The claim statement's plan on both, ``EXPLAIN (ANALYZE, BUFFERS)`` with a
full batch pending, is saved to benchmarks/results/claim_explain.txt.
Results go to benchmarks/results/latest.json under "growth".
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import psycopg
from common import (
    KEYS,
    RESULTS_DIR,
    CpuWatch,
    create_database,
    delete_topic,
    drop_database,
    environment,
    kafka_pids,
    make_records,
    new_topic,
    postgres_groups,
    publisher_on_backlog,
    record_results,
    temporary_database,
)

import outbox
from outbox.migrations import migrate
from publisher.store import claim_statement

TARGET_RATIO = 0.9
EXPLAIN_FILE = RESULTS_DIR / "claim_explain.txt"
HISTORY_TOPIC = "orders-history"
QUARANTINE_ERROR = (
    "MessageSizeTooLargeError: the message is 1048712 bytes when serialized, larger than the "
    "maximum request size"
)

# One statement per table. Message i of the history was enqueued about two
# seconds after message i - 1, ending about a day ago; every eleventh was
# quarantined, the others were delivered 15 ms after they were enqueued.
FILL = """
INSERT INTO outbox.batches (publisher_id, claimed_at, send_began_at, write_deadline,
                            partition_counts, confirmed_offsets, settled_at)
SELECT %(publisher)s, at, at, at + interval '40 seconds',
       jsonb_build_object(%(topic)s::text, 3), '{}'::jsonb, at + interval '15 ms'
FROM (SELECT to_timestamp(%(start)s) + make_interval(secs => b * 1000 * 2.0) AS at
      FROM generate_series(0, (%(rows)s - 1) / 1000) AS b) AS batch;

INSERT INTO outbox.messages
    (id, topic, key, value, header_names, header_values, state, created_at, available_at,
     fence, attempts, kafka_partition, kafka_offset, delivered_at, updated_at, last_error,
     batch_id)
SELECT (lpad(to_hex(ms), 12, '0') || '7' || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid,
       %(topic)s, convert_to('customer-' || lpad((i %% 1000)::text, 4, '0'), 'UTF8'),
       convert_to(rpad('{"event":"OrderPlaced","seq":' || i || ',"pad":"', 198, 'x') || '"}',
                  'UTF8'),
       '{content-type}', ARRAY[convert_to('application/json', 'UTF8')],
       CASE WHEN quarantined THEN 'quarantined' ELSE 'delivered' END,
       at, at, 1, 1, i %% 3, CASE WHEN quarantined THEN NULL ELSE i / 3 END,
       CASE WHEN quarantined THEN NULL ELSE at + interval '15 ms' END,
       at + interval '15 ms',
       CASE WHEN quarantined THEN %(error)s END,
       i / 1000 + 1
FROM (SELECT i, i %% 11 = 10 AS quarantined, md5(i::text) AS h,
             (%(start)s * 1000)::bigint + i::bigint * 2000 AS ms,
             to_timestamp(%(start)s) + make_interval(secs => i * 2.0) AS at
      FROM generate_series(0, %(rows)s - 1) AS i) AS history
ORDER BY i;

INSERT INTO outbox.attempts
    (message_id, attempt, publisher_id, fence, started_at, send_began, finished_at, outcome,
     error, kafka_partition, kafka_offset, batch_id)
SELECT id, 1, %(publisher)s, 1, created_at, true, updated_at, 'failed',
       last_error, kafka_partition, kafka_offset, batch_id
FROM outbox.messages
WHERE state = 'quarantined';

INSERT INTO outbox.partition_offsets (topic, kafka_partition, confirmed_offset)
SELECT topic, kafka_partition, max(kafka_offset)
FROM outbox.messages
WHERE state = 'delivered'
GROUP BY topic, kafka_partition
"""


def build_history(url: str, rows: int) -> None:
    """Fill a migrated database with ``rows`` settled messages (1 in 11 quarantined)."""
    params = {
        "publisher": uuid.UUID(int=1),
        "topic": HISTORY_TOPIC,
        # The last message was enqueued a day ago.
        "start": round(time.time() - 86_400 - rows * 2.0, 3),
        "rows": rows,
        "error": QUARANTINE_ERROR,
    }
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in FILL.split(";\n\n"):
            with conn.transaction():
                conn.execute(statement, params)
        conn.execute("VACUUM (ANALYZE, FREEZE)")
        conn.execute("CHECKPOINT")


def explain_claim(url: str, batch_size: int) -> tuple[str, str]:
    """The claim's plan as the publisher runs it: the first claim of the backlog, and the
    next one while that first batch is still in flight. Nothing is kept (rolled back)."""
    owner = uuid.uuid4()
    with psycopg.connect(url) as conn:
        conn.execute("SET LOCAL jit = off")
        conn.execute(
            "UPDATE outbox.lanes SET owner = %s, lease_expires_at = now() + interval '1 hour'",
            (owner,),
        )
        # The first claim has no horizon; the next is a claim-ahead, with one.
        plans = [
            "\n".join(
                r[0]
                for r in conn.execute(
                    "EXPLAIN (ANALYZE, BUFFERS) "
                    + claim_statement(
                        owner=owner,
                        lease_seconds=60.0,
                        limit=batch_size,
                        horizon=2 * batch_size if ahead else None,
                    )
                ).fetchall()
            )
            for ahead in (False, True)
        ]
        conn.rollback()
    return plans[0], plans[1]


def deliver(
    url: str, bootstrap: str, records: list[outbox.Message], batch_size: int
) -> tuple[float, int, tuple[str, str], dict[str, float]]:
    """Enqueue ``records`` and deliver them; seconds, batches, the claim's plans, CPU seconds."""
    topic = new_topic(bootstrap)
    try:
        plans: list[tuple[str, str]] = []
        # The claim's plans on the analysed backlog (rolled back, then vacuumed away).
        publisher = publisher_on_backlog(
            url,
            bootstrap,
            topic,
            records,
            batch_size,
            before_checkpoint=lambda: plans.append(explain_claim(url, batch_size)),
        )
        [plan] = plans
        database = url.rsplit("/", 1)[1]

        def groups() -> dict[str, list[int]]:
            return {
                "publisher (in process)": [os.getpid()],
                **postgres_groups(database),
                "kafka": kafka_pids(),
            }

        with CpuWatch(groups) as cpu:
            start = time.perf_counter()
            totals = publisher.run()
            elapsed = time.perf_counter() - start
        with psycopg.connect(url) as conn:
            delivered = conn.execute(
                "SELECT count(*) FROM outbox.messages WHERE state = 'delivered' AND topic = %s",
                (topic,),
            ).fetchone()
        if delivered != (len(records),) or totals.delivered != len(records):
            raise SystemExit(f"delivered {delivered}, expected {len(records)}")
        return elapsed, totals.batches, plan, cpu.used()
    finally:
        delete_topic(bootstrap, topic)


def table_size(url: str) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT pg_size_pretty(pg_total_relation_size('outbox.messages')), "
            "(SELECT count(*) FROM outbox.messages)"
        ).fetchone()
    assert row is not None
    return f"{row[1]:,} rows, {row[0]} with indexes"


def main() -> None:
    """Alternate rounds on copies of both templates; print rates and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each")
    parser.add_argument("--batch-size", type=int, default=1_000)
    parser.add_argument("--history", type=int, default=1_100_000, help="rows already stored")
    args = parser.parse_args()
    base_url, bootstrap = environment()
    records = make_records(args.messages)
    suffix = uuid.uuid4().hex[:8]
    empty_template = f"outbox_bench_growth_empty_{suffix}"
    history_template = f"outbox_bench_growth_history_{suffix}"
    rates: dict[str, list[float]] = {"empty": [], "history": []}
    cpu_seconds: dict[str, list[dict[str, float]]] = {"empty": [], "history": []}
    plans: dict[str, tuple[str, str]] = {}
    sizes: dict[str, str] = {}
    try:
        migrate(create_database(base_url, empty_template))
        history_url = create_database(base_url, history_template)
        migrate(history_url)
        started = time.perf_counter()
        build_history(history_url, args.history)
        print(
            f"history template built in {time.perf_counter() - started:.0f} s "
            f"({args.history:,} messages, 1 in 11 quarantined)"
        )
        print(
            f"{args.messages:,} records per round, publisher batch {args.batch_size}, "
            f"{args.rounds} rounds of each, alternating"
        )
        order = [("empty", "history"), ("history", "empty")] * args.rounds
        for round_no, pair in enumerate(order[: args.rounds], 1):
            for kind in pair:
                template = empty_template if kind == "empty" else history_template
                with temporary_database(base_url, "outbox_bench_growth", template=template) as (
                    _,
                    url,
                ):
                    seconds, batches, plan, used = deliver(url, bootstrap, records, args.batch_size)
                    plans.setdefault(kind, plan)
                    sizes.setdefault(kind, table_size(url))
                rate = args.messages / seconds
                rates[kind].append(rate)
                cpu_text = "  ".join(f"{k} {v:.1f}" for k, v in used.items() if v >= 0.05)
                print(
                    f"round {round_no}: {kind:<7} {rate:7,.0f} msg/s  ({seconds:.1f} s, "
                    f"{batches} batches; CPU seconds: {cpu_text})"
                )
                cpu_seconds[kind].append({k: round(v, 2) for k, v in used.items()})
    finally:
        for name in (empty_template, history_template):
            drop_database(base_url, name)

    empty, history = statistics.median(rates["empty"]), statistics.median(rates["history"])
    ratio = history / empty
    EXPLAIN_FILE.write_text(
        f"claim_batch (outbox/queries.sql), EXPLAIN (ANALYZE, BUFFERS), jit off, limit "
        f"{args.batch_size}, {args.messages:,} pending messages of one topic over {KEYS:,} keys, "
        f"one publisher owning every lane; written by benchmarks/growth.py "
        f"({datetime.now(UTC):%Y-%m-%d}).\n"
        f"'next claim' is the claim-ahead made while the first batch is still in flight (the "
        f"publisher claims the next batch while it sends one), bounded to the oldest "
        f"{2 * args.batch_size:,} pending messages; those whose key has a message in flight are "
        f"held back.\n\n"
        f"=== with history: outbox.messages after the run held {sizes['history']}, "
        f"1 in 11 of the history quarantined; first claim ===\n\n{plans['history'][0]}\n\n"
        f"=== with history: next claim ===\n\n{plans['history'][1]}\n\n"
        f"=== empty: outbox.messages after the run held {sizes['empty']}; first claim ===\n\n"
        f"{plans['empty'][0]}\n\n"
        f"=== empty: next claim ===\n\n{plans['empty'][1]}\n"
    )
    print(f"claim plans written to {EXPLAIN_FILE.relative_to(EXPLAIN_FILE.parents[2])}")
    entry: dict[str, Any] = {
        "messages": args.messages,
        "batch_size": args.batch_size,
        "history_rows": args.history,
        "empty_msgs_per_s": [round(r) for r in rates["empty"]],
        "history_msgs_per_s": [round(r) for r in rates["history"]],
        "ratio_of_medians": round(ratio, 3),
        "cpu_seconds": cpu_seconds,
        "target_ratio": TARGET_RATIO,
        "target_met": ratio >= TARGET_RATIO,
    }
    record_results("growth", entry)
    print(f"empty median {empty:,.0f} msg/s, with history median {history:,.0f} msg/s")
    print(
        f"growth: ratio with {args.history:,} stored rows / empty {ratio:.2f} "
        f"(target {TARGET_RATIO:g}; {'met' if ratio >= TARGET_RATIO else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
