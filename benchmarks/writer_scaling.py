"""Writer scaling: many concurrent writers, with and without ``outbox.enqueue``.

N writers (1, 8, 32, 64 by default), each on a connection of its own, commit
small business transactions as fast as they can: one order inserted into a
table of the benchmark's own, plus (in the enqueue variants) one
``outbox.enqueue`` of a keyed JSON event, then the commit, with the default
durability (``synchronous_commit`` on). The variants at each N:

* ``plain``: the order alone;
* ``minimal_row``: the order and the least any outbox can add to it, one row
  (topic, key, the JSON event as bytes) in a table of the benchmark's own
  with only a primary key: no lock, no other index, no trigger. Its ratio to
  ``plain`` bounds what any outbox that writes in the caller's transaction
  can reach on this machine;
* ``enqueue``: the order and its event, with the wake-up trigger on
  ``outbox.messages`` as the migrations leave it, and no publisher asleep
  (a busy system);
* ``enqueue_no_trigger``: the same with that trigger disabled (``ALTER
  TABLE ... DISABLE TRIGGER``): the trigger's own cost, isolated;
* where the schema has ``outbox.wakeup`` (the wake-up of only sleeping
  publishers), also ``enqueue_notify_always``: the trigger as it was before,
  a ``NOTIFY`` from every enqueuing transaction (installed by this benchmark
  for the point); and ``enqueue_publisher_asleep``: the shipped trigger
  while a publisher is announced asleep, so that every commit notifies
  through it (its worst case).

Writers are threads spread over a few worker processes (``--processes``), so
that no one interpreter lock bounds them; each worker's CPU use is reported,
and so are the CPU milliseconds a transaction costs in the writers'
processes (client) and in their backends (server), and how busy the whole
machine was. A session LISTENs on ``outbox_pending`` throughout, as a
publisher's listener would, and counts the notifications of each point.

Each point runs ``--seconds`` after a warm-up; the rounds (``--rounds``)
interleave every point, the variants' order rotating from one round to the
next, and the tables are emptied and a checkpoint taken before each point,
so that noise and growth hit every variant alike. Reported: transactions per
second per variant and N (the median over the rounds) and the ratio of each
other variant to ``plain`` at each N.

With ``--live-seconds``, the top N runs once more per round, per trigger,
with a real publisher in this process delivering what the writers commit to
a fresh topic (the default settings: 1 s poll, NOTIFY wake-ups): how many
commits notify when a publisher keeps up. With ``--wakeups``, a publisher
polling only every minute sits idle, and single messages are committed one
at a time: commit -> claim (``outbox.batches.claimed_at``) and commit ->
delivered (``delivered_at``), the idle wake-up path. Results go to
benchmarks/results/latest.json under "writer_scaling".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import psycopg
from common import (
    cpu_seconds,
    delete_topic,
    environment,
    machine_busy_seconds,
    new_topic,
    percentile,
    record_results,
    temporary_database,
)
from psycopg import sql

import outbox
from publisher.app import build_publisher
from publisher.config import PublisherConfig
from publisher.loop import Publisher

TARGET_RATIO = 0.8
CUSTOMERS = 1_000
TOPIC = "orders"
#: The wake-up trigger the migrations create on outbox.messages.
SHIPPED = "messages_notify_pending"
#: The trigger as before outbox.wakeup: a NOTIFY from every enqueuing statement.
ALWAYS = "bench_notify_always"
#: The application name of the writers' connections (their backends' CPU is read).
WRITER = "bench writer"

ORDERS_TABLE = """
CREATE TABLE bench_orders (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer   integer NOT NULL,
    total      numeric(10, 2) NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""

#: What a writer's transaction adds to the order: ``outbox.enqueue``, or the minimal row.
Event = Literal["enqueue", "minimal_row"]

#: The least an outbox can write: the event, in a table with only a primary key.
EVENTS_TABLE = """
CREATE TABLE bench_events (
    id    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic text NOT NULL,
    key   bytea,
    value bytea NOT NULL
)
"""

NOTIFY_ALWAYS = f"""
CREATE FUNCTION bench_notify_always() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_pending', '');
    RETURN NULL;
END;
$$;
CREATE TRIGGER {ALWAYS} AFTER INSERT ON outbox.messages
FOR EACH STATEMENT EXECUTE FUNCTION bench_notify_always();
ALTER TABLE outbox.messages DISABLE TRIGGER {ALWAYS}
"""


@dataclass(frozen=True, slots=True)
class Variant:
    """What a writer's transaction adds to the order (``event``: nothing, ``"enqueue"``
    or ``"minimal_row"``), which trigger runs, and whether a publisher sleeps."""

    name: str
    event: Event | None
    trigger: str | None
    asleep: bool = False


PLAIN = Variant("plain", event=None, trigger=SHIPPED)
MINIMAL_ROW = Variant("minimal_row", event="minimal_row", trigger=SHIPPED)
ENQUEUE = Variant("enqueue", event="enqueue", trigger=SHIPPED)
NO_TRIGGER = Variant("enqueue_no_trigger", event="enqueue", trigger=None)
NOTIFY_EVERY_COMMIT = Variant("enqueue_notify_always", event="enqueue", trigger=ALWAYS)
ASLEEP = Variant("enqueue_publisher_asleep", event="enqueue", trigger=SHIPPED, asleep=True)


@dataclass(frozen=True, slots=True)
class Share:
    """What one worker process reports of one point."""

    committed: int
    cpu_seconds: float
    connected_late: int
    errors: int


def business_transaction(
    conn: psycopg.Connection[Any], topic: str, n: int, *, event: Event | None
) -> None:
    """Insert an order (and write its event: ``outbox.enqueue``, or the minimal row); commit."""
    customer = n % CUSTOMERS
    total = f"{(n % 9_000) / 100 + 10:.2f}"
    row = conn.execute(
        "INSERT INTO bench_orders (customer, total) VALUES (%s, %s) RETURNING id",
        (customer, total),
    ).fetchone()
    if event is not None:
        assert row is not None
        payload = {"type": "OrderPlaced", "order": row[0], "customer": customer, "total": total}
        key = f"customer-{customer:04d}"
        if event == "enqueue":
            outbox.enqueue(conn, topic, payload, key=key)
        else:
            conn.execute(
                "INSERT INTO bench_events (topic, key, value) VALUES (%s, %s, %s)",
                (topic, key.encode(), json.dumps(payload).encode()),
            )
    conn.commit()


@dataclass(frozen=True, slots=True)
class Writers:
    """What one worker process runs: ``threads`` writers, each on a connection of its own,
    until ``stop_at``, counting the commits made from ``measure_from`` (wall clock)."""

    url: str
    topic: str
    event: Event | None
    threads: int
    first: int
    measure_from: float
    stop_at: float


def writers(spec: Writers) -> Share:
    """In a worker process: run ``spec``; its commits, and this process's CPU seconds
    over the measured span."""
    url, topic, event, threads = spec.url, spec.topic, spec.event, spec.threads
    first, measure_from, stop_at = spec.first, spec.measure_from, spec.stop_at
    counts = [0] * threads
    late = [False] * threads
    errors = [0] * threads

    def write(i: int) -> None:
        with psycopg.connect(url, application_name=WRITER) as conn:
            late[i] = time.time() > measure_from
            n = first + i
            while time.time() < stop_at:
                try:
                    business_transaction(conn, topic, n, event=event)
                except psycopg.Error:
                    errors[i] += 1
                    conn.rollback()
                    continue
                if measure_from <= time.time() < stop_at:
                    counts[i] += 1
                n += 1_000_003  # another customer each time, whatever the thread count

    pool = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    time.sleep(max(measure_from - time.time(), 0))
    cpu_start = time.process_time()
    time.sleep(max(stop_at - time.time(), 0))
    cpu = time.process_time() - cpu_start
    for t in pool:
        t.join()
    return Share(sum(counts), cpu, sum(late), sum(errors))


class Listener:
    """A LISTEN session counting ``outbox_pending`` notifications, in a thread."""

    def __init__(self, url: str) -> None:
        self._conn = psycopg.connect(url, autocommit=True)
        self._conn.execute("LISTEN outbox_pending")
        self._lock = threading.Lock()
        self._count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for _ in self._conn.notifies(timeout=0.2):
                with self._lock:
                    self._count += 1

    def take(self) -> int:
        """Notifications since the last call."""
        with self._lock:
            count, self._count = self._count, 0
        return count

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._conn.close()


def has_wakeup(url: str) -> bool:
    """Whether the schema wakes only sleeping publishers (it has ``outbox.wakeup``)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT to_regclass('outbox.wakeup') IS NOT NULL").fetchone()
    return bool(row and row[0])


def prepare_point(url: str, variant: Variant, triggers: list[str]) -> None:
    """Empty the tables, enable only the variant's trigger, write everything out."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE bench_orders, bench_events, outbox.messages")
        for trigger in triggers:
            action = "ENABLE" if trigger == variant.trigger else "DISABLE"
            conn.execute(
                sql.SQL("ALTER TABLE outbox.messages {} TRIGGER {}").format(
                    sql.SQL(action), sql.Identifier(trigger)
                )
            )
        conn.execute("CHECKPOINT")


@contextmanager
def asleep(url: str, variant: Variant) -> Iterator[None]:
    """For the variant that needs it, a session that announces a sleeping publisher
    the way one does (its lock on outbox.wakeup), for the whole block."""
    if not variant.asleep:
        yield
        return
    with psycopg.connect(url) as conn:
        conn.execute("LOCK TABLE outbox.wakeup IN SHARE MODE")
        yield
        conn.rollback()


@dataclass(frozen=True, slots=True)
class Bench:
    """What every point of one run shares."""

    pool: ProcessPoolExecutor
    url: str
    args: argparse.Namespace
    listener: Listener


def run_point(
    bench: Bench, variant: Variant, writers_count: int, *, topic: str, seconds: float
) -> dict[str, Any]:
    """One point: ``writers_count`` writers of ``variant`` for ``seconds``; its figures."""
    args, listener = bench.args, bench.listener
    processes = min(args.processes, writers_count)
    spread = [
        writers_count // processes + (i < writers_count % processes) for i in range(processes)
    ]
    measure_from = time.time() + args.warmup
    stop_at = measure_from + seconds
    futures = [
        bench.pool.submit(
            writers,
            Writers(bench.url, topic, variant.event, k, sum(spread[:i]), measure_from, stop_at),
        )
        for i, k in enumerate(spread)
    ]
    time.sleep(max(measure_from - time.time(), 0))
    listener.take()
    busy_start, idle_start = machine_busy_seconds()
    backends = {pid: cpu_seconds(pid) or 0.0 for pid in writer_backends(bench.url)}
    # Read the backends' CPU just before the writers stop (their backends exit then).
    time.sleep(max(stop_at - 0.1 - time.time(), 0))
    server_cpu = sum((cpu_seconds(pid) or start) - start for pid, start in backends.items())
    time.sleep(max(stop_at - time.time(), 0))
    busy_end, idle_end = machine_busy_seconds()
    time.sleep(0.2)  # the last notifications of the span reach the listener
    notifications = listener.take()
    shares = [f.result() for f in futures]
    committed = sum(s.committed for s in shares)
    late = sum(s.connected_late for s in shares)
    errors = sum(s.errors for s in shares)
    if late or errors:
        print(f"    ({late} writers connected late, {errors} transactions failed)")
    busy = busy_end - busy_start
    # The server's CPU was read over 0.1 s less than the commits were counted.
    in_span = committed * (seconds - 0.1) / seconds
    return {
        "tps": round(committed / seconds, 1),
        "notifications_per_commit": round(notifications / committed, 3) if committed else None,
        "client_cpu_ms_per_commit": (
            round(sum(s.cpu_seconds for s in shares) / committed * 1000, 3) if committed else None
        ),
        "server_cpu_ms_per_commit": round(server_cpu / in_span * 1000, 3) if committed else None,
        "worker_cpu": [round(s.cpu_seconds / seconds, 2) for s in shares],
        "machine_busy": round(busy / (busy + idle_end - idle_start), 2),
    }


def writer_backends(url: str) -> list[int]:
    """The pids of the backends serving the writers."""
    with psycopg.connect(url) as conn:
        return [
            pid
            for (pid,) in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = %s",
                (WRITER,),
            )
        ]


def show(n: int, variant: Variant, point: dict[str, Any]) -> None:
    print(
        f"  {n:>3} writers  {variant.name:<25} {point['tps']:>8,.1f} tx/s  "
        f"notifications/commit {point['notifications_per_commit']}  CPU ms/commit: client "
        f"{point['client_cpu_ms_per_commit']}, server {point['server_cpu_ms_per_commit']}  "
        f"machine {point['machine_busy']:.0%} busy  worker CPU {point['worker_cpu']}"
    )


def start_publisher(
    url: str, bootstrap: str, **settings: Any
) -> tuple[Publisher, threading.Thread]:
    publisher = build_publisher(
        PublisherConfig(database_url=url, kafka_bootstrap=bootstrap, http_port=0, **settings)
    )
    thread = threading.Thread(target=publisher.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not publisher.waker.listening.is_set():
        if time.monotonic() > deadline:
            raise SystemExit("the publisher did not start listening within 30 s")
        time.sleep(0.05)
    return publisher, thread


def stop_publisher(publisher: Publisher, thread: threading.Thread) -> None:
    publisher.request_stop()
    thread.join(60)
    if thread.is_alive():
        raise SystemExit("the publisher did not stop within 60 s")


def wait_delivered(url: str, timeout: float) -> None:
    """Until nothing of outbox.messages is left undelivered."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT count(*) FROM outbox.message_status WHERE state <> 'delivered'"
            ).fetchone()
            if row == (0,):
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"{row} messages still undelivered after {timeout:g}s")
            time.sleep(0.05)


def sleeping_publishers(conn: psycopg.Connection[Any]) -> int:
    """How many sessions hold outbox.wakeup as a sleeping publisher does."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'relation' "
        "AND relation = to_regclass('outbox.wakeup') AND mode = 'ShareLock' AND granted"
    ).fetchone()
    return int(row[0]) if row else 0


def idle_wakeups(url: str, bootstrap: str, count: int, gated: bool) -> dict[str, Any]:
    """Single messages committed to an idle publisher: commit -> claimed, -> delivered (ms)."""
    topic = new_topic(bootstrap)
    publisher, thread = start_publisher(url, bootstrap, poll_interval=60.0)
    claimed: list[float] = []
    delivered: list[float] = []
    try:
        with psycopg.connect(url, autocommit=True) as watch:
            for i in range(count):
                time.sleep(0.3)  # idle: the publisher has gone back to sleep
                if gated:
                    deadline = time.monotonic() + 10
                    while sleeping_publishers(watch) < 1:
                        if time.monotonic() > deadline:
                            raise SystemExit("the publisher did not announce its sleep")
                        time.sleep(0.01)
                with psycopg.connect(url) as conn:
                    message_id = outbox.enqueue(conn, topic, {"wake": i})
                    conn.commit()
                    committed = time.time()
                deadline = time.monotonic() + 10
                while True:
                    row = watch.execute(
                        "SELECT extract(epoch FROM b.claimed_at)::float8, "
                        "extract(epoch FROM m.delivered_at)::float8 "
                        "FROM outbox.messages AS m JOIN outbox.batches AS b ON b.id = m.batch_id "
                        "WHERE m.id = %s AND m.state = 'delivered'",
                        (message_id,),
                    ).fetchone()
                    if row is not None:
                        break
                    if time.monotonic() > deadline:
                        raise SystemExit(f"message {i} not delivered within 10 s")
                    time.sleep(0.005)
                claimed.append((row[0] - committed) * 1000)
                delivered.append((row[1] - committed) * 1000)
    finally:
        stop_publisher(publisher, thread)
        delete_topic(bootstrap, topic)

    def summary(values: list[float]) -> dict[str, float]:
        return {
            "median": round(statistics.median(values), 2),
            "p99": round(percentile(values, 99), 2),
            "max": round(max(values), 2),
        }

    return {
        "count": count,
        "commit_to_claim_ms": summary(claimed),
        "commit_to_delivered_ms": summary(delivered),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--writers", type=int, nargs="+", default=[1, 8, 32, 64], help="writer counts"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every point")
    parser.add_argument(
        "--processes", type=int, default=4, help="worker processes the writers are spread over"
    )
    parser.add_argument(
        "--live-seconds",
        type=float,
        default=10.0,
        help="seconds per point with a live publisher at the top writer count (0: none)",
    )
    parser.add_argument("--wakeups", type=int, default=50, help="idle wake-ups timed (0: none)")
    args = parser.parse_args()
    if min(args.writers) < 1 or args.seconds <= 0 or args.rounds < 1 or args.processes < 1:
        parser.error("writer counts, --seconds, --rounds and --processes must be positive")
    if args.live_seconds < 0 or args.wakeups < 0 or args.warmup < 0:
        parser.error("--live-seconds, --wakeups and --warmup must not be negative")
    return args


def rotated(items: list[Variant], by: int) -> list[Variant]:
    """``items`` starting at ``by`` (modulo their count): each round begins elsewhere."""
    k = by % len(items)
    return items[k:] + items[:k]


@dataclass
class Measured:
    """Every point of a run, by writer count and variant."""

    variants: list[Variant]
    points: dict[tuple[int, str], list[dict[str, Any]]] = field(default_factory=dict)
    live: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    wakeups: dict[str, Any] | None = None
    gated: bool = False


def measure(args: argparse.Namespace, base_url: str, bootstrap: str) -> Measured:
    """Run every point in interleaved rounds, then the idle wake-ups."""
    top = max(args.writers)
    context = multiprocessing.get_context("spawn")
    with (
        temporary_database(base_url, "outbox_bench_writers") as (_, url),
        ProcessPoolExecutor(args.processes, mp_context=context) as pool,
    ):
        gated = has_wakeup(url)
        run = Measured([PLAIN, MINIMAL_ROW, ENQUEUE, NO_TRIGGER], gated=gated)
        triggers = [SHIPPED]
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(ORDERS_TABLE)
            conn.execute(EVENTS_TABLE)
            if gated:
                conn.execute(NOTIFY_ALWAYS)
                run.variants += [NOTIFY_EVERY_COMMIT, ASLEEP]
                triggers.append(ALWAYS)
        # Start every worker (and its imports) before the first point's clock runs.
        list(pool.map(time.sleep, [0.5] * args.processes))
        bench = Bench(pool, url, args, Listener(url))
        try:
            for r in range(args.rounds):
                print(f"round {r + 1} of {args.rounds}")
                for n in args.writers:
                    for variant in rotated(run.variants, r):
                        prepare_point(url, variant, triggers)
                        with asleep(url, variant):
                            point = run_point(bench, variant, n, topic=TOPIC, seconds=args.seconds)
                        run.points.setdefault((n, variant.name), []).append(point)
                        show(n, variant, point)
                if not args.live_seconds:
                    continue
                for variant in rotated([NOTIFY_EVERY_COMMIT, ENQUEUE] if gated else [ENQUEUE], r):
                    prepare_point(url, variant, triggers)
                    topic = new_topic(bootstrap)
                    publisher, thread = start_publisher(url, bootstrap)
                    try:
                        point = run_point(
                            bench, variant, top, topic=topic, seconds=args.live_seconds
                        )
                        wait_delivered(url, 120)
                    finally:
                        stop_publisher(publisher, thread)
                        delete_topic(bootstrap, topic)
                    run.live.setdefault(variant.name, []).append(point)
                    show(top, replace(variant, name=f"{variant.name}, publishing"), point)
        finally:
            bench.listener.close()
        if args.wakeups:
            prepare_point(url, ENQUEUE, triggers)
            run.wakeups = idle_wakeups(url, bootstrap, args.wakeups, gated)
    return run


def report(args: argparse.Namespace, run: Measured) -> None:
    """Print the medians and ratios; record them."""
    top = max(args.writers)
    results: dict[str, Any] = {}
    print(f"medians over {args.rounds} rounds of {args.seconds:g} s, transactions per second:")
    for n in args.writers:
        row: dict[str, Any] = {v.name: summarise(run.points[(n, v.name)]) for v in run.variants}
        plain = row["plain"]["median_tps"]
        for variant in run.variants[1:]:
            row[f"ratio_{variant.name}"] = (
                round(row[variant.name]["median_tps"] / plain, 3) if plain else None
            )
        results[str(n)] = row
        print(
            f"  {n:>3} writers: plain {plain:,.1f}; "
            + "; ".join(
                f"{v.name} {row[v.name]['median_tps']:,.1f} ({row[f'ratio_{v.name}']})"
                for v in run.variants[1:]
            )
        )
    live = {name: summarise(runs) for name, runs in run.live.items()}
    for name, figures in live.items():
        print(
            f"  {top} writers, a publisher delivering, {name}: {figures['median_tps']:,.1f} "
            f"tx/s, notifications/commit {figures['notifications_per_commit']}"
        )
    if run.wakeups is not None:
        claim, delivered = run.wakeups["commit_to_claim_ms"], run.wakeups["commit_to_delivered_ms"]
        print(
            f"idle wake-ups ({run.wakeups['count']}): commit -> claim median {claim['median']} "
            f"ms, p99 {claim['p99']} ms; commit -> delivered median {delivered['median']} ms, "
            f"p99 {delivered['p99']} ms"
        )
    ratio = results[str(top)]["ratio_enqueue"] or 0.0
    record_results(
        "writer_scaling",
        {
            "seconds": args.seconds,
            "rounds": args.rounds,
            "processes": args.processes,
            "wakes_only_sleeping_publishers": run.gated,
            "by_writers": results,
            "with_a_publisher_delivering": live,
            "idle_wakeups": run.wakeups,
            "target_ratio": TARGET_RATIO,
            "target_met": ratio >= TARGET_RATIO,
        },
    )
    print(
        f"writer scaling: ratio with / without enqueue at {top} writers {ratio:.3f} "
        f"(target {TARGET_RATIO:g}; {'met' if ratio >= TARGET_RATIO else 'MISSED'}); "
        f"with the trigger disabled {results[str(top)]['ratio_enqueue_no_trigger']}; "
        f"the minimal row {results[str(top)]['ratio_minimal_row']}"
    )


def main() -> None:
    """Measure every point in interleaved rounds; print and record the figures and ratios."""
    args = parse_args()
    base_url, bootstrap = environment()
    report(args, measure(args, base_url, bootstrap))


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's points over the rounds: each round's rate, the median, notifications."""
    per_commit = [p["notifications_per_commit"] for p in runs if p["notifications_per_commit"]]
    client = [p["client_cpu_ms_per_commit"] for p in runs if p["client_cpu_ms_per_commit"]]
    server = [p["server_cpu_ms_per_commit"] for p in runs if p["server_cpu_ms_per_commit"]]
    return {
        "tps": [p["tps"] for p in runs],
        "median_tps": round(statistics.median(p["tps"] for p in runs), 1),
        "notifications_per_commit": round(statistics.median(per_commit), 3) if per_commit else 0,
        "client_cpu_ms_per_commit": round(statistics.median(client), 3) if client else None,
        "server_cpu_ms_per_commit": round(statistics.median(server), 3) if server else None,
        "machine_busy": [p["machine_busy"] for p in runs],
        "worker_cpu_max": max(max(p["worker_cpu"]) for p in runs),
    }


if __name__ == "__main__":
    main()
