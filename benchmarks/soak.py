"""Soak: half an hour of steady load with faults; nothing lost or doubled, keys in order.

Sixteen writers (threads in four processes) enqueue a fixed total rate (2,000 messages a second
by default, paced) into a fresh database: some one message per transaction,
the others 5-50 at once with ``outbox.enqueue_many``. A few hot keys take a
large share of the messages, thousands of cold keys the rest. Each key
belongs to one writer, and each message carries its key's counter, so the
writer's commit order is the key's order, and it can still be checked once
retention has purged the rows. Some transactions enqueue again a message of
a few seconds before, with its idempotency key: the outbox must return the
first message's id and write nothing.

Two real ``outbox-publisher`` processes deliver to a fresh topic (six
partitions, replication factor 3 on a three-broker cluster) in the default
(idempotent) delivery mode, with retention on at its shortest windows
(``--purge-delivered-after`` and ``--purge-evidence-after`` 5 minutes). The
soak supervises them. Faults come on a schedule scaled to ``--minutes``:

* a publisher SIGKILLed about every four minutes, the two in turn,
  restarted at once;
* at 40 % the broker leading partition 0 SIGKILLed (``services/kafka-node
  kill``) and started again 30 s later, and once it is back in every ISR
  given its partitions back (a preferred leader election, as after a
  rolling restart); on a single broker, the broker is stopped and started
  instead (an outage, not a leader election);
* at 60 % PostgreSQL restarted (``services/down postgres && services/up
  postgres``);
* at 80 % a publisher frozen (SIGSTOP) past its lease, then woken (SIGCONT).

Every few seconds a sample is taken: the lag of the messages delivered since
the last sample (``delivered_at - created_at``: from the start of the
enqueuing transaction to the start of the settle that stored the broker's
acknowledgement), the open messages and the age of the oldest, the size of
every outbox table (table and indexes apart for ``outbox.messages``), dead
tuples and autovacuum counts, each publisher's resident memory, and which
publishers and brokers are up.

At the end the writers stop, every message is delivered, the publishers
stop, and the topic is read back (read_committed, and read_uncommitted
beside it). It passes when nothing is lost or doubled, each key's counters
arrive in order in one partition, no message is left open, the lag p99
outside the fault windows is under 1 s, each fault recovers by itself (lag
back under 1 s) within ``--recovery-limit``, the outbox tables at the end
are within 1.3x of their size at a third of the run, and each publisher's
memory at its end is within 1.2x of its memory after its warm-up. Exit code
1 when a check fails; the database and topic are then kept.

The soak restarts PostgreSQL and kills brokers of the services this
checkout's ``services/up`` started: run it on an instance of its own (see
docs/development.md). Results: benchmarks/results/soak.json (the whole time
series), the summary under "soak" in latest.json, and a plot,
benchmarks/results/soak.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import queue
import random
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
from common import (
    RESULTS_DIR,
    RetryingEnqueuer,
    config_of,
    create_database,
    create_replicated_topic,
    delete_topic,
    drop_database,
    elect_preferred_leaders,
    environment,
    jit_compiler_seconds,
    log_events,
    partition_leaders,
    patiently,
    record_results,
    registered,
    rss_bytes,
    stamp,
    topic_partitions,
)
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

import outbox
from outbox.migrations import migrate
from outbox.status import read_open_status
from tests.support import is_frozen, start_logged_publisher, stop_and_wait, wait_until

ROOT = Path(__file__).resolve().parent.parent
SERIES = RESULTS_DIR / "soak.json"
PLOT = RESULTS_DIR / "soak.png"

#: Upper bounds (ms) of the lag histogram kept per sample; percentiles over
#: many samples are read from it (a bucket's upper bound: an overestimate).
LAG_BOUNDS_MS = (
    5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000,
    10_000, 20_000, 30_000, 60_000, 120_000, 300_000, 600_000,
)  # fmt: skip

#: A settle's ``delivered_at`` is its transaction's start: a sample counts the
#: deliveries up to this many seconds before it, so that a settle still
#: committing is counted by the next sample instead of missed.
SETTLE_SLACK = 2.0
#: The lag is read from the messages enqueued since the oldest open message of
#: the previous sample (a range of the primary key: ids are UUIDv7), less this.
ID_MARGIN = 10.0
#: The open states; none may be left at the end.
OPEN_STATES = ("pending", "in_flight", "uncertain", "quarantined")

#: When the faults come, as fractions of the run (for 30 minutes: kills at
#: 2, 6, 9, 15, 21 and 27 minutes, the broker at 12, PostgreSQL at 18, the
#: freeze at 24). A kill that would fall into another fault's window is left
#: out (short runs).
KILLS_AT = (2 / 30, 6 / 30, 9 / 30, 15 / 30, 21 / 30, 27 / 30)
BROKER_AT, POSTGRES_AT, FREEZE_AT = 0.4, 0.6, 0.8

LAG_QUERY = """
WITH d AS (
    SELECT extract(epoch FROM delivered_at - created_at)::float8 * 1000 AS ms
    FROM outbox.messages
    WHERE id >= outbox.uuid7_floor(%(low)s) AND state = 'delivered'
      AND delivered_at > %(after)s AND delivered_at <= %(until)s
)
SELECT (SELECT count(*) FROM d),
       (SELECT percentile_disc(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY ms) FROM d),
       (SELECT max(ms) FROM d),
       (SELECT coalesce(jsonb_object_agg(b, n), '{}')
        FROM (SELECT width_bucket(ms, %(bounds)s::float8[]) AS b, count(*) AS n
              FROM d GROUP BY 1) AS h)
"""

SIZES_QUERY = """
SELECT c.relname, pg_total_relation_size(c.oid), pg_table_size(c.oid), pg_indexes_size(c.oid),
       s.n_live_tup, s.n_dead_tup, s.autovacuum_count, s.autoanalyze_count
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
WHERE n.nspname = 'outbox' AND c.relkind = 'r'
ORDER BY c.relname
"""


#: The publishers' statement that has been running longest (a loop stuck in one
#: shows here long before anything else says so).
LONGEST_STATEMENT = """
SELECT extract(epoch FROM now() - query_start)::float8,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 80)
FROM pg_stat_activity
WHERE datname = current_database() AND state = 'active'
  AND application_name LIKE 'outbox-publisher%%' AND query NOT LIKE 'LISTEN%%'
ORDER BY query_start
LIMIT 1
"""


#: A publisher statement running this long is explained (see ``explain_named``).
STUCK_SECONDS = 30.0


def explain_named(conn: psycopg.Connection[Any], prefix: str) -> dict[str, Any]:
    """``EXPLAIN`` of the named query (outbox/queries.sql) whose text begins as ``prefix``
    (pg_stat_activity's text, whitespace folded), each parameter given 100."""
    for name, text in queries_by_name().items():
        folded = " ".join(re.sub(r"%\((\w+)\)s", "$", text).split())
        if folded.startswith(" ".join(prefix.split())[:60].split("$")[0]):
            params = dict.fromkeys(re.findall(r"%\((\w+)\)s", text), 100)
            try:
                with conn.transaction():
                    plan = [r[0] for r in conn.execute("EXPLAIN " + text, params)]
            except psycopg.Error as exc:
                return {"query": name, "error": repr(exc)}
            return {"query": name, "plan": plan}
    return {"query": None}


def queries_by_name() -> dict[str, str]:
    """The named queries of outbox/queries.sql."""
    from outbox.queries import parse_queries  # noqa: PLC0415 - only a stuck statement needs it

    return parse_queries((ROOT / "outbox" / "queries.sql").read_text())


def clock_since(began: float) -> float:
    """Seconds since ``began`` (a ``time.monotonic()``), rounded for the records."""
    return round(time.monotonic() - began, 2)


# --- the services this checkout started ---------------------------------------------


class Services:
    """PostgreSQL and the brokers of this checkout's ``services/up``, which the soak
    restarts and kills: ``services/*`` of the repository it runs from."""

    def __init__(self, url: str, bootstrap: str) -> None:
        self.url, self.bootstrap = url, bootstrap
        self.addresses = [a.strip() for a in bootstrap.split(",") if a.strip()]
        self.brokers = int(os.environ.get("OUTBOX_KAFKA_BROKERS", "1"))
        self.kafka_node = ROOT / "services" / "kafka-node"
        #: Leader elections (``services/kafka-node``) or, on one broker, outages.
        self.cluster = self.brokers >= 3 and self.kafka_node.exists()

    def check_own(self, *, allow_shared: bool) -> None:
        """Exit unless the services are this checkout's own and nobody else uses them."""
        conf = ROOT / ".services" / "postgres" / "data" / "outbox.conf"
        port = urlsplit(self.url).port
        try:
            local = any(
                line.split("=")[1].strip() == str(port)
                for line in conf.read_text().splitlines()
                if line.strip().startswith("port")
            )
        except OSError:
            local = False
        if not local:
            raise SystemExit(
                f"OUTBOX_DATABASE_URL ({self.url}) is not the PostgreSQL of {ROOT}/services/up: "
                "the soak restarts the PostgreSQL and kills the brokers that services/up started "
                "here (source this checkout's .services.env)"
            )
        if allow_shared:
            return
        with psycopg.connect(self.url, autocommit=True) as conn:
            others = [
                row[0]
                for row in conn.execute(
                    "SELECT DISTINCT datname FROM pg_stat_activity "
                    "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() "
                    "AND datname IS NOT NULL"
                )
            ]
        if others:
            raise SystemExit(
                f"PostgreSQL at {self.url} has other sessions (databases {', '.join(others)}): "
                "the soak restarts it and kills brokers. Run it on services of its own "
                "(docs/development.md, Soak) or pass --allow-shared-services"
            )

    def environment(self) -> dict[str, str]:
        """The environment for ``services/up``: this instance's ports, no external URLs
        (``up`` would reuse services that answer, and rewrites .services.env from the ports)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in {"OUTBOX_DATABASE_URL", "OUTBOX_KAFKA_BOOTSTRAP"}
        }
        env["OUTBOX_PG_PORT"] = str(urlsplit(self.url).port)
        env["OUTBOX_KAFKA_PORT"] = self.addresses[0].rsplit(":", 1)[1]
        env["OUTBOX_KAFKA_BROKERS"] = str(self.brokers)
        for name, port in self.kafka_ports().items():
            env.setdefault(name, port)
        return env

    def kafka_ports(self) -> dict[str, str]:
        """The controller and SASL ports node 1 was started with, from its properties."""
        ports: dict[str, str] = {}
        node = self.node_dirs()[0]
        if node is None:
            return ports
        for line in (node / "server.properties").read_text().splitlines():
            if line.startswith("listeners="):
                for listener in line.removeprefix("listeners=").split(","):
                    name, _, address = listener.partition("://")
                    port = address.rsplit(":", 1)[-1]
                    if name == "CONTROLLER":
                        ports["OUTBOX_KAFKA_CONTROLLER_PORT"] = port
                    elif name == "SASL_SSL":
                        ports["OUTBOX_KAFKA_SASL_PORT"] = port
        ports.setdefault("OUTBOX_KAFKA_SASL_PORT", "0")
        return ports

    def run(self, *command: str, timeout: float = 180.0) -> float:
        """Run a ``services/`` script; the seconds it took. .services.env is kept as it was."""
        env_file = ROOT / ".services.env"
        saved = env_file.read_text() if env_file.exists() else None
        began = time.monotonic()
        try:
            done = subprocess.run(
                [str(ROOT / "services" / command[0]), *command[1:]],
                env=self.environment(),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        finally:
            if saved is not None:
                env_file.write_text(saved)
        if done.returncode != 0:
            raise RuntimeError(
                f"services/{' '.join(command)} exited {done.returncode}: "
                f"{(done.stderr or done.stdout)[-2000:]}"
            )
        return round(time.monotonic() - began, 2)

    def node_dirs(self) -> list[Path | None]:
        """Each broker's directory (its properties name its client port), None if not found."""
        every = sorted((ROOT / ".services").glob("kafka*/**/server.properties"))
        found: list[Path | None] = []
        for address in self.addresses:
            port = address.rsplit(":", 1)[1]
            found.append(
                next(
                    (p.parent for p in every if f":{port}," in p.read_text().replace("\n", ",")),
                    None,
                )
            )
        return found

    def broker_java_opts(self) -> list[str]:
        """The JVM options each broker runs with (``java.opts`` in its directory;
        ``services/kafka-node`` restarts a node with the same); "?" where unknown."""
        found = []
        for node in self.node_dirs():
            opts = "?"
            if node is not None:
                with contextlib.suppress(OSError):
                    opts = (node / "java.opts").read_text().strip()
            found.append(opts)
        return found

    def broker_pids(self) -> list[int]:
        """The pids of the brokers that run (``broker.pid`` in their directories)."""
        pids = []
        for node in self.node_dirs():
            if node is not None:
                with contextlib.suppress(OSError, ValueError):
                    pid = int((node / "broker.pid").read_text().strip())
                    if Path(f"/proc/{pid}").exists():
                        pids.append(pid)
        return pids

    def brokers_up(self) -> list[bool]:
        """Whether each broker's client port accepts a connection."""
        found = []
        for address in self.addresses:
            host, port = address.rsplit(":", 1)
            try:
                with socket.create_connection((host, int(port)), timeout=0.5):
                    found.append(True)
            except OSError:
                found.append(False)
        return found


# --- writers ------------------------------------------------------------------------


@dataclass(frozen=True)
class WriterPlan:
    """What one writer enqueues: its share of the rate, its keys, one or many per transaction."""

    index: int
    rate: float
    batch: tuple[int, int]
    hot_key: str | None
    hot_share: float
    cold_keys: tuple[str, ...]
    repeat_share: float


class Writer(threading.Thread):
    """Enqueues its share of the rate, paced, until told to stop.

    Each message's value is ``key|counter|writer|n|padding``: ``counter``
    counts the key's messages (each key has one writer, so its commit order
    is the key's order), ``n`` the writer's. Its idempotency key is
    ``w<writer>:<n>``; a transaction lost with the connection is sent again
    with the same keys (``common.RetryingEnqueuer``), so it is written once
    whether or not it committed.
    Now and then (``repeat_share`` of the transactions) a message of the last
    few seconds is enqueued again with its idempotency key: the outbox must
    return its first id and write nothing.
    """

    def __init__(
        self,
        plan: WriterPlan,
        url: str,
        topic: str,
        stop: threading.Event,
        progress: Any,
    ) -> None:
        super().__init__(name=f"writer-{plan.index}", daemon=True)
        self.plan, self.url, self.topic, self.stopping = plan, url, topic, stop
        #: Shared with the soak's process: messages committed, per writer.
        self.progress = progress
        self.rng = random.Random(f"writer/{plan.index}")
        #: The last committed counter of each key: the ledger.
        self.counters: dict[str, int] = {}
        self.messages = 0
        self.transactions = 0
        self.repeats = 0
        self.repeats_given_new_ids = 0
        #: Seconds the pacing was behind the schedule at its worst.
        self.most_behind = 0.0
        self.began = 0.0
        self.ended = 0.0
        self.recent: deque[tuple[outbox.Message, uuid.UUID, float]] = deque(maxlen=500)
        #: Three minutes of retries: longer than a PostgreSQL restart takes.
        self.enqueuer = RetryingEnqueuer(url, attempts=180, application_name=f"soak {self.name}")
        self.error: BaseException | None = None
        self.pad = "x" * 80

    def run(self) -> None:
        """Enqueue, paced, until stopped; keep the first error."""
        self.began = time.monotonic()
        start = self.began
        try:
            while not self.stopping.is_set():
                due = start + self.messages / self.plan.rate
                wait = due - time.monotonic()
                if wait > 0:
                    self.stopping.wait(wait)
                    continue
                behind = -wait
                self.most_behind = max(self.most_behind, behind)
                if behind > 10:  # catch up at most 10 s of schedule after an outage
                    start += behind - 10
                self.write_one_transaction()
        except BaseException as exc:  # noqa: BLE001 - reported by the run, which then fails
            self.error = exc
        finally:
            self.ended = time.monotonic()
            self.enqueuer.close()

    def write_one_transaction(self) -> None:
        """Build the next transaction's messages, enqueue them, then count them."""
        low, high = self.plan.batch
        size = self.rng.randint(low, high)
        counters = dict(self.counters)
        fresh = []
        for n in range(self.messages, self.messages + size):
            if self.plan.hot_key is not None and self.rng.random() < self.plan.hot_share:
                key = self.plan.hot_key
            else:
                key = self.rng.choice(self.plan.cold_keys)
            counters[key] = counters.get(key, 0) + 1
            value = f"{key}|{counters[key]}|{self.plan.index}|{n}|{self.pad}"
            fresh.append(
                outbox.Message(
                    self.topic, value.encode(), key=key, idempotency_key=f"w{self.plan.index}:{n}"
                )
            )
        repeat = None
        if self.recent and self.rng.random() < self.plan.repeat_share:
            # Only a message committed a while ago, well within retention.
            candidates = [r for r in self.recent if time.monotonic() - r[2] > 1.0]
            if candidates:
                repeat = self.rng.choice(candidates)
        ids = self.enqueuer.enqueue(fresh + ([repeat[0]] if repeat else []))
        now = time.monotonic()
        if repeat is not None:
            self.repeats += 1
            self.repeats_given_new_ids += ids[-1] != repeat[1]
        self.recent.extend((m, i, now) for m, i in zip(fresh, ids, strict=False))
        self.counters = counters
        self.messages += size
        self.transactions += 1
        self.progress[self.plan.index] = self.messages

    def report(self) -> WriterReport:
        """What the soak's process needs of this writer once it stopped."""
        return WriterReport(
            plan=self.plan,
            counters=self.counters,
            messages=self.messages,
            transactions=self.transactions,
            reconnections=self.enqueuer.reconnections,
            repeats=self.repeats,
            repeats_given_new_ids=self.repeats_given_new_ids,
            most_behind=self.most_behind,
            began=self.began,
            ended=self.ended,
            error=None if self.error is None else repr(self.error),
        )


@dataclass
class WriterReport:
    """One writer's ledger and figures, sent back from its process at the end."""

    plan: WriterPlan
    counters: dict[str, int]
    messages: int
    transactions: int
    reconnections: int
    repeats: int
    repeats_given_new_ids: int
    most_behind: float
    began: float  # time.monotonic(): one clock for every process of the machine
    ended: float
    error: str | None


def run_writers(
    *,
    plans: list[WriterPlan],
    url: str,
    topic: str,
    stop: Any,
    progress: Any,
    reports: Any,
) -> None:
    """A writer process: its writers' threads until ``stop`` is set, then their reports.

    The writers are spread over processes because one interpreter's lock
    cannot keep 2,000 messages a second paced (16 threads in one process
    reached about 1,700).
    """
    stopping = threading.Event()
    writers = [Writer(p, url, topic, stopping, progress) for p in plans]
    for w in writers:
        w.start()
    stop.wait()
    stopping.set()
    for w in writers:
        w.join()
    reports.put([w.report() for w in writers])


class WriterProcesses:
    """The writers, in ``--writer-processes`` processes; their reports once stopped."""

    def __init__(self, plans: list[WriterPlan], url: str, topic: str, processes: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        #: Messages committed so far, per writer (read by the sampler).
        self.progress = context.Array("q", len(plans), lock=False)
        self.reports_queue = context.Queue()
        groups = [plans[i::processes] for i in range(processes)]
        self.processes = [
            context.Process(
                target=run_writers,
                kwargs={
                    "plans": g,
                    "url": url,
                    "topic": topic,
                    "stop": self.stop,
                    "progress": self.progress,
                    "reports": self.reports_queue,
                },
                name=f"writers-{i}",
                daemon=True,
            )
            for i, g in enumerate(groups)
            if g
        ]
        self.plans = plans
        self.reports: list[WriterReport] = []

    def start(self) -> None:
        for p in self.processes:
            p.start()

    def enqueued(self) -> int:
        """Messages committed so far, every writer."""
        return sum(self.progress[:])

    def stop_and_collect(self, timeout: float = 300.0) -> list[WriterReport]:
        """Stop every writer; wait for their reports (a process that died reports an error)."""
        if self.reports or not self.processes:
            return self.reports
        self.stop.set()
        deadline = time.monotonic() + timeout
        got: list[WriterReport] = []
        for _ in self.processes:
            try:
                got.extend(self.reports_queue.get(timeout=max(deadline - time.monotonic(), 0.1)))
            except queue.Empty:
                break
        for p in self.processes:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                p.kill()
        reported = {r.plan.index for r in got}
        for plan in self.plans:
            if plan.index not in reported:
                now = time.monotonic()
                got.append(
                    WriterReport(
                        plan,
                        {},
                        self.progress[plan.index],
                        0,
                        0,
                        0,
                        0,
                        0.0,
                        now,
                        now,
                        "its process ended without a report",
                    )
                )
        self.reports = sorted(got, key=lambda r: r.plan.index)
        return self.reports


def plan_writers(args: argparse.Namespace) -> list[WriterPlan]:
    """Split the rate, the keys and the transaction sizes among the writers.

    Hot key ``h`` belongs to writer ``h`` (so hot keys land on single-message
    and batch writers both) and takes ``--hot-share`` of that writer's
    messages; cold key ``c`` belongs to writer ``c mod writers``.
    """
    plans = []
    for w in range(args.writers):
        single = w % 4 == 0 if args.single_writers is None else w < args.single_writers
        plans.append(
            WriterPlan(
                index=w,
                rate=args.rate / args.writers,
                batch=(1, 1) if single else (args.batch_min, args.batch_max),
                hot_key=f"hot-{w:02d}" if w < args.hot_keys else None,
                hot_share=args.hot_share,
                cold_keys=tuple(f"cold-{c:05d}" for c in range(w, args.cold_keys, args.writers)),
                repeat_share=args.repeat_share,
            )
        )
    return plans


# --- publishers ---------------------------------------------------------------------


@dataclass
class PublisherRun:
    """One publisher process, from its start to its end."""

    slot: int
    number: int
    pid: int
    started_at: float
    log: str
    ended_at: float | None = None
    #: killed (by the soak), stopped (SIGTERM at the end), died (by itself).
    ended_by: str | None = None
    exit_code: int | None = None
    #: (seconds into the run, resident bytes), one per sample.
    rss: list[tuple[float, int]] = field(default_factory=list)


def publisher_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The publishers' flags: shorter timeouts than the defaults (a killed publisher's
    claims come back after a 20 s lease instead of 60 s), retention at its shortest."""
    return (
        "--lease-seconds", str(args.lease_seconds),
        "--heartbeat-interval", "2",
        "--delivery-timeout-ms", "12000",
        "--request-timeout-ms", "5000",
        "--max-block-ms", "5000",
        "--recovery-interval", "2",
        "--reconcile-interval", "5",
        "--purge-delivered-after", args.retention,
        "--purge-evidence-after", args.retention,
        "--purge-interval", str(args.purge_interval),
        "--delivery", args.delivery,
        "--sink", args.sink,
        "--log-level", "INFO",
    )  # fmt: skip


# --- faults -------------------------------------------------------------------------


@dataclass
class Fault:
    """One fault: as planned, then what happened and when the delivery recovered."""

    kind: str
    planned_at: float
    slot: int = -1
    started_at: float | None = None
    ended_at: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    #: The first sample after the fault ended with the lag p99 and the oldest
    #: open message both under the threshold.
    recovered_at: float | None = None
    recovery_seconds: float | None = None
    error: str | None = None

    def window(self, margin: float, *, to_recovery: bool) -> tuple[float, float]:
        """[start, end + margin], reaching to the recovery when that came later."""
        start = self.started_at if self.started_at is not None else self.planned_at
        end = (self.ended_at if self.ended_at is not None else start) + margin
        if to_recovery:
            end = max(end, self.recovered_at if self.recovered_at is not None else float("inf"))
        return start, end


KILL, BROKER_KILL, BROKER_OUTAGE, POSTGRES, FREEZE = (
    "publisher kill",
    "broker kill",
    "broker outage",
    "postgres restart",
    "publisher freeze",
)
#: Not inflicted: the run's first seconds, judged as a fault's window is (see ``execute``).
START = "start"


def plan_faults(seconds: float, args: argparse.Namespace, *, cluster: bool) -> list[Fault]:
    """The faults of a run of ``seconds``, in time order."""
    if args.no_faults:
        return []
    freeze = args.lease_seconds + 10
    main = [
        (
            Fault(BROKER_KILL if cluster else BROKER_OUTAGE, seconds * BROKER_AT),
            args.broker_down + 15.0,
        ),
        (Fault(POSTGRES, seconds * POSTGRES_AT), 10.0),
        (Fault(FREEZE, seconds * FREEZE_AT, slot=0, detail={"planned_seconds": freeze}), freeze),
    ]
    faults = [f for f, _ in main]
    busy = [(f.planned_at - 15, f.planned_at + length + args.recovery_margin) for f, length in main]
    slot = 0
    for fraction in KILLS_AT:
        at = seconds * fraction
        if any(a <= at <= b for a, b in busy):
            continue
        faults.append(Fault(KILL, at, slot=slot))
        busy.append((at - 15, at + args.recovery_margin))
        slot = 1 - slot
    return sorted(faults, key=lambda f: f.planned_at)


# --- the run ------------------------------------------------------------------------


class Soak:
    """One soak: database, topic, writers, publishers, faults, samples, checks."""

    def __init__(self, args: argparse.Namespace, base_url: str, bootstrap: str) -> None:
        self.args, self.base_url, self.bootstrap = args, base_url, bootstrap
        self.services = Services(base_url, bootstrap)
        self.database = f"outbox_soak_{uuid.uuid4().hex[:8]}"
        self.topic = f"soak-{uuid.uuid4().hex[:8]}"
        self.url = ""
        self.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="soak-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.flags = publisher_flags(args)
        self.config = config_of(self.flags, base_url, bootstrap)
        self.seconds = args.minutes * 60
        self.replication = 3 if self.services.brokers >= 3 else 1
        self.slots: list[tuple[subprocess.Popen[bytes], PublisherRun]] = []
        self.runs: list[PublisherRun] = []
        self.frozen: set[int] = set()
        self.began = time.monotonic()
        self.samples: list[dict[str, Any]] = []
        self.sampling = threading.Event()
        self.writer_processes: WriterProcesses | None = None
        self.warmed_up: dict[str, Any] | None = None
        #: Partitions whose leadership the election before the run moved (None: it failed).
        self.leaders_moved: int | None = None
        #: The cluster's other topics and their partitions, when the run began.
        self.other_topics: dict[str, int] = {}
        #: Each writer's report, once the writers stopped.
        self.writers: list[WriterReport] = []
        self.deaths: list[dict[str, Any]] = []
        #: Set when the delivery stalled at the end: what was stuck, and whether
        #: new publisher processes delivered it.
        self.stall: dict[str, Any] | None = None
        #: The plan PostgreSQL would choose now for each publisher statement seen
        #: running longer than STUCK_SECONDS (the statistics it was planned
        #: with may change soon after; the running plan itself cannot be read).
        self.stuck_plans: dict[str, dict[str, Any]] = {}
        #: Publishers restarted because a statement of theirs ran too long.
        self.interventions: list[dict[str, Any]] = []

    def clock(self) -> float:
        """Seconds since the run began."""
        return clock_since(self.began)

    def say(self, text: str) -> None:
        """Print a line of progress, with the time into the run."""
        print(f"  [{self.clock():7.1f} s] {text}", flush=True)

    # --- publishers ---

    def start_publisher(self, slot: int) -> None:
        """Start a publisher in ``slot`` and wait until it registered."""
        number = len(self.runs) + 1
        log = self.log_dir / f"publisher-{number:02d}.log"
        process = start_logged_publisher(self.url, self.bootstrap, *self.flags, log=log)
        run = PublisherRun(slot, number, process.pid, self.clock(), str(log))
        self.runs.append(run)
        if slot < len(self.slots):
            self.slots[slot] = (process, run)
        else:
            self.slots.append((process, run))
        wait_until(
            lambda: registered(self.url, process),
            timeout=120,
            interval=0.1,
            what="the publisher's registration",
        )

    def end_run(self, run: PublisherRun, process: subprocess.Popen[bytes], by: str) -> None:
        """Note how and when a publisher process ended."""
        run.ended_at, run.ended_by, run.exit_code = self.clock(), by, process.returncode

    def replace_the_dead(self) -> None:
        """Replace each publisher that exited on its own (a failure); note it."""
        for slot, (process, run) in enumerate(list(self.slots)):
            if process.poll() is not None and run.ended_by is None:
                self.end_run(run, process, "died")
                self.deaths.append(
                    {
                        "slot": slot,
                        "number": run.number,
                        "pid": run.pid,
                        "exit_code": process.returncode,
                        "at": self.clock(),
                    }
                )
                self.say(
                    f"publisher {run.number} (pid {run.pid}) exited by itself with "
                    f"{process.returncode}; replaced"
                )
                self.start_publisher(slot)

    def idle_until(self, at: float) -> None:
        """Wait until ``at`` seconds into the run, replacing publishers that died and
        restarting those stuck in a statement (``--rescue-after``)."""
        while self.clock() < at:
            self.replace_the_dead()
            self.rescue_the_stuck()
            time.sleep(min(1.0, max(at - self.clock(), 0.0)))

    def rescue_the_stuck(self) -> None:
        """Do what an operator would for a publisher whose statement has run longer than
        ``--rescue-after``: restart it and end the statement's backend. Noted (a person
        was needed), so that one stuck statement does not stop the rest of the run."""
        last = self.samples[-1] if self.samples else {}
        longest = last.get("longest_publisher_statement") or {}
        if not self.args.rescue_after or longest.get("seconds", 0) < self.args.rescue_after:
            return

        def stuck() -> list[tuple[int, int, float, str]]:
            with psycopg.connect(self.url, autocommit=True) as conn:
                return conn.execute(
                    "SELECT p.pid, a.pid, extract(epoch FROM now() - a.query_start)::float8, "
                    "left(regexp_replace(a.query, '\\s+', ' ', 'g'), 80) "
                    "FROM pg_stat_activity AS a JOIN outbox.publishers AS p "
                    "ON a.application_name = 'outbox-publisher ' || p.id "
                    "WHERE a.datname = current_database() AND a.state = 'active' "
                    "AND now() - a.query_start > make_interval(secs => %s)",
                    (self.args.rescue_after,),
                ).fetchall()

        for pid, backend, seconds, statement in patiently(stuck):
            for slot, (process, run) in enumerate(list(self.slots)):
                if run.pid != pid or run.ended_by is not None:
                    continue
                self.say(
                    f"publisher {run.number} stuck {seconds:.0f} s in: {statement}; "
                    "restarting it and ending that statement"
                )
                run.exit_code = stop_and_wait(process, signal.SIGTERM, timeout=20)
                self.end_run(run, process, "restarted: stuck in a statement")
                with contextlib.suppress(psycopg.Error), psycopg.connect(self.url) as conn:
                    conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
                self.interventions.append(
                    {
                        "at": self.clock(),
                        "publisher": run.number,
                        "stuck_seconds": round(seconds, 1),
                        "statement": statement,
                    }
                )
                self.start_publisher(slot)

    # --- faults ---

    def inflict(self, fault: Fault) -> None:
        """Do the fault now; note when it began and ended."""
        self.replace_the_dead()
        try:
            {
                KILL: self.kill_publisher,
                FREEZE: self.freeze_publisher,
                BROKER_KILL: self.kill_broker,
                BROKER_OUTAGE: self.broker_outage,
                POSTGRES: self.restart_postgres,
            }[fault.kind](fault)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be done fails the run
            fault.error = repr(exc)
            self.say(f"{fault.kind} failed: {exc!r}")
        if fault.ended_at is None:
            fault.ended_at = self.clock()

    def kill_publisher(self, fault: Fault) -> None:
        """SIGKILL the publisher of the fault's slot and start another at once."""
        process, run = self.slots[fault.slot]
        fault.detail.update(number=run.number, pid=run.pid)
        fault.started_at = self.clock()
        process.kill()
        process.wait()
        self.end_run(run, process, "killed")
        self.start_publisher(fault.slot)
        fault.ended_at = self.clock()
        fault.detail["replaced_by"] = self.slots[fault.slot][1].number
        self.say(
            f"publisher {run.number} killed; publisher "
            f"{fault.detail['replaced_by']} registered "
            f"{fault.ended_at - fault.started_at:.1f} s later"
        )

    def freeze_publisher(self, fault: Fault) -> None:
        """SIGSTOP a publisher past its lease, then SIGCONT it."""
        process, run = self.slots[fault.slot]
        fault.detail.update(number=run.number, pid=run.pid)
        process.send_signal(signal.SIGSTOP)
        fault.started_at = self.clock()
        self.frozen.add(run.pid)
        wait_until(
            lambda: is_frozen(process.pid) or process.poll() is not None,
            timeout=5,
            interval=0.01,
            what="SIGSTOP",
        )
        time.sleep(fault.detail["planned_seconds"])
        process.send_signal(signal.SIGCONT)
        self.frozen.discard(run.pid)
        fault.ended_at = self.clock()
        self.say(
            f"publisher {run.number} frozen {fault.ended_at - fault.started_at:.1f} s "
            f"(lease {self.args.lease_seconds:g} s), woken"
        )

    def kill_broker(self, fault: Fault) -> None:
        """SIGKILL the broker leading partition 0; start it again after ``--broker-down``."""
        before = patiently(lambda: partition_leaders(self.bootstrap, self.topic))
        node = before[0]["leader"]
        fault.detail.update(node=node, led=[p["partition"] for p in before if p["leader"] == node])
        fault.started_at = self.clock()
        self.services.run("kafka-node", "kill", str(node))
        self.say(f"broker {node} killed (it led partitions {fault.detail['led']})")
        killed = time.monotonic()
        deadline = killed + self.args.broker_down
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                now = partition_leaders(self.bootstrap, self.topic)
                if now and now[0]["leader"] not in {node, -1}:
                    fault.detail["new_leader"] = now[0]["leader"]
                    fault.detail["election_seconds"] = round(time.monotonic() - killed, 2)
                    break
            time.sleep(0.5)
        time.sleep(max(deadline - time.monotonic(), 0.0))
        fault.detail["start_seconds"] = self.services.run("kafka-node", "start", str(node))
        self.say(
            f"broker {node} started again ({fault.detail['start_seconds']} s); new leader "
            f"{fault.detail.get('new_leader')} after {fault.detail.get('election_seconds')} s"
        )
        started = time.monotonic()
        while time.monotonic() - started < 180:
            with contextlib.suppress(Exception):
                now = partition_leaders(self.bootstrap, self.topic)
                if all(len(p["isr"]) >= self.replication for p in now):
                    fault.detail["isr_full_after_start_seconds"] = round(
                        time.monotonic() - started, 2
                    )
                    break
            time.sleep(1.0)
        self.lead_again(fault, node, started)
        fault.ended_at = self.clock()

    def lead_again(self, fault: Fault, node: int, started: float) -> None:
        """Give the restarted broker its partitions back: a preferred leader election,
        as after a rolling restart, inside the fault.

        Kafka would do it on its own (``auto.leader.rebalance.enable``, checked
        every 300 s), at a moment of its choosing: in run C (docs/performance.md,
        "Soak") 240 s after the restart, long after the fault's window had
        closed, with 5 s of lag over 1 s as producers met ``NotLeaderOrFollower``
        and refreshed their metadata. Electing here keeps that step in the
        fault's window, where it belongs. Every partition of the cluster, not only
        the run's: the controller's periodic election would otherwise still move
        the others (other topics on these brokers) later, and a move of tens of
        leaders at once shows in the run's lag too.
        """
        led = set(fault.detail["led"])
        with contextlib.suppress(Exception):
            elect_preferred_leaders(self.bootstrap)
        while time.monotonic() - started < 180:
            with contextlib.suppress(Exception):
                now = partition_leaders(self.bootstrap, self.topic)
                if now and all(p["leader"] == node for p in now if p["partition"] in led):
                    fault.detail["leadership_back_seconds"] = round(time.monotonic() - started, 1)
                    self.say(
                        f"broker {node} leads partitions {sorted(led)} again, "
                        f"{fault.detail['leadership_back_seconds']} s after its restart"
                    )
                    return
            time.sleep(1.0)
        fault.detail["leadership_back_seconds"] = None

    def broker_outage(self, fault: Fault) -> None:
        """One broker: stop it, and start it again after ``--broker-down``."""
        fault.started_at = self.clock()
        fault.detail["stop_seconds"] = self.services.run("down", "kafka")
        self.say("broker stopped (single broker: an outage)")
        time.sleep(max(self.args.broker_down - fault.detail["stop_seconds"], 0.0))
        fault.detail["start_seconds"] = self.services.run("up", "kafka")
        fault.ended_at = self.clock()
        self.say(f"broker started again ({fault.detail['start_seconds']} s)")

    def restart_postgres(self, fault: Fault) -> None:
        """``services/down postgres && services/up postgres``."""
        fault.started_at = self.clock()
        fault.detail["stop_seconds"] = self.services.run("down", "postgres")
        fault.detail["start_seconds"] = self.services.run("up", "postgres")
        fault.ended_at = self.clock()
        self.say(
            f"PostgreSQL restarted (down {fault.detail['stop_seconds']} s, "
            f"up {fault.detail['start_seconds']} s)"
        )

    # --- samples ---

    def sample_forever(self) -> None:
        """Take a sample every ``--sample-interval`` seconds until told to stop, and a
        last one then (counting the deliveries up to that moment)."""
        conn: psycopg.Connection[Any] | None = None
        after: datetime | None = self.db_began
        low: datetime | None = self.db_began
        previous_t = 0.0
        last = False
        while not last:
            last = self.sampling.wait(self.args.sample_interval)
            t = self.clock()
            slack = 0.0 if last else SETTLE_SLACK
            sample: dict[str, Any] = {
                "t": t,
                "covers": [round(previous_t - SETTLE_SLACK, 2), round(t - slack, 2)],
            }
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(
                        self.url, autocommit=True, application_name="soak sampler"
                    )
                after, low = self.read_database(conn, sample, after, low, slack)
                previous_t = t
            except psycopg.Error as exc:
                sample["error"] = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
                if conn is not None:
                    conn.close()
                conn = None
            sample["enqueued"] = (
                0 if self.writer_processes is None else self.writer_processes.enqueued()
            )
            sample["publishers"] = [
                {
                    "slot": run.slot,
                    "number": run.number,
                    "state": "frozen"
                    if run.pid in self.frozen
                    else "running"
                    if process.poll() is None
                    else "down",
                    "rss": rss_bytes(run.pid),
                }
                for process, run in list(self.slots)
            ]
            for p, (_, run) in zip(sample["publishers"], list(self.slots), strict=False):
                if p["rss"] is not None and p["state"] == "running":
                    run.rss.append((t, p["rss"]))
            sample["brokers_up"] = self.services.brokers_up()
            self.samples.append(sample)
        if conn is not None:
            conn.close()

    def read_database(
        self,
        conn: psycopg.Connection[Any],
        sample: dict[str, Any],
        after: datetime | None,
        low: datetime | None,
        slack: float,
    ) -> tuple[datetime, datetime]:
        """Fill ``sample`` from the database; the next sample's lag bounds."""
        row = conn.execute("SELECT now(), now() - make_interval(secs => %s)", (slack,)).fetchone()
        assert row is not None
        now, until = row
        if after is None or low is None:
            after = low = until
        open_counts = dict.fromkeys(OPEN_STATES, 0)
        oldest = 0.0
        for line in read_open_status(conn):
            open_counts[line.state] += line.messages
            oldest = max(oldest, line.oldest_age_seconds or 0.0)
        sample["open"] = open_counts
        sample["oldest_open_s"] = round(oldest, 3)
        lag = conn.execute(
            LAG_QUERY,
            {
                "low": low - timedelta(seconds=ID_MARGIN),
                "after": after,
                "until": until,
                "bounds": list(LAG_BOUNDS_MS),
            },
        ).fetchone()
        assert lag is not None
        count, percentiles, worst, histogram = lag
        sample["delivered"] = count
        sample["lag_ms"] = {
            "p50": round(percentiles[0], 1) if percentiles else None,
            "p99": round(percentiles[1], 1) if percentiles else None,
            "max": round(worst, 1) if worst is not None else None,
        }
        sample["lag_histogram"] = {int(k): v for k, v in histogram.items()}
        tables = {}
        for name, total, table, indexes, live, dead, autovacuums, autoanalyzes in conn.execute(
            SIZES_QUERY
        ):
            tables[name] = {
                "total": total,
                "table": table,
                "indexes": indexes,
                "live": live,
                "dead": dead,
                "autovacuums": autovacuums,
                "autoanalyzes": autoanalyzes,
            }
        sample["tables"] = tables
        longest = conn.execute(LONGEST_STATEMENT).fetchone()
        if longest is not None:
            sample["longest_publisher_statement"] = {
                "seconds": round(longest[0], 1),
                "statement": longest[1],
            }
            if longest[0] > STUCK_SECONDS and longest[1] not in self.stuck_plans:
                self.stuck_plans[longest[1]] = {"t": sample["t"], **explain_named(conn, longest[1])}
        # The next sample reads from the oldest message open now (or enqueued
        # since): whatever it counts as delivered was one of those.
        oldest_open = now - timedelta(seconds=oldest)
        return until, min(oldest_open, until)

    # --- the run ---

    def execute(self) -> dict[str, Any]:
        """Set up, run, drain, read back, check; the result."""
        args = self.args
        faults = plan_faults(self.seconds, args, cluster=self.services.cluster)
        plans = plan_writers(args)
        self.java_opts = self.services.broker_java_opts()
        self.set_up()
        print(
            f"soak: {args.minutes:g} min at {args.rate:,.0f} msg/s from {args.writers} writers "
            f"({sum(p.batch == (1, 1) for p in plans)} one message per transaction), "
            f"{args.hot_keys} hot keys + {args.cold_keys:,} cold, {args.publishers} publishers "
            f"({args.delivery}, lease {args.lease_seconds:g} s, retention {args.retention}), "
            f"topic {self.topic} ({args.partitions} partitions, RF {self.replication}, "
            f"{self.services.brokers} broker(s), JVM {' | '.join(sorted(set(self.java_opts)))}), "
            f"database {self.database}, logs {self.log_dir}",
            flush=True,
        )
        for f in faults:
            print(f"  planned: {f.kind} at {f.planned_at:.0f} s", flush=True)
        self.warmed_up = self.warm_up()
        self.leaders_moved = self.preferred_leaders()
        self.other_topics = self.topics_beside()
        with psycopg.connect(self.url) as conn:
            row = conn.execute("SELECT now()").fetchone()
        assert row is not None
        #: The first sample counts the deliveries since here.
        self.db_began: datetime = row[0]
        self.began = time.monotonic()
        for slot in range(args.publishers):
            self.start_publisher(slot)
        writers = WriterProcesses(plans, self.url, self.topic, args.writer_processes)
        self.writer_processes = writers
        writers.start()
        # The publishers and the writers start cold: new processes, the
        # producers' first connections and metadata, fresh database sessions,
        # a table with no statistics yet. That is a restart of everything at
        # once, so it is judged as a fault is: its window lasts until the first
        # sample with the lag back under the threshold, and at least
        # --recovery-margin (Fault.window); that recovery must come within
        # --recovery-limit; the lag is judged outside the window. Earlier runs
        # had 0.2-0.4 % of all their messages over 1 s in their first 15 s.
        start = Fault(START, 0.0, started_at=0.0, ended_at=round(self.clock(), 2))
        sampler = threading.Thread(target=self.sample_forever, name="sampler", daemon=True)
        sampler.start()
        try:
            for fault in faults:
                self.idle_until(fault.planned_at)
                self.inflict(fault)
            self.idle_until(self.seconds)
            self.writers = writers.stop_and_collect()
            written_at = self.clock()
            self.say(f"writers stopped: {sum(w.messages for w in self.writers):,} messages")
            drained = self.drain()
            if drained is None:
                self.restart_stalled()
        finally:
            self.writers = writers.stop_and_collect()
            for process, run in self.slots:
                process.send_signal(signal.SIGCONT)
                stop_and_wait(process, signal.SIGTERM, timeout=60)
                if run.ended_by is None:
                    self.end_run(run, process, "stopped")
            self.sampling.set()
            sampler.join()
        self.say("publishers stopped; reading the topic back")
        committed, uncommitted = (self.read_view(committed=c) for c in (True, False))
        return self.result([start, *faults], written_at, drained, committed, uncommitted)

    def set_up(self) -> None:
        """A fresh database and a fresh topic (replication factor 3 on three brokers)."""
        self.url = create_database(self.base_url, self.database)
        migrate(self.url)
        self.create_topic(self.topic)

    def create_topic(self, name: str) -> None:
        """A topic of the run's shape: ``--partitions``, and on three brokers RF 3 with
        ``min.insync.replicas=2``."""
        configs = {"min.insync.replicas": "2"} if self.replication == 3 else {}
        patiently(
            lambda: create_replicated_topic(
                self.bootstrap, name, self.args.partitions, self.replication, configs=configs
            )
        )

    def preferred_leaders(self) -> int | None:
        """Every partition of the cluster led by its preferred replica before the run starts.

        Brokers started one after another leave the first one leading the
        partitions of every topic they already held, and the controller moves
        them back on its own schedule (``leader.imbalance.check.interval.seconds``,
        300 s): in a trial, 64 leaders at once 170 s into the run, when the
        run's lag reached 2 s for 10 s. An operator's
        cluster is balanced before the load of a day comes; so is the soak's.
        """
        try:
            moved = elect_preferred_leaders(self.bootstrap)
        except Exception as exc:  # noqa: BLE001 - the run goes on; the result says so
            self.say(f"the preferred leader election before the run failed: {exc!r}")
            return None
        if moved:
            self.say(f"moved the leadership of {moved} partitions back to their preferred replicas")
        return moved

    def topics_beside(self) -> dict[str, int]:
        """The cluster's topics other than the run's (and Kafka's own), said aloud.

        A failed run keeps its topic for inspection. Idle as they are, kept
        topics are not free: their followers keep fetching from their leaders,
        and the controller's periodic leader election moves them too. The
        result records them, so that a run on a crowded cluster says so.
        """
        with contextlib.suppress(Exception):
            others = {
                t: n
                for t, n in topic_partitions(self.bootstrap).items()
                if t != self.topic and not t.startswith("__")
            }
            if others:
                self.say(
                    f"the cluster also holds {len(others)} other topics ({sum(others.values())} "
                    "partitions), earlier runs' kept ones perhaps: the brokers keep replicating "
                    "them beside this run's topic; delete them for a run that measures the "
                    "outbox alone"
                )
            return others
        return {}

    def warm_up(self) -> dict[str, Any] | None:
        """Produce the run's rate to a topic of the same shape until the brokers' JIT
        compilers are quiet, then delete it, so that the run does not measure freshly
        started brokers compiling.

        At least ``--warm-up`` seconds; then on until the brokers' compiler threads
        used under ``--warm-up-quiet`` CPU seconds in the last 10 s, or until
        ``--warm-up-limit``. On two cores, C2 compiling in three fresh brokers took
        a third of a core for about three minutes under the soak's load
        (docs/performance.md, "Soak"): that was the slow start of the earlier runs.
        """
        seconds = self.args.warm_up
        if seconds <= 0:
            return None
        topic = f"{self.topic}-warm-up"
        self.create_topic(topic)
        producer = KafkaProducer(
            bootstrap_servers=self.bootstrap,
            acks="all",
            enable_idempotence=True,
            linger_ms=5,
            client_id="soak-warm-up",
        )
        pids = self.services.broker_pids()

        def compiling() -> float:
            return sum(jit_compiler_seconds(pid) for pid in pids)

        value = b"w" * 120
        sent = 0
        began = time.monotonic()
        compiled_at_start = compiling()
        window: deque[tuple[float, float]] = deque()  # (when, compiler seconds so far)
        last_ten = float("inf")
        try:
            while (elapsed := time.monotonic() - began) < self.args.warm_up_limit:
                due = int(elapsed * self.args.rate) + 1
                for n in range(sent, due):
                    producer.send(topic, value, key=f"k{n % 5000}".encode())
                sent = max(sent, due)
                now = time.monotonic()
                if not window or now - window[-1][0] >= 1.0:
                    window.append((now, compiling()))
                    while len(window) > 1 and now - window[1][0] >= 10.0:
                        window.popleft()
                    span = now - window[0][0]
                    if span >= 10.0:
                        last_ten = (window[-1][1] - window[0][1]) * 10.0 / span
                        if elapsed >= seconds and last_ten < self.args.warm_up_quiet:
                            break
                time.sleep(0.01)
            producer.flush(timeout=60)
        finally:
            producer.close(timeout=10)
            delete_topic(self.bootstrap, topic)
        took = time.monotonic() - began
        done = {"records": sent, "seconds": round(took, 1)}
        if not pids:
            # Nothing to watch (no broker.pid of this checkout's services): only the minimum.
            self.say(
                f"brokers warmed up: {sent:,} records in {took:.1f} s to {topic} (deleted); "
                "their processes were not found, so their compilers were not watched"
            )
            return done | {"quiet": None}
        quiet = last_ten < self.args.warm_up_quiet
        compiled = compiling() - compiled_at_start
        self.say(
            f"brokers warmed up: {sent:,} records in {took:.1f} s to {topic} (deleted); "
            f"their JIT compilers used {compiled:.1f} CPU s, {last_ten:.2f} in the last 10 s"
            + ("" if quiet else f" (not quiet by --warm-up-limit {self.args.warm_up_limit:g} s)")
        )
        return done | {
            "jit_compiler_seconds": round(compiled, 1),
            "jit_compiler_seconds_last_10_s": round(last_ten, 2),
            "quiet": quiet,
        }

    def read_view(self, *, committed: bool) -> dict[str, Any]:
        """The topic as one consumer reads it, against the writers' ledger."""
        expected: dict[str, int] = {}
        for w in self.writers:
            expected.update(w.counters)
        view = read_back(self.bootstrap, self.topic, expected, committed=committed)
        pairs = view.pop("duplicate_pairs")
        if pairs:
            view["duplicates"] = trace_duplicates(
                self.bootstrap, self.topic, pairs, view["isolation"]
            )
        return view

    def restart_stalled(self) -> None:
        """Say what is stuck where, then see whether new processes deliver it (the
        checks then judge every message)."""
        self.stall = {"open": open_counts(self.url), "statements": self.long_statements()}
        for line in self.stall["statements"]:
            self.say(f"  stuck: {line}")
        self.say("restarting every publisher")
        for slot, (process, run) in enumerate(list(self.slots)):
            self.end_run(run, process, "restarted after the stall")
            run.exit_code = stop_and_wait(process, signal.SIGTERM, timeout=30)
            self.start_publisher(slot)
        self.stall["drained_after_restart_seconds"] = self.drain()

    def long_statements(self) -> list[str]:
        """The publishers' statements running for more than 10 s, and for how long."""

        def look() -> list[str]:
            with psycopg.connect(self.url, autocommit=True) as conn:
                rows = conn.execute(
                    "SELECT pid, application_name, now() - query_start, left(query, 200) "
                    "FROM pg_stat_activity WHERE datname = current_database() "
                    "AND state = 'active' AND now() - query_start > interval '10 s' "
                    "AND application_name LIKE 'outbox-publisher%'"
                ).fetchall()
            return [f"backend {p} ({a}) for {t}: {' '.join(q.split())}" for p, a, t, q in rows]

        return patiently(look)

    def drain(self) -> float | None:
        """Wait until no message is open; the seconds it took (``None``: gave up)."""
        start = last_change = last_report = time.monotonic()
        last: dict[str, int] = {}
        while True:
            self.replace_the_dead()
            self.rescue_the_stuck()
            counts = patiently(lambda: open_counts(self.url))
            now = time.monotonic()
            if not any(counts.values()):
                return round(now - start, 2)
            if counts != last:
                last, last_change = counts, now
            if now - last_change > self.args.stall_seconds or now - start > self.args.drain_timeout:
                self.say(f"not drained: {counts}")
                return None
            if now - last_report > 10:
                self.say(f"draining: {counts}")
                last_report = now
            time.sleep(0.5)

    def result(
        self,
        faults: list[Fault],
        written_at: float,
        drained: float | None,
        committed: dict[str, Any],
        uncommitted: dict[str, Any],
    ) -> dict[str, Any]:
        """Every figure of the run, and the checks."""
        args = self.args
        for fault in faults:
            recovery(fault, self.samples, threshold_ms=args.lag_threshold_ms)
        writer_seconds = max(w.ended for w in self.writers) - min(w.began for w in self.writers)
        messages = sum(w.messages for w in self.writers)
        left_open = patiently(lambda: open_counts(self.url))
        result: dict[str, Any] = {
            "minutes": args.minutes,
            "database": self.database,
            "topic": self.topic,
            "log_dir": str(self.log_dir),
            "brokers": self.services.brokers,
            "replication_factor": self.replication,
            "broker_java_opts": self.java_opts,
            "partitions": args.partitions,
            "delivery": args.delivery,
            "sink": args.sink,
            "publishers": args.publishers,
            "flags": list(self.flags),
            "write_deadline_seconds": self.config.write_deadline_seconds,
            "absence_grace_seconds": self.config.absence_grace,
            "rate_asked": args.rate,
            "broker_warm_up": self.warmed_up,
            "leaders_moved_before_run": self.leaders_moved,
            "other_topics": self.other_topics,
            "recovery_margin": args.recovery_margin,
            "rate_achieved": round(messages / writer_seconds, 1),
            "messages": messages,
            "keys": sum(len(w.counters) for w in self.writers),
            "transactions": sum(w.transactions for w in self.writers),
            "one_message_transactions": sum(
                w.transactions for w in self.writers if w.plan.batch == (1, 1)
            ),
            "idempotency_repeats": sum(w.repeats for w in self.writers),
            "idempotency_repeats_given_new_ids": sum(w.repeats_given_new_ids for w in self.writers),
            "writer_reconnections": sum(w.reconnections for w in self.writers),
            "writer_most_behind_seconds": round(max(w.most_behind for w in self.writers), 2),
            "writer_errors": [w.error for w in self.writers if w.error is not None],
            "writers": [
                {
                    "index": w.plan.index,
                    "per_transaction": list(w.plan.batch),
                    "hot_key": w.plan.hot_key,
                    "messages": w.messages,
                    "rate": round(w.messages / max(w.ended - w.began, 1e-9), 1),
                    "most_behind_seconds": round(w.most_behind, 2),
                }
                for w in self.writers
            ],
            "seconds_writing": written_at,
            "seconds_draining": drained,
            "stalled": self.stall,
            "stuck_statement_plans": self.stuck_plans,
            "left_open": left_open,
            "read_committed": committed,
            "read_uncommitted": uncommitted,
            "faults": [asdict(f) for f in faults],
            "publisher_runs": [asdict(r) | {"rss": None} for r in self.runs],
            "publishers_died": self.deaths,
            "interventions": self.interventions,
            "log_events": log_events(self.log_dir),
            "samples": len(self.samples),
            # Every delivery should be counted by exactly one sample's lag.
            "deliveries_counted_by_samples": sum(s.get("delivered", 0) for s in self.samples),
            "sample_errors": sum(1 for s in self.samples if "error" in s),
        }
        result["lag"] = lag_figures(self.samples, faults, args, written_at)
        result["size"] = size_figures(self.samples, args, self.config, written_at)
        result["memory"] = memory_figures(self.runs, args, self.seconds)
        result["failures"] = failures(result, faults, args)
        return result

    def clean_up(self, keep: bool) -> None:
        """Drop the database and the topic, unless they are kept for inspection."""
        if keep:
            print(f"  kept: database {self.database}, topic {self.topic}", flush=True)
            return
        drop_database(self.base_url, self.database)
        delete_topic(self.bootstrap, self.topic)


def open_counts(url: str) -> dict[str, int]:
    """Messages in each open state, read through the open states' partial indexes."""
    counts = dict.fromkeys(OPEN_STATES, 0)
    with psycopg.connect(url) as conn:
        for line in read_open_status(conn):
            counts[line.state] += line.messages
    return counts


# --- reading back -------------------------------------------------------------------


def records(bootstrap: str, topic: str, *, committed: bool) -> Iterator[Any]:
    """Every record of ``topic`` up to the end offsets at the start (read_committed: the
    last stable offsets), partition by partition interleaved as the consumer fetches."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        group_id=None,
        isolation_level="read_committed" if committed else "read_uncommitted",
        max_poll_records=5000,
        fetch_max_bytes=64 * 1024 * 1024,
        max_partition_fetch_bytes=16 * 1024 * 1024,
    )
    try:
        partitions = wait_until(
            lambda: consumer.partitions_for_topic(topic), timeout=60, what=f"topic {topic} metadata"
        )
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        idle_since = time.monotonic()
        while any(consumer.position(tp) < end[tp] for tp in tps):
            batches = consumer.poll(timeout_ms=500)
            if batches:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > 120:
                raise RuntimeError(f"reading {topic}: nothing fetched for 120 s, end {end}")
            for batch in batches.values():
                yield from batch
    finally:
        consumer.close()


def read_back(
    bootstrap: str, topic: str, expected: dict[str, int], *, committed: bool
) -> dict[str, Any]:
    """What one consumer read, against the writers' ledger.

    ``expected`` is each key's last committed counter: counters 1..n of each
    key must be read once each, in order, all in one partition.
    """
    began = time.monotonic()
    copies = {key.encode(): bytearray(n + 1) for key, n in expected.items()}
    partition_of: dict[bytes, int] = {}
    last: dict[bytes, int] = {}
    read = foreign = unknown_counter = 0
    split: set[bytes] = set()
    violations: list[dict[str, Any]] = []
    for r in records(bootstrap, topic, committed=committed):
        read += 1
        seen = copies.get(r.key) if r.key is not None else None
        try:
            counter = int(r.value.split(b"|", 2)[1])
        except (IndexError, ValueError):
            counter = -1
        if seen is None or counter < 0:
            foreign += 1
            continue
        if counter == 0 or counter >= len(seen):
            unknown_counter += 1
            continue
        if partition_of.setdefault(r.key, r.partition) != r.partition:
            split.add(r.key)
        if seen[counter] == 0:
            if counter < last.get(r.key, 0):
                violations.append(
                    {
                        "key": r.key.decode(),
                        "partition": r.partition,
                        "offset": r.offset,
                        "counter": counter,
                        "after": last[r.key],
                    }
                )
            last[r.key] = max(last.get(r.key, 0), counter)
        if seen[counter] < 255:
            seen[counter] += 1
    lost = duplicated = 0
    duplicate_pairs: list[tuple[str, int]] = []
    for key, seen in copies.items():
        for counter in range(1, len(seen)):
            if seen[counter] == 0:
                lost += 1
            elif seen[counter] > 1:
                duplicated += seen[counter] - 1
                duplicate_pairs.append((key.decode(), counter))
    return {
        "isolation": "read_committed" if committed else "read_uncommitted",
        "records": read,
        "messages_expected": sum(expected.values()),
        "lost": lost,
        "duplicated_records": duplicated,
        "messages_duplicated": len(duplicate_pairs),
        "order_violations": len(violations),
        "first_order_violations": violations[:10],
        "keys_in_several_partitions": len(split),
        "foreign_records": foreign,
        "records_past_the_ledger": unknown_counter,
        "seconds": round(time.monotonic() - began, 1),
        "duplicate_pairs": duplicate_pairs[:1000],
    }


def trace_duplicates(
    bootstrap: str, topic: str, pairs: list[tuple[str, int]], isolation: str
) -> list[dict[str, Any]]:
    """For each duplicated (key, counter): its copies' outbox ids and locations.

    Two ids: the outbox wrote the message twice (an idempotency key failed).
    One id twice: the publisher sent it twice.
    """
    wanted = {(k.encode(), c) for k, c in pairs[:100]}
    found: dict[tuple[bytes, int], list[dict[str, Any]]] = {p: [] for p in wanted}
    for r in records(bootstrap, topic, committed=isolation == "read_committed"):
        try:
            pair = (r.key, int(r.value.split(b"|", 2)[1]))
        except (IndexError, ValueError):
            continue
        if pair in found:
            ids = [v.decode() for k, v in r.headers if k == "outbox-id"]
            found[pair].append({"partition": r.partition, "offset": r.offset, "outbox_id": ids})
    return [
        {
            "key": k.decode(),
            "counter": c,
            "copies": copies,
            "distinct_ids": len({tuple(x["outbox_id"]) for x in copies}),
        }
        for (k, c), copies in sorted(found.items())
    ]


# --- figures and checks -------------------------------------------------------------


def recovery(fault: Fault, samples: Sequence[dict[str, Any]], *, threshold_ms: float) -> None:
    """The first sample after the fault ended whose lag p99 and oldest open message are
    both under the threshold: the delivery is back to normal, nobody having done anything."""
    if fault.ended_at is None:
        return
    for s in samples:
        if s["t"] < fault.ended_at or "error" in s or not s.get("delivered"):
            continue
        if s["lag_ms"]["p99"] < threshold_ms and s["oldest_open_s"] * 1000 < threshold_ms:
            fault.recovered_at = s["t"]
            fault.recovery_seconds = round(s["t"] - fault.ended_at, 1)
            return


def histogram_percentile(histogram: dict[int, int], p: float) -> float | None:
    """The upper bound (ms) of the bucket holding percentile ``p`` (inf past the last)."""
    total = sum(histogram.values())
    if not total:
        return None
    rank, seen = p / 100 * total, 0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= rank:
            return float(LAG_BOUNDS_MS[bucket]) if bucket < len(LAG_BOUNDS_MS) else float("inf")
    return float("inf")


def share_over(histogram: dict[int, int], threshold_ms: float) -> float | None:
    """The share of the messages in buckets reaching past ``threshold_ms`` (exact when the
    threshold is a bucket's bound, as 1,000 ms is; otherwise it can only overstate)."""
    total = sum(histogram.values())
    if not total:
        return None
    over = sum(
        n
        for bucket, n in histogram.items()
        if bucket >= len(LAG_BOUNDS_MS) or LAG_BOUNDS_MS[bucket] > threshold_ms
    )
    return round(over / total, 5)


def outside(sample: dict[str, Any], windows: Sequence[tuple[float, float]]) -> bool:
    """Whether the deliveries a sample counts came outside every window."""
    a, b = sample["covers"]
    return all(b < start or a > end for start, end in windows)


def lag_figures(
    samples: Sequence[dict[str, Any]],
    faults: Sequence[Fault],
    args: argparse.Namespace,
    written_at: float,
) -> dict[str, Any]:
    """Lag over the run, outside the fault windows (two readings of a window) and in all."""
    steady = [s for s in samples if "error" not in s and s["t"] <= written_at]
    figures: dict[str, Any] = {}
    for name, to_recovery in (("outside_windows", True), ("outside_fixed_windows", False)):
        windows = [f.window(args.recovery_margin, to_recovery=to_recovery) for f in faults]
        chosen = [s for s in steady if outside(s, windows)]
        merged: dict[int, int] = {}
        for s in chosen:
            for bucket, n in s["lag_histogram"].items():
                merged[bucket] = merged.get(bucket, 0) + n
        over = [s for s in chosen if s["delivered"] and s["lag_ms"]["p99"] >= args.lag_threshold_ms]
        figures[name] = {
            "samples": len(chosen),
            "messages": sum(merged.values()),
            "p50_ms_at_most": histogram_percentile(merged, 50),
            "p99_ms_at_most": histogram_percentile(merged, 99),
            "p999_ms_at_most": histogram_percentile(merged, 99.9),
            "share_over_threshold": share_over(merged, args.lag_threshold_ms),
            "max_ms": max((s["lag_ms"]["max"] for s in chosen if s["delivered"]), default=None),
            "samples_with_p99_over_threshold": len(over),
            "worst_samples": [
                {"t": s["t"], "p99_ms": s["lag_ms"]["p99"], "max_ms": s["lag_ms"]["max"]}
                for s in sorted(over, key=lambda s: -s["lag_ms"]["p99"])[:10]
            ],
        }
    merged_all: dict[int, int] = {}
    for s in steady:
        for bucket, n in s["lag_histogram"].items():
            merged_all[bucket] = merged_all.get(bucket, 0) + n
    figures["whole_run"] = {
        "messages": sum(merged_all.values()),
        "p50_ms_at_most": histogram_percentile(merged_all, 50),
        "p99_ms_at_most": histogram_percentile(merged_all, 99),
        "max_ms": max((s["lag_ms"]["max"] for s in steady if s.get("delivered")), default=None),
    }
    return figures


def total_size(sample: dict[str, Any]) -> int:
    """Table plus index bytes of every outbox table."""
    return sum(t["total"] for t in sample["tables"].values())


def size_figures(
    samples: Sequence[dict[str, Any]], args: argparse.Namespace, config: Any, written_at: float
) -> dict[str, Any]:
    """Size at a third of the run and at its end (before the drain).

    Judged only when a third of the run is past the retention window and two
    purge passes: before that, retention has not begun to delete.
    """
    sized = [s for s in samples if "tables" in s and s["t"] <= written_at]
    if not sized:
        return {"judged": False, "why": "no sample"}
    third = min(sized, key=lambda s: abs(s["t"] - written_at / 3))
    end = sized[-1]
    retention = config.min_purge_delivered_seconds
    with contextlib.suppress(ValueError):
        retention = outbox_duration(args.retention)
    settle = retention + 2 * args.purge_interval
    figures: dict[str, Any] = {
        "at_third": {
            "t": third["t"],
            "bytes": total_size(third),
            "messages_table": third["tables"]["messages"]["table"],
            "messages_indexes": third["tables"]["messages"]["indexes"],
        },
        "at_end": {
            "t": end["t"],
            "bytes": total_size(end),
            "messages_table": end["tables"]["messages"]["table"],
            "messages_indexes": end["tables"]["messages"]["indexes"],
        },
        "largest_bytes": max(total_size(s) for s in sized),
        "ratio": round(total_size(end) / max(total_size(third), 1), 3),
        "by_table_at_end": {k: v["total"] for k, v in end["tables"].items()},
        "by_table_at_third": {k: v["total"] for k, v in third["tables"].items()},
        "dead_tuples_at_end": end["tables"]["messages"]["dead"],
        "most_dead_tuples": max(s["tables"]["messages"]["dead"] or 0 for s in sized),
        "autovacuums_of_messages": (end["tables"]["messages"]["autovacuums"] or 0)
        - (sized[0]["tables"]["messages"]["autovacuums"] or 0),
        "judged": third["t"] >= settle,
    }
    if not figures["judged"]:
        figures["why"] = (
            f"a third of the run ({third['t']:.0f} s) comes before retention's window and two "
            f"passes ({settle:.0f} s): the table has not stopped growing by then"
        )
    return figures


def outbox_duration(text: str) -> float:
    """Seconds of a retention window such as ``5m``."""
    from outbox.retention import parse_duration  # noqa: PLC0415 - one use

    return parse_duration(text).total_seconds()


def memory_figures(
    runs: Sequence[PublisherRun], args: argparse.Namespace, seconds: float
) -> dict[str, Any]:
    """Each publisher's resident memory after its warm-up and at its end.

    A process is judged when it lived at least twice the warm-up
    (``min(2 min, a fifth of the run)``): its RSS at its last sample must be
    within ``--memory-ratio`` of its RSS at the first sample after warm-up.
    """
    warm_up = min(120.0, seconds / 5)
    found = []
    for run in runs:
        after = [(t, b) for t, b in run.rss if t >= run.started_at + warm_up]
        entry: dict[str, Any] = {
            "number": run.number,
            "slot": run.slot,
            "lived_seconds": round((run.ended_at or 0) - run.started_at, 1),
            "ended_by": run.ended_by,
            "largest_mib": round(max((b for _, b in run.rss), default=0) / 2**20, 1),
        }
        if after and after[-1][0] - run.started_at >= 2 * warm_up:
            entry |= {
                "after_warm_up_mib": round(after[0][1] / 2**20, 1),
                "at_end_mib": round(after[-1][1] / 2**20, 1),
                "ratio": round(after[-1][1] / after[0][1], 3),
            }
        found.append(entry)
    judged = [e for e in found if "ratio" in e]
    return {
        "warm_up_seconds": warm_up,
        "processes": found,
        "judged": len(judged),
        "largest_ratio": max((e["ratio"] for e in judged), default=None),
        "largest_mib_any_process": max((e["largest_mib"] for e in found), default=None),
    }


def failures(
    result: dict[str, Any], faults: Sequence[Fault], args: argparse.Namespace
) -> list[str]:
    """Each check that failed, in words (empty: the run passed): delivery, then health."""
    found = []
    view = result["read_committed"]
    for name, label in (
        ("lost", "lost"),
        ("duplicated_records", "duplicated records"),
        ("order_violations", "per-key order violations"),
        ("keys_in_several_partitions", "keys in several partitions"),
        ("foreign_records", "records of no writer"),
        ("records_past_the_ledger", "records past a key's last committed counter"),
    ):
        if view[name]:
            found.append(f"read_committed: {view[name]} {label}")
    if result["idempotency_repeats_given_new_ids"]:
        found.append(
            f"{result['idempotency_repeats_given_new_ids']} repeated idempotency keys were given "
            "a new message id"
        )
    if any(result["left_open"].values()):
        found.append(f"messages left open at the end: {result['left_open']}")
    if result["seconds_draining"] is None:
        stall = result["stalled"] or {}
        found.append(
            "the delivery did not drain after the writers stopped"
            + (
                f" (stuck: {stall.get('statements')}; after restarting the publishers: drained "
                f"in {stall.get('drained_after_restart_seconds')} s)"
                if stall
                else ""
            )
        )
    if result["writer_errors"]:
        found.append(f"writers failed: {result['writer_errors']}")
    if result["stuck_statement_plans"]:
        found.append(
            f"publisher statements ran over {STUCK_SECONDS:g} s: "
            f"{sorted({p['query'] or '?' for p in result['stuck_statement_plans'].values()})}"
        )
    if result["interventions"]:
        found.append(
            f"{len(result['interventions'])} publishers were restarted by hand, stuck in a "
            "statement (see interventions)"
        )
    if result["publishers_died"]:
        found.append(f"publishers exited by themselves: {result['publishers_died']}")
    return found + health_failures(result, faults, args)


def health_failures(
    result: dict[str, Any], faults: Sequence[Fault], args: argparse.Namespace
) -> list[str]:
    """The checks of lag, recovery, size and memory that failed."""
    found = []
    lag = result["lag"]["outside_windows"]
    if lag["p99_ms_at_most"] is None or lag["p99_ms_at_most"] > args.lag_threshold_ms:
        found.append(
            f"lag p99 outside the fault windows at most {lag['p99_ms_at_most']} ms, "
            f"over {args.lag_threshold_ms:g} ms"
        )
    for f in faults:
        if f.error:
            found.append(f"{f.kind} at {f.planned_at:.0f} s could not be done: {f.error}")
        elif f.recovery_seconds is None:
            found.append(
                f"{f.kind} at {f.started_at} s: the lag never came back under "
                f"{args.lag_threshold_ms:g} ms"
            )
        elif f.recovery_seconds > args.recovery_limit:
            found.append(
                f"{f.kind} at {f.started_at} s: recovered {f.recovery_seconds} s after "
                f"it ended, over {args.recovery_limit:g} s"
            )
    size = result["size"]
    if size["judged"] and size["ratio"] > args.size_ratio:
        found.append(
            f"outbox tables grew {size['ratio']}x from a third of the run to its end, "
            f"over {args.size_ratio:g}x"
        )
    memory = result["memory"]
    if memory["largest_ratio"] is not None and memory["largest_ratio"] > args.memory_ratio:
        found.append(
            f"a publisher's memory grew {memory['largest_ratio']}x after its warm-up, "
            f"over {args.memory_ratio:g}x"
        )
    return found


# --- reporting ----------------------------------------------------------------------


def summarise(result: dict[str, Any]) -> None:
    """Print the figures of the run."""
    print(
        f"soak: {result['minutes']:g} min, {result['messages']:,} messages "
        f"({result['rate_achieved']:,.0f} msg/s of {result['rate_asked']:,.0f} asked) in "
        f"{result['transactions']:,} transactions over {result['keys']:,} keys; "
        f"{result['idempotency_repeats']} idempotency keys repeated "
        f"({result['idempotency_repeats_given_new_ids']} given a new id)"
    )
    for name in ("read_committed", "read_uncommitted"):
        v = result[name]
        print(
            f"  {name}: {v['records']:,} records; lost {v['lost']}, duplicated "
            f"{v['duplicated_records']} ({v['messages_duplicated']} messages), order violations "
            f"{v['order_violations']}, keys split {v['keys_in_several_partitions']}, foreign "
            f"{v['foreign_records']} ({v['seconds']} s)"
        )
    for f in result["faults"]:
        print(
            f"  {f['kind']:16} at {f['started_at']} s, ended {f['ended_at']} s: recovered "
            f"{f['recovery_seconds']} s after; {json.dumps(f['detail'])}"
            + (f"; ERROR {f['error']}" if f["error"] else "")
        )
    for name in ("outside_windows", "outside_fixed_windows", "whole_run"):
        lag = result["lag"][name]
        print(
            f"  lag {name}: p50 <= {lag['p50_ms_at_most']} ms, p99 <= {lag['p99_ms_at_most']} ms, "
            f"max {lag['max_ms']} ms over {lag['messages']:,} messages"
            + (
                f", {lag['samples_with_p99_over_threshold']} samples with p99 over the threshold"
                if "samples" in lag
                else ""
            )
            + (
                f", {100 * lag['share_over_threshold']:.2f} % of the messages over it"
                if lag.get("share_over_threshold") is not None
                else ""
            )
        )
    size = result["size"]
    if "at_third" in size:
        print(
            f"  outbox tables: {size['at_third']['bytes'] / 2**20:.0f} MiB at "
            f"{size['at_third']['t']:.0f} s, "
            f"{size['at_end']['bytes'] / 2**20:.0f} MiB at {size['at_end']['t']:.0f} s "
            f"({size['ratio']}x{'' if size['judged'] else ', not judged: ' + size['why']}); "
            f"dead tuples at most {size['most_dead_tuples']:,}; autovacuums of messages "
            f"{size['autovacuums_of_messages']}"
        )
    memory = result["memory"]
    for e in memory["processes"]:
        print(
            f"  publisher {e['number']} (slot {e['slot']}): lived {e['lived_seconds']} s, ended "
            f"{e['ended_by']}, largest {e['largest_mib']} MiB"
            + (
                f", {e['after_warm_up_mib']} -> {e['at_end_mib']} MiB ({e['ratio']}x)"
                if "ratio" in e
                else ""
            )
        )
    events = ", ".join(f"{k} {v}" for k, v in result["log_events"].items() if v)
    print(f"  in the publishers' logs: {events or 'nothing notable'}")
    print(
        f"  writers reconnected {result['writer_reconnections']} times, at most "
        f"{result['writer_most_behind_seconds']} s behind their schedule; drained in "
        f"{result['seconds_draining']} s; {result['sample_errors']} of {result['samples']} "
        "samples failed (database down)"
    )
    verdict = "PASS" if not result["failures"] else "FAIL: " + "; ".join(result["failures"])
    print(f"  {verdict}", flush=True)


def plot(samples: Sequence[dict[str, Any]], result: dict[str, Any], path: Path) -> None:
    """Five panels over the run's minutes: lag, open messages, sizes, dead tuples, RSS;
    the fault windows shaded."""
    import matplotlib  # noqa: PLC0415 - only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ok = [s for s in samples if "error" not in s]
    minutes = [s["t"] / 60 for s in ok]
    fig, axes = plt.subplots(5, 1, figsize=(11, 13), sharex=True)
    lag, backlog, sizes, dead, rss = axes
    with_lag = [s for s in ok if s["delivered"]]
    lag.plot(
        [s["t"] / 60 for s in with_lag],
        [s["lag_ms"]["p99"] for s in with_lag],
        label="p99",
        color="tab:red",
        linewidth=1,
    )
    lag.plot(
        [s["t"] / 60 for s in with_lag],
        [s["lag_ms"]["p50"] for s in with_lag],
        label="p50",
        color="tab:blue",
        linewidth=1,
    )
    lag.axhline(1000, color="grey", linestyle=":", linewidth=1)
    lag.set_yscale("log")
    lag.set_ylabel("lag, commit to\nconfirmed (ms)")
    lag.legend(loc="upper left", fontsize=8)
    backlog.plot(minutes, [sum(s["open"].values()) for s in ok], color="tab:purple", linewidth=1)
    backlog.set_ylabel("open messages")
    backlog.set_yscale("symlog", linthresh=100)
    sizes.plot(
        minutes,
        [total_size(s) / 2**20 for s in ok],
        label="all outbox tables",
        color="black",
        linewidth=1,
    )
    sizes.plot(
        minutes,
        [s["tables"]["messages"]["table"] / 2**20 for s in ok],
        label="messages: table",
        color="tab:green",
        linewidth=1,
    )
    sizes.plot(
        minutes,
        [s["tables"]["messages"]["indexes"] / 2**20 for s in ok],
        label="messages: indexes",
        color="tab:olive",
        linewidth=1,
    )
    sizes.set_ylabel("size (MiB)")
    sizes.legend(loc="upper left", fontsize=8)
    dead.plot(
        minutes,
        [s["tables"]["messages"]["dead"] or 0 for s in ok],
        color="tab:brown",
        linewidth=1,
        label="messages",
    )
    dead.plot(
        minutes,
        [s["tables"].get("batches", {}).get("dead") or 0 for s in ok],
        color="tab:cyan",
        linewidth=1,
        label="batches",
    )
    dead.set_ylabel("dead tuples")
    dead.legend(loc="upper left", fontsize=8)
    memory: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for sample in samples:
        for p in sample["publishers"]:
            if p["rss"] is not None and p["state"] == "running":
                memory.setdefault((p["number"], p["slot"]), []).append((sample["t"], p["rss"]))
    for (_, slot), points in sorted(memory.items()):
        rss.plot(
            [t / 60 for t, _ in points],
            [b / 2**20 for _, b in points],
            color=("tab:blue", "tab:orange")[slot % 2],
            linewidth=1,
        )
    rss.set_ylabel("publisher RSS (MiB)\n(blue: slot 0, orange: 1)")
    rss.set_xlabel("minutes")
    colours = {
        KILL: "tab:orange",
        FREEZE: "tab:cyan",
        POSTGRES: "tab:green",
        BROKER_KILL: "tab:red",
        BROKER_OUTAGE: "tab:red",
        START: "tab:gray",
    }
    for f in result["faults"]:
        if f["started_at"] is None:
            continue
        # The window, then (paler) on to the recovery when that came later.
        end = (f["ended_at"] or f["started_at"]) + result["recovery_margin"]
        recovered = max(f["recovered_at"] or end, end)
        for ax in axes:
            ax.axvspan(
                f["started_at"] / 60, end / 60, color=colours[f["kind"]], alpha=0.2, linewidth=0
            )
            ax.axvspan(end / 60, recovered / 60, color=colours[f["kind"]], alpha=0.08, linewidth=0)
        lag.annotate(
            f["kind"].replace("publisher ", "").replace(" restart", ""),
            (f["started_at"] / 60, 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            rotation=90,
            va="top",
        )
    for ax in axes:
        ax.grid(alpha=0.3)
    verdict = "pass" if not result["failures"] else f"{len(result['failures'])} check(s) failed"
    flags = result["flags"]
    retention = flags[flags.index("--purge-delivered-after") + 1]
    fig.suptitle(
        f"Soak, {result['minutes']:g} min: {result['rate_achieved']:,.0f} msg/s, "
        f"{result['brokers']} broker(s), RF {result['replication_factor']}, "
        f"{result['publishers']} publishers, retention {retention} ({verdict})"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summary_of(result: dict[str, Any]) -> dict[str, Any]:
    """What latest.json keeps of a run: not the per-writer and per-process detail nor the
    read_uncommitted view (soak.json has them)."""
    return {
        k: v
        for k, v in result.items()
        if k not in {"read_uncommitted", "writers", "publisher_runs"}
    }


def write_series(result: dict[str, Any], samples: Sequence[dict[str, Any]]) -> None:
    """The whole time series and the result into soak.json."""
    SERIES.parent.mkdir(parents=True, exist_ok=True)
    partial = SERIES.with_suffix(".tmp")
    partial.write_text(
        json.dumps({**stamp(), "result": result, "samples": samples}, default=str) + "\n"
    )
    partial.replace(SERIES)


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=2000.0, help="messages a second, all writers")
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument(
        "--writer-processes",
        type=int,
        default=4,
        help="processes the writers are spread over (threads within each)",
    )
    parser.add_argument(
        "--single-writers",
        type=int,
        default=None,
        help="writers of one message a transaction (default: every 4th)",
    )
    parser.add_argument("--batch-min", type=int, default=5)
    parser.add_argument("--batch-max", type=int, default=50)
    parser.add_argument("--hot-keys", type=int, default=8)
    parser.add_argument(
        "--hot-share",
        type=float,
        default=0.5,
        help="share of its writer's messages a hot key takes",
    )
    parser.add_argument("--cold-keys", type=int, default=5000)
    parser.add_argument(
        "--repeat-share",
        type=float,
        default=0.02,
        help="transactions that also enqueue an earlier message again",
    )
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--publishers", type=int, default=2)
    parser.add_argument("--delivery", choices=("idempotent", "transactional"), default="idempotent")
    parser.add_argument("--sink", choices=("kafka-python", "confluent"), default="kafka-python")
    parser.add_argument("--lease-seconds", type=float, default=20.0)
    parser.add_argument("--retention", default="5m", help="--purge-delivered-after (and evidence)")
    parser.add_argument("--purge-interval", type=float, default=30.0)
    parser.add_argument("--broker-down", type=float, default=30.0, help="seconds")
    parser.add_argument("--no-faults", action="store_true", help="the same load, no fault")
    parser.add_argument(
        "--warm-up",
        type=float,
        default=60.0,
        help="at least this many seconds of the rate produced to a throwaway topic before "
        "the run, and on until the brokers' JIT compilers are quiet; 0: no warm-up",
    )
    parser.add_argument(
        "--warm-up-quiet",
        type=float,
        default=0.5,
        help="the warm-up ends once the brokers' compiler threads used less than this many "
        "CPU seconds in 10 s (all brokers together)",
    )
    parser.add_argument(
        "--warm-up-limit",
        type=float,
        default=360.0,
        help="seconds after which the warm-up ends, quiet or not",
    )
    parser.add_argument("--sample-interval", type=float, default=5.0)
    parser.add_argument("--lag-threshold-ms", type=float, default=1000.0)
    parser.add_argument(
        "--recovery-margin",
        type=float,
        default=30.0,
        help="seconds a fault's window lasts after it ended",
    )
    parser.add_argument(
        "--recovery-limit",
        type=float,
        default=None,
        help="seconds after a fault ended by which the lag must be back "
        "under the threshold (default: lease + write deadline + absence "
        "grace + 30 s, the longest a killed publisher's messages wait)",
    )
    parser.add_argument(
        "--rescue-after",
        type=float,
        default=120.0,
        help="restart a publisher whose statement has run this long, as an operator would "
        "(noted, and the run fails); 0: never",
    )
    parser.add_argument("--size-ratio", type=float, default=1.3)
    parser.add_argument("--memory-ratio", type=float, default=1.2)
    parser.add_argument("--drain-timeout", type=float, default=600.0)
    parser.add_argument("--stall-seconds", type=float, default=180.0)
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument(
        "--replot",
        action="store_true",
        help="only draw the plot (and record the summary) again from soak.json",
    )
    parser.add_argument("--keep", action="store_true", help="keep the database and topic")
    parser.add_argument(
        "--no-record", action="store_true", help="leave latest.json as it is (a trial run)"
    )
    parser.add_argument(
        "--allow-shared-services",
        action="store_true",
        help="run although other sessions use this PostgreSQL",
    )
    args = parser.parse_args()
    if (
        args.minutes <= 0
        or args.rate <= 0
        or args.writers < 1
        or args.publishers < 1
        or args.writer_processes < 1
    ):
        parser.error(
            "--minutes, --rate, --writers, --writer-processes and --publishers must be positive"
        )
    return args


def main() -> None:
    """Run the soak; exit 1 if a check failed."""
    args = parse_args()
    if args.replot:
        series = json.loads(SERIES.read_text())
        plot(series["samples"], series["result"], PLOT)
        if not args.no_record:
            record_results("soak", summary_of(series["result"]) | {"date": series["date"]})
        print(f"  drew {PLOT} from {SERIES}" + ("" if args.no_record else ", recorded 'soak'"))
        return
    base_url, bootstrap = environment()
    soak = Soak(args, base_url, bootstrap)
    if args.recovery_limit is None:
        c = soak.config
        args.recovery_limit = c.lease_seconds + c.write_deadline_seconds + c.absence_grace + 30
    soak.services.check_own(allow_shared=args.allow_shared_services)
    try:
        result = soak.execute()
    except BaseException:
        print(f"  failed; kept: database {soak.database}, topic {soak.topic}", flush=True)
        raise
    summarise(result)
    write_series(result, soak.samples)
    plot(soak.samples, result, PLOT)
    if not args.no_record:
        record_results("soak", summary_of(result))
    print(
        f"  wrote {SERIES} and {PLOT}" + ("" if args.no_record else ", and 'soak' in latest.json")
    )
    soak.clean_up(keep=args.keep or bool(result["failures"]))
    raise SystemExit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()
