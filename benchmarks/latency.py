"""Latency: from a business transaction's commit to its confirmation being stored.

Writers (4 threads, a connection each) commit small business transactions
(insert an order, ``outbox.enqueue`` one event) at a steady offered load
(500 messages/s in all, paced on a fixed schedule), while the real
``outbox-publisher`` runs as a process of its own with its default settings
(NOTIFY wake-ups, poll interval 1 s, batch 500), in the default delivery mode
and then in transactional delivery (``--delivery``). For each message:

* commit: ``time.time()`` right after ``conn.commit()`` returned;
* stored: the message's ``delivered_at``, which is ``now()`` of the settling
  statement, i.e. when the settle began (its commit follows within about a
  millisecond); a watcher polls the outstanding ids every few milliseconds,
  and the time it first saw the row delivered is an upper bound of when the
  settle committed.

Both clocks are this machine's. After a warm-up, the measured span's
latencies give p50/p90/p99/max, split by the batch records into wake-up +
claim, mark sending, and send + acknowledgement. Then, with nothing pending
and the publisher idle for 10 s, one message is committed and timed the
same way, five times: the NOTIFY wake-up path, not the poll interval.
Results go to benchmarks/results/latest.json under "latency".
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg
from common import (
    CpuWatch,
    delete_topic,
    environment,
    kafka_pids,
    new_topic,
    percentile,
    postgres_groups,
    record_results,
    start_publisher,
    stop_publisher,
    temporary_database,
    wait_for_publishers,
)

import outbox

TARGET_P50_MS = 10.0
#: p99 of commit -> confirmation stored, by delivery mode: a transaction adds
#: its commit's round trips to every batch.
TARGET_P99_MS = {"idempotent": 50.0, "transactional": 100.0}
TARGET_IDLE_MS = 20.0
CUSTOMERS = 1_000

ORDERS_TABLE = """
CREATE TABLE bench_orders (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer   text NOT NULL,
    total      numeric(10, 2) NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass
class Tracker:
    """Commit times by message id, and what the watcher saw of each."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    #: message id -> commit time (``time.time()``), until the watcher saw it delivered.
    outstanding: dict[uuid.UUID, float] = field(default_factory=dict)
    #: message id -> (commit, delivered_at, first seen delivered), all epoch seconds.
    done: dict[uuid.UUID, tuple[float, float, float]] = field(default_factory=dict)

    def committed(self, message_id: uuid.UUID, at: float) -> None:
        with self.lock:
            self.outstanding[message_id] = at

    def waiting(self) -> list[uuid.UUID]:
        with self.lock:
            return list(self.outstanding)

    def delivered(self, rows: list[tuple[uuid.UUID, float]], seen: float) -> None:
        with self.lock:
            for message_id, delivered_at in rows:
                commit = self.outstanding.pop(message_id)
                self.done[message_id] = (commit, delivered_at, seen)


def business_transaction(conn: psycopg.Connection[Any], topic: str, n: int) -> uuid.UUID:
    """Insert an order and enqueue its event; commit. Returns the message id."""
    customer = f"customer-{n % CUSTOMERS:04d}"
    total = f"{(n % 9_000) / 100 + 10:.2f}"
    row = conn.execute(
        "INSERT INTO bench_orders (customer, total) VALUES (%s, %s) RETURNING id",
        (customer, total),
    ).fetchone()
    assert row is not None
    message_id = outbox.enqueue(
        conn,
        topic,
        {"type": "OrderPlaced", "order": row[0], "customer": customer, "total": total},
        key=customer,
    )
    conn.commit()
    return message_id


@dataclass(frozen=True)
class Schedule:
    """When one writer commits: at ``start + k * period`` until ``stop_at``, open loop."""

    start: float
    period: float
    stop_at: float
    #: The writer's first order number, and the step between its orders.
    first: int
    step: int


def writer(url: str, topic: str, tracker: Tracker, schedule: Schedule) -> None:
    """Commit one transaction at each time of ``schedule`` (late ones at once)."""
    with psycopg.connect(url) as conn:
        n = schedule.first
        k = 0
        while True:
            due = schedule.start + k * schedule.period
            if due >= schedule.stop_at:
                return
            delay = due - time.time()
            if delay > 0:
                time.sleep(delay)
            message_id = business_transaction(conn, topic, n)
            tracker.committed(message_id, time.time())
            n += schedule.step
            k += 1


def watcher(url: str, tracker: Tracker, interval: float, stop: threading.Event) -> None:
    """Poll the outstanding ids every ``interval`` s; note when each is first seen delivered."""
    with psycopg.connect(url, autocommit=True) as conn:
        while not stop.is_set():
            ids = tracker.waiting()
            if ids:
                rows = conn.execute(
                    "SELECT id, extract(epoch FROM delivered_at)::float8 FROM outbox.messages "
                    "WHERE id = ANY(%s) AND state = 'delivered'",
                    (ids,),
                ).fetchall()
                seen = time.time()
                if rows:
                    tracker.delivered(rows, seen)
            time.sleep(interval)


def wait_drained(tracker: Tracker, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while tracker.waiting():
        if time.monotonic() > deadline:
            raise SystemExit(f"{len(tracker.waiting())} messages not delivered after {timeout:g}s")
        time.sleep(0.01)


def breakdown(url: str, ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[float, float, int]]:
    """Per message: its batch's claim (``claimed_at``) and send start, and the batch size."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            """
            SELECT m.id, extract(epoch FROM b.claimed_at)::float8,
                   extract(epoch FROM b.send_began_at)::float8,
                   count(*) OVER (PARTITION BY m.batch_id)
            FROM outbox.messages AS m JOIN outbox.batches AS b ON b.id = m.batch_id
            WHERE m.id = ANY(%s)
            """,
            (ids,),
        ).fetchall()
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def summary(values_ms: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values_ms, 50), 2),
        "p90": round(percentile(values_ms, 90), 2),
        "p99": round(percentile(values_ms, 99), 2),
        "max": round(max(values_ms), 2),
        "mean": round(statistics.fmean(values_ms), 2),
    }


def line(name: str, s: dict[str, float]) -> str:
    return (
        f"  {name:<34} p50 {s['p50']:7.2f}  p90 {s['p90']:7.2f}  p99 {s['p99']:7.2f}  "
        f"max {s['max']:7.2f} ms"
    )


def run_load(url: str, topic: str, args: argparse.Namespace, publisher_pid: int) -> dict[str, Any]:
    tracker = Tracker()
    stop_watching = threading.Event()
    watch = threading.Thread(
        target=watcher, args=(url, tracker, args.watch_interval, stop_watching), daemon=True
    )
    watch.start()
    period = args.writers / args.rate
    start = time.time() + 0.5
    measure_from = start + args.warmup
    stop_at = measure_from + args.seconds
    threads = [
        threading.Thread(
            target=writer,
            args=(
                url,
                topic,
                tracker,
                Schedule(start + i * period / args.writers, period, stop_at, i, args.writers),
            ),
            daemon=True,
        )
        for i in range(args.writers)
    ]
    for t in threads:
        t.start()
    time.sleep(max(measure_from - time.time(), 0))
    database = url.rsplit("/", 1)[1]

    def groups() -> dict[str, list[int]]:
        return {
            "publisher": [publisher_pid],
            **postgres_groups(database),
            "kafka": kafka_pids(),
            "writers and watcher (this script)": [os.getpid()],
        }

    with CpuWatch(groups) as cpu:
        time.sleep(max(stop_at - time.time(), 0))
    for t in threads:
        t.join()
    wait_drained(tracker, 60)
    stop_watching.set()
    watch.join()

    measured = {i: v for i, v in tracker.done.items() if measure_from <= v[0] < stop_at}
    if not measured:
        raise SystemExit("no message committed in the measured span")
    offered = len(measured) / args.seconds
    stored = [(d - c) * 1000 for c, d, _ in measured.values()]
    seen = [(s - c) * 1000 for c, _, s in measured.values()]
    parts = breakdown(url, list(measured))
    wake = [(parts[i][0] - c) * 1000 for i, (c, _, _) in measured.items()]
    mark = [(parts[i][1] - parts[i][0]) * 1000 for i in measured]
    send = [(d - parts[i][1]) * 1000 for i, (_, d, _) in measured.items()]
    batch_sizes = [parts[i][2] for i in measured]
    used = {k: v for k, v in cpu.used().items() if v > 0}
    busy, idle = cpu.machine()
    result = {
        "messages": len(measured),
        "achieved_msgs_per_s": round(offered, 1),
        "commit_to_delivered_at_ms": summary(stored),
        "commit_to_seen_delivered_ms": summary(seen),
        "commit_to_claim_ms": summary(wake),
        "claim_to_send_began_ms": summary(mark),
        "send_began_to_delivered_at_ms": summary(send),
        "mean_batch_size": round(statistics.fmean(batch_sizes), 2),
        "cpu_share_of_machine": {k: round(v / (busy + idle), 3) for k, v in used.items()},
        "machine_busy_share": round(busy / (busy + idle), 3),
    }
    print(
        f"load: {len(measured)} messages committed in {args.seconds:g} s measured "
        f"({offered:.0f} msg/s achieved of {args.rate} offered, {args.writers} writers), "
        f"mean batch {result['mean_batch_size']:.1f} messages"
    )
    print(line("commit -> delivered_at (settle)", result["commit_to_delivered_at_ms"]))
    print(line("commit -> seen delivered (watcher)", result["commit_to_seen_delivered_ms"]))
    print("  where the time goes (from the batch records):")
    print(line("  commit -> claim began", result["commit_to_claim_ms"]))
    print(line("  claim -> sending began", result["claim_to_send_began_ms"]))
    print(line("  sending began -> settle began", result["send_began_to_delivered_at_ms"]))
    shares = ", ".join(f"{k} {v:.0%}" for k, v in result["cpu_share_of_machine"].items())
    print(
        f"  CPU over the measured span, share of both cores: {shares}; "
        f"machine busy {result['machine_busy_share']:.0%}"
    )
    return result


def run_idle(url: str, topic: str, args: argparse.Namespace) -> list[float]:
    """Commit one message after the publisher sat idle; milliseconds to ``delivered_at``."""
    figures = []
    with psycopg.connect(url) as conn, psycopg.connect(url, autocommit=True) as watch:
        for i in range(args.idle_repeats):
            time.sleep(args.idle_seconds)
            pending = watch.execute(
                "SELECT count(*) FROM outbox.messages WHERE state <> 'delivered'"
            ).fetchone()
            if pending != (0,):
                raise SystemExit(f"publisher not idle: {pending} messages not delivered")
            message_id = business_transaction(conn, topic, 10_000_000 + i)
            committed = time.time()
            deadline = committed + 10
            while True:
                row = watch.execute(
                    "SELECT extract(epoch FROM delivered_at)::float8 FROM outbox.messages "
                    "WHERE id = %s AND state = 'delivered'",
                    (message_id,),
                ).fetchone()
                if row is not None:
                    break
                if time.time() > deadline:
                    raise SystemExit(f"idle message {message_id} not delivered within 10 s")
                time.sleep(0.001)
            figures.append((row[0] - committed) * 1000)
            print(
                f"  after {args.idle_seconds:g} s idle: commit -> delivered_at "
                f"{figures[-1]:.2f} ms (seen after {(time.time() - committed) * 1000:.2f} ms)"
            )
    return figures


def measure(base_url: str, bootstrap: str, args: argparse.Namespace, delivery: str) -> bool:
    """One mode's steady load and idle wake-ups; record and print them; whether targets held."""
    print(f"-- {delivery} delivery, {args.sink} sink")
    with temporary_database(base_url, "outbox_bench_latency") as (_, url):
        topic = new_topic(bootstrap)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(ORDERS_TABLE)
        publisher = start_publisher(url, bootstrap, "--delivery", delivery, "--sink", args.sink)
        try:
            wait_for_publishers(url, 1)
            load = run_load(url, topic, args, publisher.pid)
            print(f"first message after {args.idle_seconds:g} s idle, {args.idle_repeats} times:")
            idle = run_idle(url, topic, args)
        finally:
            code = stop_publisher(publisher)
            delete_topic(bootstrap, topic)
        if code != 0:
            raise SystemExit(f"outbox-publisher exited {code}")

    p50 = load["commit_to_delivered_at_ms"]["p50"]
    p99 = load["commit_to_delivered_at_ms"]["p99"]
    idle_max = max(idle)
    target_p99 = TARGET_P99_MS[delivery]
    met = p50 <= TARGET_P50_MS and p99 <= target_p99 and idle_max <= TARGET_IDLE_MS
    record_results(
        # The default mode and sink keep the key they always had.
        "latency"
        + ("" if delivery == "idempotent" else f"_{delivery}")
        + ("" if args.sink == "kafka-python" else f"_{args.sink}"),
        {
            "delivery": delivery,
            "sink": args.sink,
            "offered_msgs_per_s": args.rate,
            "writers": args.writers,
            "measured_seconds": args.seconds,
            **load,
            "idle_seconds": args.idle_seconds,
            "idle_wakeup_ms": [round(x, 2) for x in idle],
            "targets_ms": {"p50": TARGET_P50_MS, "p99": target_p99, "idle": TARGET_IDLE_MS},
            "targets_met": met,
        },
    )
    print(
        f"{delivery}: latency p50 {p50:.1f} ms (target {TARGET_P50_MS:g}), p99 {p99:.1f} ms "
        f"(target {target_p99:g}), idle wake-up max {idle_max:.1f} ms "
        f"(target {TARGET_IDLE_MS:g}): {'targets met' if met else 'targets MISSED'}"
    )
    return met


def main() -> None:
    """Steady load, then idle wake-ups, in each delivery mode; print the figures and targets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=500, help="messages/s offered, in all")
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=5, help="seconds of load not measured")
    parser.add_argument("--seconds", type=float, default=25, help="seconds of load measured")
    parser.add_argument("--watch-interval", type=float, default=0.005)
    parser.add_argument("--idle-seconds", type=float, default=10)
    parser.add_argument("--idle-repeats", type=int, default=5)
    parser.add_argument(
        "--delivery",
        choices=["idempotent", "transactional", "both"],
        default="both",
        help="the publisher's delivery mode(s), one after the other",
    )
    parser.add_argument(
        "--sink",
        choices=["kafka-python", "confluent"],
        default="kafka-python",
        help="the publisher's producer (confluent needs the confluent extra)",
    )
    args = parser.parse_args()
    base_url, bootstrap = environment()
    print(
        f"offered load {args.rate:g} msg/s from {args.writers} writers, "
        f"{args.warmup:g} s warm-up + {args.seconds:g} s measured; publisher with its defaults"
    )
    modes = ["idempotent", "transactional"] if args.delivery == "both" else [args.delivery]
    for delivery in modes:
        measure(base_url, bootstrap, args, delivery)


if __name__ == "__main__":
    main()
