"""What the benchmarks share: databases, topics, publisher processes, CPU time, results.

Every benchmark keeps its results under a key of its own in the one shared
``benchmarks/results/latest.json``: ``record_results`` reads the file,
replaces that key and writes it back, leaving the other benchmarks' keys as
they were.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import psycopg
from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from kafka.errors import KafkaError
from psycopg import sql

import outbox
from outbox.migrations import migrate
from publisher.app import build_publisher
from publisher.config import PublisherConfig, resolve
from publisher.loop import Publisher

__all__ = [
    "KEYS",
    "LOG_EVENTS",
    "PARTITIONS",
    "RESULTS",
    "Cpu",
    "CpuWatch",
    "backlog",
    "config_of",
    "create_replicated_topic",
    "database_url",
    "delete_topic",
    "environment",
    "log_events",
    "make_records",
    "new_topic",
    "partition_leaders",
    "patiently",
    "percentile",
    "publisher_id_of",
    "publisher_on_backlog",
    "record_results",
    "registered",
    "rss_bytes",
    "start_publisher",
    "stop_publisher",
    "temporary_database",
]

T = TypeVar("T")

KEYS = 1_000
PARTITIONS = 3


def make_records(count: int) -> list[outbox.Message]:
    """``count`` records of about 200 bytes each, keyed over 1,000 keys."""
    return [
        outbox.Message(
            "placeholder",
            json.dumps({"event": "OrderPlaced", "seq": i, "pad": "x" * 150}).encode(),
            key=f"customer-{i % KEYS:04d}",
        )
        for i in range(count)
    ]


def new_topic(bootstrap: str) -> str:
    """Create a fresh topic with the benchmark's partition count."""
    name = f"bench-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(name, num_partitions=PARTITIONS, replication_factor=1)])
    admin.close()
    return name


RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULTS = RESULTS_DIR / "latest.json"
PUBLISHER = Path(sys.executable).parent / "outbox-publisher"


def environment() -> tuple[str, str]:
    """``OUTBOX_DATABASE_URL`` and ``OUTBOX_KAFKA_BOOTSTRAP``, or exit saying what is missing."""
    try:
        return os.environ["OUTBOX_DATABASE_URL"], os.environ["OUTBOX_KAFKA_BOOTSTRAP"]
    except KeyError as exc:
        raise SystemExit(f"{exc.args[0]} is not set (. ./.services.env, or make bench)") from None


# --- results ---------------------------------------------------------------------


def stamp() -> dict[str, Any]:
    """Date and machine, for every entry of the results file."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def record_results(name: str, entry: dict[str, Any]) -> None:
    """Replace the key ``name`` of the shared results file, keeping every other key.

    A file in the older flat form of one benchmark (a top-level ``benchmark``
    field) is kept under that benchmark's name.
    """
    results: dict[str, Any] = {}
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        loaded = json.loads(RESULTS.read_text())
        if isinstance(loaded, dict):
            results = loaded
    if isinstance(results.get("benchmark"), str):
        results = {results["benchmark"]: results}
    results[name] = {**stamp(), **entry}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    partial = RESULTS.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(results, indent=2) + "\n")
    partial.replace(RESULTS)


# --- numbers ---------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank percentile ``p`` (0-100) of ``values``."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(math.ceil(p / 100 * len(ordered)), 1)
    return ordered[min(rank, len(ordered)) - 1]


# --- databases -------------------------------------------------------------------


def database_url(url: str, name: str) -> str:
    """``url`` pointing at the database ``name`` instead."""
    return urlsplit(url)._replace(path=f"/{name}").geturl()


def create_database(base_url: str, name: str, *, template: str | None = None) -> str:
    """Create the database ``name`` (a copy of ``template`` if given); return its URL."""
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        # FILE_COPY copies the files after a checkpoint instead of writing every
        # page of a large template to the WAL (PostgreSQL 15's default).
        statement = sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY = FILE_COPY").format(
            sql.Identifier(name), sql.Identifier(template)
        )
    with psycopg.connect(database_url(base_url, "postgres"), autocommit=True) as admin:
        admin.execute(statement)
    return database_url(base_url, name)


def drop_database(base_url: str, name: str) -> None:
    """Drop the database ``name`` if it exists, disconnecting whoever is still in it."""
    with psycopg.connect(database_url(base_url, "postgres"), autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@contextlib.contextmanager
def temporary_database(
    base_url: str, prefix: str, *, template: str | None = None, target: int | None = None
) -> Iterator[tuple[str, str]]:
    """A fresh migrated database (up to schema version ``target``, if given), or a
    copy of ``template``, dropped afterwards.

    Yields its name and URL.
    """
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    url = create_database(base_url, name, template=template)
    try:
        if template is None:
            migrate(url, target=target)
        yield name, url
    finally:
        drop_database(base_url, name)


def backlog(
    url: str,
    topic: str,
    records: list[outbox.Message],
    *,
    before_checkpoint: Callable[[], None] | None = None,
) -> None:
    """Commit ``records`` as pending intents of ``topic``, ready for a timed run.

    The table is vacuumed and analysed, ``before_checkpoint`` runs (then the
    table is vacuumed again), and a checkpoint writes everything out so that
    none lands in the timed run.
    """
    with psycopg.connect(url) as conn:
        outbox.enqueue_many(conn, [outbox.Message(topic, r.value, key=r.key) for r in records])
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE outbox.messages")
        if before_checkpoint is not None:
            before_checkpoint()
            conn.execute("VACUUM outbox.messages")
        conn.execute("CHECKPOINT")


def publisher_on_backlog(
    url: str,
    bootstrap: str,
    topic: str,
    records: list[outbox.Message],
    batch_size: int,
    *,
    before_checkpoint: Callable[[], None] | None = None,
    **settings: Any,
) -> Publisher:
    """Commit ``records`` as pending intents of ``topic`` (``backlog``); return a publisher.

    The publisher's topic metadata is warm, as for a bare producer.
    """
    backlog(url, topic, records, before_checkpoint=before_checkpoint)
    publisher = build_publisher(
        PublisherConfig(
            database_url=url,
            kafka_bootstrap=bootstrap,
            exit_when_idle=True,
            batch_size=batch_size,
            http_port=0,
            **settings,
        )
    )
    publisher.sink.partition_count(topic)
    return publisher


def delete_topic(bootstrap: str, name: str) -> None:
    """Delete a topic this benchmark created; a failure is only reported."""
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        try:
            admin.delete_topics([name])
        finally:
            admin.close()
    except KafkaError as exc:
        print(f"could not delete topic {name}: {exc}", file=sys.stderr)


def create_replicated_topic(
    bootstrap: str,
    name: str,
    partitions: int,
    replication_factor: int,
    *,
    configs: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> None:
    """Create a topic and wait until every partition has a leader and its full ISR."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-bench")
    try:
        admin.create_topics(
            [NewTopic(name, partitions, replication_factor, topic_configs=configs or {})]
        )
    finally:
        admin.close()
    deadline = time.monotonic() + timeout
    while True:
        found = partition_leaders(bootstrap, name)
        ready = [p for p in found if p["leader"] >= 0 and len(p["isr"]) >= replication_factor]
        if len(found) == partitions and len(ready) == partitions:
            return
        if time.monotonic() > deadline:
            raise SystemExit(
                f"topic {name}: {len(ready)} of {partitions} partitions ready after "
                f"{timeout:g} s ({found})"
            )
        time.sleep(0.2)


def partition_leaders(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    """Each partition of ``topic`` with its leader's node id (-1: none) and its ISR."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-bench")
    try:
        described = admin.describe_topics([topic])
    finally:
        admin.close()
    found = described[0].get("partitions") or [] if described else []
    return sorted(
        (
            {"partition": p["partition_index"], "leader": p["leader_id"], "isr": p["isr_nodes"]}
            for p in found
        ),
        key=lambda p: p["partition"],
    )


def topic_partitions(bootstrap: str) -> dict[str, int]:
    """Every topic of the cluster (Kafka's internal ones too) and its number of partitions."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-bench")
    try:
        # kafka-python names a topic "topic" or "name", by the Metadata version it used.
        return {
            t.get("topic") or t["name"]: len(t.get("partitions") or [])
            for t in admin.describe_topics()
        }
    finally:
        admin.close()


def elect_preferred_leaders(bootstrap: str) -> int:
    """Move the leadership of every partition of the cluster to its preferred replica, as
    ``kafka-leader-election.sh --election-type preferred --all-topic-partitions`` does;
    return how many partitions were led by another replica before."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-bench")
    try:
        elsewhere = sum(
            1
            for topic in admin.describe_topics()
            for p in topic.get("partitions") or []
            if p["replica_nodes"] and p["leader_id"] != p["replica_nodes"][0]
        )
        if elsewhere:
            admin.elect_leaders(0, None)  # 0: preferred (1: unclean); None: every partition
        return elsewhere
    finally:
        admin.close()


class RetryingEnqueuer:
    """A load generator's enqueues: each in a transaction of its own, on a
    connection of its own; after a lost connection (a PostgreSQL restart)
    the same messages again on a new one, once a second, ``attempts`` times.

    The retry is safe only because the messages carry idempotency keys: a
    transaction whose commit was acknowledged on a connection that then
    broke is written once either way.
    """

    def __init__(self, url: str, *, attempts: int, application_name: str = "") -> None:
        self.url, self.attempts, self.application_name = url, attempts, application_name
        self.conn: psycopg.Connection[Any] | None = None
        #: Connections replaced after an error.
        self.reconnections = 0

    def enqueue(self, messages: list[outbox.Message]) -> list[uuid.UUID]:
        """``outbox.enqueue_many`` in one transaction; again on a new connection if it broke."""
        if any(m.idempotency_key is None for m in messages):
            raise ValueError("a retried enqueue needs an idempotency key on every message")
        for attempt in range(self.attempts):
            try:
                if self.conn is None or self.conn.closed:
                    self.conn = psycopg.connect(
                        self.url, autocommit=True, application_name=self.application_name
                    )
                with self.conn.transaction():
                    return outbox.enqueue_many(self.conn, messages)
            except psycopg.OperationalError:
                if attempt == self.attempts - 1:
                    raise
                self.reconnections += 1
                self.close()
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the connection, if one is open."""
        if self.conn is not None:
            self.conn.close()


def patiently(action: Callable[[], T], timeout: float = 180.0) -> T:
    """``action()``, tried again while the database or Kafka cannot be reached (restarts)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return action()
        except (psycopg.OperationalError, KafkaError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


# --- publisher processes ---------------------------------------------------------


def start_publisher(url: str, bootstrap: str, *flags: str) -> subprocess.Popen[bytes]:
    """Start the real ``outbox-publisher`` against ``url``; its log goes to our stderr."""
    env = {**os.environ, "OUTBOX_DATABASE_URL": url, "OUTBOX_KAFKA_BOOTSTRAP": bootstrap}
    return subprocess.Popen(
        [str(PUBLISHER), "--http-port", "0", "--log-level", "WARNING", *flags],
        env=env,
        stdout=subprocess.DEVNULL,
    )


def stop_publisher(process: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """SIGTERM (it finishes its batch and exits 0), then SIGKILL if it takes too long."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def wait_for_publishers(url: str, count: int, timeout: float = 30.0) -> None:
    """Wait until ``count`` publishers listen for NOTIFY and own every lane between them."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            listening, lanes = conn.execute(
                """
                SELECT (SELECT count(*) FROM pg_stat_activity
                        WHERE datname = current_database()
                          AND application_name = 'outbox-publisher listener'
                          AND query LIKE 'LISTEN%'),
                       (SELECT count(*) FROM outbox.lanes
                        WHERE owner IS NOT NULL AND lease_expires_at > now())
                """
            ).fetchone() or (0, 0)
            if listening >= count and lanes == 32:  # schema/0004 has 32 lanes
                return
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"publishers not ready after {timeout:g}s: "
                    f"{listening} listening, {lanes} lanes owned"
                )
            time.sleep(0.05)


def config_of(flags: Sequence[str], url: str, bootstrap: str) -> PublisherConfig:
    """The configuration these flags (all ``--name value`` pairs) give a publisher."""
    given = {
        name.removeprefix("--").replace("-", "_"): value
        for name, value in zip(flags[::2], flags[1::2], strict=True)
    }
    return resolve({**given, "database_url": url, "kafka_bootstrap": bootstrap}, {})


def publisher_id_of(conn: psycopg.Connection[Any], pid: int) -> str | None:
    """The id in ``outbox.publishers`` of the running publisher process ``pid``."""
    row = conn.execute(
        "SELECT id FROM outbox.publishers WHERE pid = %s AND stopped_at IS NULL "
        "ORDER BY started_at DESC LIMIT 1",
        (pid,),
    ).fetchone()
    return None if row is None else str(row[0])


def registered(url: str, process: subprocess.Popen[bytes]) -> bool:
    """Whether the publisher process has registered (or exited: nothing to wait for)."""

    def look() -> bool:
        with psycopg.connect(url) as conn:
            return publisher_id_of(conn, process.pid) is not None

    return process.poll() is not None or patiently(look)


#: Log lines worth counting, from every publisher of a long run.
LOG_EVENTS = {
    "settles with a stale fence": re.compile(r"fence is stale"),
    "batches dropped at the socket (write deadline passed)": re.compile(
        r"write deadline passed before the producer wrote"
    ),
    "sessions found fenced on waking": re.compile(r"this producer session was fenced"),
    "sessions fenced by a reconciler": re.compile(r"fenced producer session"),
    "messages marked uncertain at send": re.compile(r"marked uncertain"),
    "injected pauses": re.compile(r"injected pause at"),
    "tracebacks": re.compile(r"^Traceback", re.MULTILINE),
    "database unavailable": re.compile(r"database unavailable"),
    "broker connections refused": re.compile(r"ECONNREFUSED"),
}


def log_events(log_dir: Path) -> dict[str, int]:
    """How often each of ``LOG_EVENTS`` appears in the ``*.log`` files of ``log_dir``."""
    text = "\n".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("*.log")))
    return {name: len(pattern.findall(text)) for name, pattern in LOG_EVENTS.items()}


def rss_bytes(pid: int) -> int | None:
    """Resident memory of one process (``VmRSS``), or ``None`` once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None
    return None


# --- CPU time --------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_cpu_seconds(stat: str) -> float:
    """User + system CPU seconds from the text of a ``/proc/.../stat`` file."""
    fields = stat.rsplit(")", 1)[1].split()
    # After the command name: state is field 3, utime 14 and stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process so far (``None`` once it is gone)."""
    try:
        return _stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def jit_compiler_seconds(pid: int) -> float:
    """CPU seconds a JVM's JIT compiler threads (``C1``/``C2 CompilerThread``) used so far;
    0 for a process that is gone or has none."""
    total = 0.0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            if "CompilerThre" in stat[stat.index("(") + 1 : stat.rindex(")")]:
                total += _stat_cpu_seconds(stat)
    return total


def children_of(parent: int) -> list[int]:
    """Pids of the live processes whose parent is ``parent``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(entry.name))
    return found


def machine_busy_seconds() -> tuple[float, float]:
    """CPU seconds the whole machine spent busy and idle so far (from /proc/stat)."""
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in first]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks[:8]) - idle) / _TICK, idle / _TICK


class Cpu:
    """CPU seconds used by named groups of processes between ``sample()`` calls.

    Processes come and go (PostgreSQL backends, publishers), so each pid's
    last reading is kept and the group's use is the sum over its pids of last
    minus first reading; call ``sample()`` often enough (say every 0.2 s) to
    catch a short-lived process before it ends.
    """

    def __init__(self) -> None:
        self._first: dict[tuple[str, int], float] = {}
        self._last: dict[tuple[str, int], float] = {}
        self._group_of: dict[int, str] = {}
        self._machine_start = machine_busy_seconds()
        self._machine_end = self._machine_start

    def sample(self, groups: Mapping[str, Sequence[int]], *, new_from_zero: bool = False) -> None:
        """Read each group's processes; a pid seen for the first time starts at its reading,
        or at zero with ``new_from_zero`` (a process started inside the measured span)."""
        for group, pids in groups.items():
            for pid in pids:
                seconds = cpu_seconds(pid)
                if seconds is None:
                    continue
                # A process stays in the group it was first seen in (a backend's
                # title, which says its group, can read oddly while it changes).
                key = (self._group_of.setdefault(pid, group), pid)
                self._first.setdefault(key, 0.0 if new_from_zero else seconds)
                self._last[key] = seconds
        self._machine_end = machine_busy_seconds()

    def used(self) -> dict[str, float]:
        """CPU seconds per group so far."""
        totals: dict[str, float] = {}
        for key, last in self._last.items():
            totals[key[0]] = totals.get(key[0], 0.0) + last - self._first[key]
        return totals

    def machine(self) -> tuple[float, float]:
        """Busy and idle CPU seconds of the whole machine over the samples."""
        return (
            self._machine_end[0] - self._machine_start[0],
            self._machine_end[1] - self._machine_start[1],
        )


class CpuWatch:
    """Samples ``Cpu`` in a background thread while the block runs.

    ``groups()`` names the processes to watch at each sample; processes that
    appear after the first sample count from zero (they started inside the
    block). ``used()`` adds "everything else": what the machine spent beyond
    the named processes (this script's other threads, the kernel, and
    whatever else ran meanwhile, such as other people's tests).
    """

    def __init__(
        self, groups: Callable[[], Mapping[str, Sequence[int]]], interval: float = 0.2
    ) -> None:
        self._groups = groups
        self._interval = interval
        self._cpu = Cpu()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-watch", daemon=True)

    def __enter__(self) -> CpuWatch:
        self._cpu.sample(self._groups())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._cpu.sample(self._groups(), new_from_zero=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._cpu.sample(self._groups(), new_from_zero=True)

    def used(self) -> dict[str, float]:
        """CPU seconds per group, and "everything else"."""
        used = self._cpu.used()
        busy, _ = self._cpu.machine()
        used["everything else"] = busy - sum(used.values())
        return used

    def machine(self) -> tuple[float, float]:
        """Busy and idle CPU seconds of the whole machine."""
        return self._cpu.machine()


def postgres_groups(database: str) -> dict[str, list[int]]:
    """PostgreSQL's processes: this database's backends, other backends, background."""
    groups: dict[str, list[int]] = {
        "postgres (this database)": [],
        "postgres (other databases)": [],
        "postgres (background)": [],
    }
    pids = postgres_pids()
    for pid in pids:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if pid != pids[0] and not title.startswith("postgres: "):
            continue  # just forked, not titled yet: classified at the next sample
        # A backend is titled "postgres: <user> <database> <host>(<port>) <activity>".
        words = title.split()
        backend = len(words) >= 4 and words[0] == "postgres:"
        if backend and ("(" in words[3] or words[3] == "[local]"):
            mine = words[2] == database
            groups["postgres (this database)" if mine else "postgres (other databases)"].append(pid)
        else:
            groups["postgres (background)"].append(pid)
    return groups


def postgres_pids() -> list[int]:
    """The postmaster and every process it started (backends and background workers)."""
    main = _postmaster_pid()
    return [main, *children_of(main)] if main else []


def _postmaster_pid() -> int | None:
    for pidfile in Path(__file__).resolve().parent.parent.glob(".services/postgres/data/*.pid"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(pidfile.read_text().split()[0])
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
                if cmd and cmd[0].endswith(b"postgres") and b"-D" in cmd:
                    return int(entry.name)
    return None


def kafka_pids() -> list[int]:
    """The Kafka broker's JVM."""
    pidfile = Path(__file__).resolve().parent.parent / ".services" / "kafka" / "broker.pid"
    with contextlib.suppress(OSError, ValueError):
        return [int(pidfile.read_text().split()[0])]
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if b"kafka.Kafka" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found
