"""Freeze soak: publishers frozen and woken at random points; nothing lost, nothing doubled.

Real ``outbox-publisher`` processes (three by default, with the short
timeouts of the crash tests: a 5 s lease, an 8 s write deadline) deliver to
a fresh topic of several partitions from a fresh database, while writer
threads enqueue keyed messages (a few hundred keys) in small transactions
through ``outbox.enqueue_many``. Meanwhile one publisher at a time is frozen
with SIGSTOP at a random moment, for a random time, and woken with SIGCONT:

* short: well within its lease, so that nobody notices;
* past the lease: its lanes and claims are taken over while it is frozen,
  and it wakes before its write deadline;
* past the lease and the write deadline: a successor has decided its
  batch, and it wakes as a zombie holding records nobody wants any more.

A few more freezes (``--cut-freezes``) are placed with ``OUTBOX_PAUSE_AT``
and ``OUTBOX_ENABLE_FAULTS=1`` (publisher/faults.py): a publisher is stopped
(SIGTERM) and replaced by one that freezes itself at a cut of one of its
first batches (after the records were handed to the producer, after the
acknowledgement, after the transaction's commit, ...), so those phases are
hit for certain.

Once every freeze is done and every message delivered, the publishers are
stopped and the topic is read back. It passes when a read_committed consumer
sees every message exactly once (0 lost, 0 duplicated), each key's records
in one partition in the order of their ``seq`` (one key's commit order), and
each at the partition and offset the database stored for it. What a
read_uncommitted consumer sees is reported beside it: in transactional
delivery it also reads the aborted transactions' records. Exit code 1 when
a check fails; the database and topic are then kept for inspection.

Results go to benchmarks/results/freeze_soak.json under ``<delivery>/<sink>``;
each publisher's log is kept in the run's log directory.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import random
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from common import (
    RetryingEnqueuer,
    config_of,
    create_database,
    delete_topic,
    drop_database,
    environment,
    kafka_pids,
    log_events,
    patiently,
    publisher_id_of,
    registered,
    stamp,
    wait_for_publishers,
)

import outbox
from outbox.migrations import migrate
from publisher.config import PublisherConfig
from tests.support import (
    ConsumedRecord,
    count_by_state,
    create_topic,
    fast_publisher_flags,
    fault_env,
    is_frozen,
    read_topic,
    start_logged_publisher,
    stop_and_wait,
    wait_until,
)

RESULTS = Path(__file__).resolve().parent / "results" / "freeze_soak.json"

SHORT = "short"
PAST_LEASE = "past lease"
PAST_DEADLINE = "past lease + write deadline"

#: Where a freeze is aimed: any moment; a moment when the publisher holds a
#: claim (then a random few milliseconds later); a cut of OUTBOX_PAUSE_AT.
ANYWHERE = "anywhere"
IN_A_BATCH = "in a batch"
AT_A_CUT = "at a cut"

#: The cuts a freeze is placed at, most telling first; only transactional
#: delivery has ``after_commit``.
CUTS = {
    "idempotent": ("after_send", "after_ack", "after_claim", "after_confirm"),
    "transactional": ("after_send", "after_commit", "after_ack", "after_claim", "after_confirm"),
}

# --- the plan ----------------------------------------------------------------------


@dataclass
class Freeze:
    """One freeze: as planned, then what happened."""

    number: int
    length: str
    planned_seconds: float
    gap_seconds: float
    aim: str = ANYWHERE
    #: The ``OUTBOX_PAUSE_AT`` cut of a freeze aimed at one.
    cut: str | None = None
    cut_batch: int = 0
    slot: int = -1
    pid: int = 0
    publisher_id: str | None = None
    at_seconds: float = 0.0
    held_seconds: float = 0.0
    #: What the database said the publisher was doing when it froze.
    phase: str = "not frozen"
    batches: list[dict[str, Any]] = field(default_factory=list)
    #: Messages pending when it froze, and how many the other publishers
    #: delivered while it was frozen.
    pending_at_freeze: int = 0
    delivered_meanwhile: int = 0
    #: Messages read twice (read_committed) that were in a batch it held when it froze.
    duplicated_from_its_batches: int = 0
    #: Just before it was woken: each transaction it had left open (its last
    #: statement) and how many other sessions were waiting for its locks.
    open_transactions: list[dict[str, Any]] = field(default_factory=list)


def plan_freezes(
    rng: random.Random, freezes: int, cut_freezes: int, cuts: Sequence[str], timing: Timing
) -> list[Freeze]:
    """``freezes`` at random moments and ``cut_freezes`` at cuts, shuffled together.

    The random ones are a third of each length, and half of them are aimed
    at a moment when the publisher holds a claim (an idle publisher is
    frozen far more often otherwise). The cut ones alternate past the write
    deadline (first: after_send) and past the lease.
    """
    lengths = [(SHORT, PAST_LEASE, PAST_DEADLINE)[i % 3] for i in range(freezes)]
    aims = [(ANYWHERE, IN_A_BATCH)[i % 2] for i in range(freezes)]
    rng.shuffle(lengths)
    rng.shuffle(aims)
    kinds: list[tuple[str, str, str | None]] = [
        (length, aim, None) for length, aim in zip(lengths, aims, strict=True)
    ]
    kinds += [
        (PAST_DEADLINE if j % 2 == 0 else PAST_LEASE, AT_A_CUT, cuts[j % len(cuts)])
        for j in range(cut_freezes)
    ]
    rng.shuffle(kinds)
    return [
        Freeze(
            number,
            length,
            round(timing.freeze_seconds(rng, length), 2),
            round(rng.uniform(0.3, 3.0), 2),
            aim=aim,
            cut=cut,
            cut_batch=rng.randint(1, 3) if cut else 0,
        )
        for number, (length, aim, cut) in enumerate(kinds, 1)
    ]


@dataclass(frozen=True)
class Timing:
    """The publishers' lease and write deadline, as their flags set them."""

    lease: float
    write_deadline: float

    @classmethod
    def of(cls, config: PublisherConfig) -> Timing:
        """From a publisher's configuration."""
        return cls(config.lease_seconds, config.write_deadline_seconds)

    def freeze_seconds(self, rng: random.Random, length: str) -> float:
        """A random freeze time of the given length class.

        A lease is renewed every heartbeat (a second), so a freeze under 80 %
        of it never loses it; one over the lease + 0.5 s always does.
        """
        if length == SHORT:
            return rng.uniform(0.2, 0.8 * self.lease)
        if length == PAST_LEASE:
            return rng.uniform(self.lease + 0.5, self.lease + self.write_deadline - 0.5)
        return rng.uniform(
            self.lease + self.write_deadline + 1, self.lease + self.write_deadline + 6
        )


def publisher_flags(args: argparse.Namespace, delivery: str) -> tuple[str, ...]:
    """The publishers' flags: the crash tests' short timeouts, this run's mode and sink."""
    return (
        *fast_publisher_flags(args.batch_size),
        "--delivery", delivery,
        "--sink", args.sink,
        "--log-level", "INFO",
    )  # fmt: skip


# --- writers -----------------------------------------------------------------------


class Writer(threading.Thread):
    """Enqueues ``count`` keyed messages in small transactions, keeping pace with the freezes.

    ``share()`` says what share of its messages it may have written by now:
    it grows evenly over each freeze's time (the gap before it and its
    length), so work comes during every freeze and none is left over when
    the last one ends. The writer waits until a burst (a fifth of its share
    of one freeze, up to all of it) is due, then writes it as fast as it
    can: the publishers have full batches to work on at times, not a
    trickle of one message per claim, and are idle at others.
    """

    def __init__(
        self,
        url: str,
        topic: str,
        keys: Sequence[str],
        count: int,
        *,
        share: Callable[[], float],
        freezes: int,
        seed: int,
    ) -> None:
        super().__init__(name=f"writer-{seed}", daemon=True)
        self.url, self.topic, self.keys, self.count, self.share = url, topic, keys, count, share
        self.rng = random.Random(seed)
        self.largest_burst = max(count // max(freezes, 1), 20)
        self.ids: list[uuid.UUID] = []
        self.transactions = 0
        self.enqueuer = RetryingEnqueuer(url, attempts=60)
        self.error: BaseException | None = None

    def run(self) -> None:
        """Enqueue, keeping pace with the freezes; keep the first error."""
        try:
            burst = self.burst()
            while len(self.ids) < self.count:
                allowed = min(round(self.count * self.share()), self.count)
                if allowed - len(self.ids) < min(burst, self.count - len(self.ids)):
                    time.sleep(0.05)
                    continue
                end = len(self.ids) + min(burst, self.count - len(self.ids))
                while len(self.ids) < end:
                    size = min(self.rng.randint(1, 20), end - len(self.ids))
                    self.ids.extend(self.enqueuer.enqueue(self.messages(len(self.ids), size)))
                    self.transactions += 1
                burst = self.burst()
        except BaseException as exc:  # noqa: BLE001 - reported by the run, which then fails
            self.error = exc
        finally:
            self.enqueuer.close()

    def burst(self) -> int:
        """The size of the next burst."""
        return self.rng.randint(self.largest_burst // 5, self.largest_burst)

    def messages(self, first: int, size: int) -> list[outbox.Message]:
        """Messages ``first`` to ``first + size`` of this writer, each with a random key."""
        return [
            outbox.Message(
                self.topic,
                json.dumps({"writer": self.name, "n": n}),
                key=self.rng.choice(self.keys),
                # A transaction retried after a lost connection may have
                # committed: the key makes the retry write nothing new.
                idempotency_key=f"{self.name}:{n}",
            )
            for n in range(first, first + size)
        ]


# --- one run -----------------------------------------------------------------------


def phase_of(url: str, pid: int) -> tuple[str | None, str, list[dict[str, Any]]]:
    """The publisher id of process ``pid``, and what the database says it was doing.

    ``idle``: it holds no claim; ``claimed``: it holds a claim whose sending
    has not begun; ``sending``: sending began and nothing is recorded yet (the
    database cannot tell handing over, waiting for the broker, committing and
    settling apart); both when it also held a batch claimed ahead.
    """
    try:
        with psycopg.connect(url) as conn:
            publisher_id = publisher_id_of(conn, pid)
            if publisher_id is None:
                return None, "not registered", []
            batches = conn.execute(
                """
                SELECT f.batch_id, f.send_began_at IS NOT NULL, count(*)
                FROM outbox.in_flight AS f
                WHERE f.lease_owner = %s
                GROUP BY f.batch_id, f.send_began_at
                ORDER BY f.batch_id
                """,
                (publisher_id,),
            ).fetchall()
    except psycopg.Error as exc:
        return None, f"unknown ({type(exc).__name__})", []
    held = [{"batch": b, "sending": s, "messages": n} for b, s, n in batches]
    phases = sorted({"sending" if h["sending"] else "claimed" for h in held}, reverse=True)
    return publisher_id, " + ".join(phases) or "idle", held


def open_transactions(url: str, publisher_id: str | None) -> list[dict[str, Any]]:
    """The transactions a (frozen) publisher left open, and how many sessions wait for each."""
    if publisher_id is None:
        return []
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            rows = conn.execute(
                """
                SELECT left(a.query, 100),
                       extract(epoch FROM now() - a.xact_start)::float8,
                       (SELECT count(*) FROM pg_stat_activity AS w
                        WHERE a.pid = ANY(pg_blocking_pids(w.pid)))
                FROM pg_stat_activity AS a
                WHERE a.datname = current_database()
                  AND a.application_name = %s
                  AND a.state LIKE 'idle in transaction%%'
                """,
                (f"outbox-publisher {publisher_id}",),
            ).fetchall()
    except psycopg.Error:
        return []
    return [{"last_statement": q, "open_seconds": round(t, 1), "waiting": n} for q, t, n in rows]


def wait_for_claim(url: str, pid: int, timeout: float) -> bool:
    """Wait until publisher process ``pid`` holds a claim; whether it did in time."""
    deadline = time.monotonic() + timeout
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            publisher_id = publisher_id_of(conn, pid)
            while publisher_id is not None and time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT EXISTS (SELECT 1 FROM outbox.batches "
                    "WHERE settled_at IS NULL AND publisher_id = %s)",
                    (publisher_id,),
                ).fetchone()
                if row and row[0]:
                    return True
                time.sleep(0.002)
    except psycopg.OperationalError:
        pass  # the database restarted: freeze now, wherever the publisher is
    return False


def services_started(url: str) -> dict[str, Any]:
    """When PostgreSQL started and which process Kafka is: a change means a restart."""

    def postgres() -> str:
        with psycopg.connect(url) as conn:
            row = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
        return str(row[0]) if row else ""

    return {"postgres_started": patiently(postgres), "kafka_pids": kafka_pids()}


class Run:
    """One soak run: a database, a topic, publishers, writers and the freezes."""

    def __init__(
        self, args: argparse.Namespace, delivery: str, base_url: str, bootstrap: str, log_dir: Path
    ) -> None:
        self.args, self.delivery, self.bootstrap, self.log_dir = args, delivery, bootstrap, log_dir
        self.rng = random.Random(f"{args.seed}/{delivery}/{args.sink}")
        self.database = f"outbox_freeze_soak_{uuid.uuid4().hex[:8]}"
        self.base_url = base_url
        self.url = ""
        self.topic = f"freeze-soak-{uuid.uuid4().hex[:8]}"
        self.flags = publisher_flags(args, delivery)
        self.timing = Timing.of(config_of(self.flags, base_url, bootstrap))
        self.slots: list[subprocess.Popen[bytes]] = []
        self.retired: list[subprocess.Popen[bytes]] = []
        #: Publishers that exited on their own during the run.
        self.deaths: list[dict[str, Any]] = []
        self.started = 0
        #: Freezes begun so far, when the last began and how long it is
        #: planned to take (gap and length): the writers keep pace with them.
        self.begun = 0
        self.slot_began = 0.0
        self.slot_seconds = 1.0
        self.began = time.monotonic()

    # --- publishers ---

    def start_publisher(self, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start one more publisher and wait until it registered; its output goes to a log
        of its own. (Stopped before its signal handlers are set, it would die of the signal.)
        """
        self.started += 1
        log = self.log_dir / f"publisher-{self.started:02d}.log"
        process = start_logged_publisher(self.url, self.bootstrap, *self.flags, log=log, env=env)
        wait_until(
            lambda: registered(self.url, process), timeout=60, interval=0.1, what="registration"
        )
        return process

    def clock(self) -> float:
        """Seconds since the run began."""
        return round(time.monotonic() - self.began, 2)

    # --- freezes ---

    def begin(self, freeze: Freeze) -> None:
        """The writers' share for ``freeze`` begins to come."""
        self.begun += 1
        self.slot_began = time.monotonic()
        self.slot_seconds = freeze.gap_seconds + freeze.planned_seconds

    def share(self, freezes: int) -> float:
        """The share of their messages the writers may have written by now."""
        if not freezes:
            return 1.0
        if not self.begun:
            return 0.0
        into = min((time.monotonic() - self.slot_began) / self.slot_seconds, 1.0)
        return (self.begun - 1 + into) / freezes

    def replace_the_dead(self) -> None:
        """Replace each publisher that exited on its own (it failed); note it."""
        for slot, process in enumerate(self.slots):
            if process.poll() is not None:
                self.deaths.append(
                    {"slot": slot + 1, "pid": process.pid, "exit_code": process.returncode,
                     "noticed_at_seconds": self.clock()}
                )  # fmt: skip
                print(
                    f"  publisher {slot + 1} (pid {process.pid}) exited on its own with "
                    f"{process.returncode}; replaced",
                    flush=True,
                )
                self.retired.append(process)
                self.slots[slot] = self.start_publisher()

    def freeze_at_random(self, freeze: Freeze) -> None:
        """SIGSTOP a random publisher now; SIGCONT it after the planned time."""
        self.replace_the_dead()
        freeze.slot = self.rng.randrange(len(self.slots))
        process = self.slots[freeze.slot]
        if freeze.aim == IN_A_BATCH:
            if wait_for_claim(self.url, process.pid, timeout=30):
                time.sleep(self.rng.uniform(0.0, 0.03))
            else:
                freeze.aim = f"{IN_A_BATCH} (none came within 30 s)"
        process.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(
            lambda: is_frozen(process.pid) or process.poll() is not None,
            timeout=5,
            interval=0.01,
            what="SIGSTOP",
        )
        freeze.at_seconds = self.clock()
        freeze.publisher_id, freeze.phase, freeze.batches = phase_of(self.url, process.pid)
        self.hold(process, freeze, stopped)

    def freeze_at_cut(self, freeze: Freeze) -> None:
        """Replace a publisher by one that freezes itself at the planned cut; wake it later."""
        assert freeze.cut is not None
        self.replace_the_dead()
        freeze.slot = self.rng.randrange(len(self.slots))
        old = self.slots[freeze.slot]
        self.retired.append(old)
        stop_and_wait(old, signal.SIGTERM, timeout=60)
        process = self.start_publisher(fault_env(pause_at=f"{freeze.cut}:{freeze.cut_batch}"))
        self.slots[freeze.slot] = process
        self.begin(freeze)  # work for it to reach its cut with
        try:
            wait_until(
                lambda: is_frozen(process.pid) or process.poll() is not None,
                timeout=90,
                interval=0.01,
                what=f"a publisher to freeze at {freeze.cut}:{freeze.cut_batch}",
            )
        except AssertionError:
            # It would freeze later, unwatched: replace it by an ordinary one.
            freeze.phase = f"{freeze.cut} not reached in 90 s"
            self.retired.append(process)
            stop_and_wait(process, signal.SIGTERM, timeout=60)
            self.slots[freeze.slot] = self.start_publisher()
            return
        if process.poll() is not None:
            freeze.phase = f"exited ({process.returncode}) before {freeze.cut}"
            self.retired.append(process)
            self.slots[freeze.slot] = self.start_publisher()
            return
        stopped = time.monotonic()
        freeze.at_seconds = self.clock()
        freeze.publisher_id, _, freeze.batches = phase_of(self.url, process.pid)
        freeze.phase = freeze.cut
        self.hold(process, freeze, stopped)

    def hold(self, process: subprocess.Popen[bytes], freeze: Freeze, stopped: float) -> None:
        """Keep ``process`` frozen for the planned time, then wake it."""
        freeze.pid = process.pid
        before = patiently(lambda: count_by_state(self.url))
        freeze.pending_at_freeze = before.get("pending", 0)
        time.sleep(max(freeze.planned_seconds - (time.monotonic() - stopped), 0.0))
        freeze.open_transactions = open_transactions(self.url, freeze.publisher_id)
        process.send_signal(signal.SIGCONT)
        freeze.held_seconds = round(time.monotonic() - stopped, 2)
        after = patiently(lambda: count_by_state(self.url))
        freeze.delivered_meanwhile = after.get("delivered", 0) - before.get("delivered", 0)
        print(
            f"  freeze {freeze.number:2d} at {freeze.at_seconds:6.1f} s: publisher "
            f"{freeze.slot + 1} (pid {process.pid}) {freeze.held_seconds:5.1f} s "
            f"({freeze.length}), aimed {freeze.aim}, {freeze.phase}; others delivered "
            f"{freeze.delivered_meanwhile:,} meanwhile ({freeze.pending_at_freeze:,} were pending)",
            flush=True,
        )

    # --- the run ---

    def execute(self) -> dict[str, Any]:
        """Set up, run the writers and freezes, drain, stop, check; the result entry."""
        args = self.args
        self.url = create_database(self.base_url, self.database)
        migrate(self.url)
        patiently(lambda: create_topic(self.bootstrap, self.topic, partitions=args.partitions))
        plan = plan_freezes(
            self.rng, args.freezes, args.cut_freezes, CUTS[self.delivery], self.timing
        )
        schedule = sum(f.gap_seconds + f.planned_seconds for f in plan)
        print(
            f"{self.delivery} / {args.sink}: {args.messages:,} messages over {args.keys} keys "
            f"into {args.partitions} partitions, {args.publishers} publishers (lease "
            f"{self.timing.lease:g} s, write deadline {self.timing.write_deadline:g} s), "
            f"{len(plan)} freezes planned over {schedule:.0f} s; database {self.database}, "
            f"topic {self.topic}, logs {self.log_dir}",
            flush=True,
        )
        self.began = time.monotonic()
        services = services_started(self.url)
        self.slots = [self.start_publisher() for _ in range(args.publishers)]
        patiently(lambda: wait_for_publishers(self.url, args.publishers, timeout=60))
        keys = [f"key-{k:04d}" for k in range(args.keys)]
        counts = [args.messages // args.writers + (i < args.messages % args.writers)
                  for i in range(args.writers)]  # fmt: skip
        writers = [
            Writer(
                self.url,
                self.topic,
                keys,
                count,
                share=lambda: self.share(len(plan)),
                freezes=len(plan),
                seed=self.rng.randrange(2**31),
            )
            for count in counts
        ]
        for w in writers:
            w.start()
        #: Set when the delivery stalled: what was stuck, and whether new
        #: publisher processes delivered it.
        stall: dict[str, Any] | None = None
        try:
            for freeze in plan:
                if freeze.cut is None:
                    self.begin(freeze)
                    time.sleep(freeze.gap_seconds)
                    self.freeze_at_random(freeze)
                else:
                    time.sleep(freeze.gap_seconds)
                    self.freeze_at_cut(freeze)
            for w in writers:
                w.join()
            self.replace_the_dead()
            written = self.clock()
            drained = self.drain(sum(w.count for w in writers))
            if drained is None:
                # Say what is stuck where, then see whether new processes
                # deliver it: the checks below then judge every message.
                stall = {"states": count_by_state(self.url), "stuck": self.stuck()}
                for line in stall["stuck"]:
                    print(f"    {line}", flush=True)
                print("  restarting every publisher", flush=True)
                self.restart_publishers()
                stall["drained_after_restart_seconds"] = self.drain(sum(w.count for w in writers))
        finally:
            for process in self.slots:
                process.send_signal(signal.SIGCONT)
            codes = [stop_and_wait(p, signal.SIGTERM, timeout=60) for p in self.slots]
        retired = [p.returncode for p in self.retired]
        restarted = [
            name
            for name, (before, after) in {
                "postgres": (
                    services["postgres_started"],
                    services_started(self.url)["postgres_started"],
                ),
                "kafka": (services["kafka_pids"], kafka_pids()),
            }.items()
            if before != after
        ]
        errors = [repr(w.error) for w in writers if w.error is not None]
        ids = [i for w in writers for i in w.ids]
        result = {
            "delivery": self.delivery,
            "sink": args.sink,
            "seed": args.seed,
            "messages": len(ids),
            "keys": args.keys,
            "partitions": args.partitions,
            "publishers": args.publishers,
            "flags": list(self.flags),
            "lease_seconds": self.timing.lease,
            "write_deadline_seconds": self.timing.write_deadline,
            "transactions_enqueued": sum(w.transactions for w in writers),
            "writer_reconnections": sum(w.enqueuer.reconnections for w in writers),
            "writer_errors": errors,
            "seconds_writing": written,
            "seconds_draining": drained,
            "stalled": stall,
            "seconds_total": self.clock(),
            "services_restarted": restarted,
            "exit_codes": codes,
            "exit_codes_replaced": retired,
            "publishers_died": self.deaths,
            "freezes_asked": args.freezes,
            "freezes": [asdict(f) for f in plan],
            "database": self.database,
            "topic": self.topic,
            "log_dir": str(self.log_dir),
            **self.examine(set(ids)),
            "log_events": log_events(self.log_dir),
        }
        self.trace_duplicates(plan, result["read_committed"]["duplicated_ids"])
        result["freezes"] = [asdict(f) for f in plan]
        result["failures"] = failures(result)
        return result

    def drain(self, total: int) -> float | None:
        """Wait until every message is delivered; the seconds it took.

        ``None`` when no message was delivered for ``--stall-seconds`` (longer
        than the longest retry delay) or ``--drain-timeout`` passed.
        """
        start = last_change = last_report = time.monotonic()
        last = -1
        while True:
            states = patiently(lambda: count_by_state(self.url))
            now = time.monotonic()
            if states == {"delivered": total}:
                return round(now - start, 2)
            if states.get("delivered", 0) != last:
                last, last_change = states.get("delivered", 0), now
            if now - last_change > self.args.stall_seconds:
                print(f"  stalled for {self.args.stall_seconds:g} s: {states}", flush=True)
                return None
            if now - start > self.args.drain_timeout:
                print(f"  not drained after {self.args.drain_timeout:g} s: {states}", flush=True)
                return None
            if now - last_report > 10:
                print(f"  draining: {states}", flush=True)
                last_report = now
            time.sleep(0.5)

    def stuck(self) -> list[dict[str, Any]]:
        """The undelivered messages by the publisher owning their lane and their last error."""

        def look() -> list[dict[str, Any]]:
            with psycopg.connect(self.url) as conn:
                rows = conn.execute(
                    """
                    SELECT p.pid, m.state, left(m.last_error, 200), count(*), max(m.attempts)
                    FROM outbox.message_status AS m
                    LEFT JOIN outbox.lanes AS l ON l.lane = m.lane
                    LEFT JOIN outbox.publishers AS p ON p.id = l.owner
                    WHERE m.state <> 'delivered'
                    GROUP BY 1, 2, 3
                    ORDER BY 4 DESC
                    LIMIT 10
                    """
                ).fetchall()
            return [
                {"lane_owner_pid": pid, "state": st, "last_error": e, "messages": n, "attempts": a}
                for pid, st, e, n, a in rows
            ]

        try:
            return patiently(look)
        except psycopg.Error as exc:
            return [{"error": repr(exc)}]

    def restart_publishers(self) -> None:
        """Replace every publisher by a new process (what an operator would try)."""
        for slot, process in enumerate(self.slots):
            self.retired.append(process)
            stop_and_wait(process, signal.SIGTERM, timeout=60)
            self.slots[slot] = self.start_publisher()

    def examine(self, ids: set[uuid.UUID]) -> dict[str, Any]:
        """Read the database and both views of the topic; the figures of the checks."""
        evidence = patiently(self.evidence)
        rows = evidence.pop("messages")
        stored = {r[0]: (r[3], r[4]) for r in rows}
        seq = {r[0]: (r[1], r[2]) for r in rows}
        committed = patiently(
            lambda: read_topic(self.bootstrap, self.topic, timeout=300, committed=True)
        )
        uncommitted = patiently(lambda: read_topic(self.bootstrap, self.topic, timeout=300))
        return {
            "enqueued_not_in_database": len(ids - set(stored)),
            "read_committed": consumer_view(committed, seq, stored),
            "read_uncommitted": consumer_view(uncommitted, seq, stored),
            **evidence,
        }

    def evidence(self) -> dict[str, Any]:
        """The messages, and what the database recorded of recoveries and decisions."""
        with psycopg.connect(self.url) as conn:
            messages = conn.execute(
                "SELECT id, key, seq, kafka_partition, kafka_offset FROM outbox.messages"
            ).fetchall()
            states: dict[str, int] = dict(
                conn.execute("SELECT state, count(*) FROM outbox.message_status GROUP BY state")
            )
            decided = conn.execute(
                "SELECT to_state, count(*) FROM outbox.decisions "
                "WHERE decided_by LIKE 'reconciler%' GROUP BY to_state"
            ).fetchall()
            escalated = conn.execute(
                "SELECT count(*) FROM outbox.messages WHERE escalated_at IS NOT NULL"
            ).fetchone()
            recovered = conn.execute(
                "SELECT CASE WHEN send_began THEN 'uncertain' ELSE 'pending' END, count(*) "
                "FROM outbox.attempts WHERE outcome = 'recovered' GROUP BY 1"
            ).fetchall()
            retried = conn.execute(
                "SELECT count(*), coalesce(max(attempts), 0) FROM outbox.messages "
                "WHERE attempts > 1"
            ).fetchone()
        return {
            "messages": messages,
            "states": states,
            "reconciler_decisions": dict(decided),
            "escalated": escalated[0] if escalated else None,
            "recovered_leases": dict(recovered),
            "messages_attempted_more_than_once": retried[0] if retried else None,
            "most_attempts": retried[1] if retried else None,
        }

    def trace_duplicates(self, plan: list[Freeze], duplicated: list[str]) -> None:
        """Count, for each freeze, the duplicated messages that were in a batch it held."""
        if not duplicated:
            return

        def attempts() -> list[tuple[Any, ...]]:
            with psycopg.connect(self.url) as conn:
                # Every batch that named a message was one of its attempts.
                return conn.execute(
                    "SELECT u.id, b.publisher_id::text, b.id FROM outbox.batches AS b, "
                    "unnest(b.message_ids) AS u(id) WHERE u.id = ANY(%s::uuid[])",
                    (duplicated,),
                ).fetchall()

        tried = {(publisher, batch, message) for message, publisher, batch in patiently(attempts)}
        for f in plan:
            held = {b["batch"] for b in f.batches}
            f.duplicated_from_its_batches = len(
                {m for p, b, m in tried if p == f.publisher_id and b in held}
            )

    def clean_up(self, keep: bool) -> None:
        """Drop the database and the topic, unless they are kept for inspection."""
        if keep:
            print(f"  kept: database {self.database}, topic {self.topic}", flush=True)
            return
        drop_database(self.base_url, self.database)
        delete_topic(self.bootstrap, self.topic)


# --- checks ------------------------------------------------------------------------


def consumer_view(
    records: list[ConsumedRecord],
    seq: dict[uuid.UUID, tuple[bytes | None, int]],
    stored: dict[uuid.UUID, tuple[int | None, int | None]],
) -> dict[str, Any]:
    """What one consumer saw: copies of each message, per-key order, locations."""
    records = sorted(records, key=lambda r: (r.partition, r.offset))
    copies = Counter(r.outbox_id for r in records)
    seen: set[uuid.UUID] = set()
    per_key: dict[bytes | None, list[ConsumedRecord]] = defaultdict(list)
    for r in records:
        if r.outbox_id in seq and r.outbox_id not in seen:  # first copies only
            seen.add(r.outbox_id)
            per_key[seq[r.outbox_id][0]].append(r)
    violations = []
    split_keys = 0
    for key, stream in per_key.items():
        split_keys += len({r.partition for r in stream}) > 1
        for earlier, later in itertools.pairwise(stream):
            if seq[later.outbox_id][1] < seq[earlier.outbox_id][1]:
                violations.append(
                    {
                        "key": (key or b"").decode(errors="replace"),
                        "offsets": [f"{r.partition}:{r.offset}" for r in (earlier, later)],
                        "seqs": [seq[r.outbox_id][1] for r in (earlier, later)],
                    }
                )
    located = {(r.outbox_id, r.partition, r.offset) for r in records}
    misplaced = [i for i in seen if (i, *stored[i]) not in located]
    return {
        "records": len(records),
        "messages_seen": len(seen),
        "lost": len(set(seq) - seen),
        "duplicated_records": sum(n - 1 for n in copies.values()),
        "messages_duplicated": sum(1 for n in copies.values() if n > 1),
        "foreign_records": sum(n for i, n in copies.items() if i not in seq),
        "order_violations": len(violations),
        "first_order_violations": violations[:10],
        "keys_in_several_partitions": split_keys,
        "stored_location_not_found": len(misplaced),
        "duplicated_ids": [str(i) for i, n in copies.items() if n > 1],
    }


def failures(result: dict[str, Any]) -> list[str]:
    """Each check that failed, in words (empty: the run passed)."""
    view = result["read_committed"]
    found = []
    if result["writer_errors"]:
        found.append(f"writers failed: {result['writer_errors']}")
    stall = result["stalled"]
    if stall:
        after = stall["drained_after_restart_seconds"]
        found.append(
            f"delivery stalled with {stall['states']}; after restarting the publishers "
            + (f"drained in {after:g} s" if after is not None else f"still {result['states']}")
        )
    elif result["seconds_draining"] is None:
        found.append(f"not every message was delivered: {result['states']}")
    for name, label in (
        ("lost", "lost"),
        ("duplicated_records", "duplicated records"),
        ("order_violations", "per-key order violations"),
        ("keys_in_several_partitions", "keys in several partitions"),
        ("stored_location_not_found", "messages not at their stored location"),
        ("foreign_records", "records with an unknown outbox-id"),
    ):
        if view[name]:
            found.append(f"read_committed: {view[name]} {label}")
    if result["enqueued_not_in_database"]:
        found.append(f"{result['enqueued_not_in_database']} enqueued ids missing from the database")
    if result["escalated"]:
        found.append(f"{result['escalated']} messages escalated")
    done = [f for f in result["freezes"] if f["held_seconds"] and not f["cut"]]
    if len(done) < result["freezes_asked"]:
        found.append(f"{len(done)} freezes at random moments, not {result['freezes_asked']}")
    if result["publishers_died"]:
        found.append(f"publishers exited on their own: {result['publishers_died']}")
    if any(code != 0 for code in result["exit_codes"] + result["exit_codes_replaced"]):
        found.append(
            f"publisher exit codes {result['exit_codes']}, replaced "
            f"{result['exit_codes_replaced']} (None: killed after 60 s)"
        )
    return found


# --- reporting ---------------------------------------------------------------------


def summarise(result: dict[str, Any]) -> None:
    """Print the figures of one run."""
    freezes = [f for f in result["freezes"] if f["held_seconds"]]
    by_length: dict[str, list[float]] = defaultdict(list)
    for f in freezes:
        by_length[f["length"]].append(f["held_seconds"])
    lengths = ", ".join(
        f"{name} {len(v)} ({min(v):.1f}-{max(v):.1f} s)" for name, v in by_length.items()
    )
    by_aim: dict[str, Counter[str]] = defaultdict(Counter)
    for f in freezes:
        by_aim[f["aim"]][f["phase"]] += 1
    phases = "; ".join(
        f"{aim}: " + ", ".join(f"{p} {n}" for p, n in counted.most_common())
        for aim, counted in by_aim.items()
    )
    at_cuts = sum(1 for f in freezes if f["cut"])
    meanwhile = [f["delivered_meanwhile"] for f in freezes]
    print(
        f"{result['delivery']} / {result['sink']}, seed {result['seed']}: "
        f"{result['messages']:,} messages in {result['transactions_enqueued']:,} transactions; "
        f"{len(freezes)} freezes ({len(freezes) - at_cuts} at random moments, {at_cuts} at cuts)"
    )
    print(f"  freeze lengths: {lengths}")
    skipped = [f for f in result["freezes"] if not f["held_seconds"]]
    if skipped:
        print("  not done: " + "; ".join(f"#{f['number']} {f['phase']}" for f in skipped))
    print(f"  phase at freeze, by aim: {phases}")
    if meanwhile:
        print(
            f"  delivered by the others during a freeze: median {statistics.median(meanwhile):,.0f}"
            f", fewest {min(meanwhile):,}"
        )
    for name in ("read_committed", "read_uncommitted"):
        v = result[name]
        print(
            f"  {name}: {v['records']:,} records, {v['messages_seen']:,} messages; lost "
            f"{v['lost']}, duplicated {v['duplicated_records']} ({v['messages_duplicated']} "
            f"messages), order violations {v['order_violations']}, keys split "
            f"{v['keys_in_several_partitions']}, not at stored location "
            f"{v['stored_location_not_found']}"
        )
    recovered = ", ".join(f"-> {k} {v}" for k, v in result["recovered_leases"].items())
    print(
        f"  uncertain decided by the reconciler: {result['reconciler_decisions'] or 'none'}; "
        f"expired leases recovered: {recovered or 'none'}; escalated {result['escalated']}; "
        f"messages attempted more than once {result['messages_attempted_more_than_once']} (most "
        f"{result['most_attempts']})"
    )
    events = ", ".join(f"{k} {v}" for k, v in result["log_events"].items() if v)
    print(f"  in the logs: {events or 'nothing notable'}")
    blocking = [f for f in freezes if any(t["waiting"] for t in f["open_transactions"])]
    for f in blocking:
        waiting = sum(t["waiting"] for t in f["open_transactions"])
        statements = "; ".join(
            " ".join(t["last_statement"].split())[:60] for t in f["open_transactions"]
        )
        print(
            f"  freeze {f['number']} ({f['phase']}, {f['held_seconds']} s): its open "
            f"transaction held up {waiting} other session(s); last statement: {statements}"
        )
    traced = [f for f in freezes if f["duplicated_from_its_batches"]]
    for f in traced:
        print(
            f"  freeze {f['number']} ({f['phase']}, {f['held_seconds']} s, publisher pid "
            f"{f['pid']}): {f['duplicated_from_its_batches']} of its messages read twice"
        )
    print(
        f"  run time {result['seconds_total']:.0f} s (writing {result['seconds_writing']:.0f} s, "
        f"draining {result['seconds_draining']} s); exit codes {result['exit_codes']}, "
        f"replaced {result['exit_codes_replaced']}"
    )
    if result["services_restarted"]:
        print(f"  NOTE: restarted during the run (by someone else): {result['services_restarted']}")
    verdict = "PASS" if not result["failures"] else "FAIL: " + "; ".join(result["failures"])
    print(f"  {verdict}", flush=True)


def record(key: str, result: dict[str, Any]) -> None:
    """Keep ``result`` under ``key`` in freeze_soak.json, leaving the other keys."""
    results: dict[str, Any] = {}
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        loaded = json.loads(RESULTS.read_text())
        if isinstance(loaded, dict):
            results = loaded
    results[key] = {**stamp(), **result}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    partial = RESULTS.with_suffix(".tmp")
    partial.write_text(json.dumps(results, indent=2, default=str) + "\n")
    partial.replace(RESULTS)


def main() -> None:
    """Run the soak in each delivery mode asked for; exit 1 if any check failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=30_000)
    parser.add_argument("--freezes", type=int, default=20, help="at random moments")
    parser.add_argument(
        "--cut-freezes", type=int, default=4, help="more, at OUTBOX_PAUSE_AT cuts (0: none)"
    )
    parser.add_argument(
        "--delivery", choices=("idempotent", "transactional", "both"), default="both"
    )
    parser.add_argument("--sink", choices=("kafka-python", "confluent"), default="kafka-python")
    parser.add_argument("--publishers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None, help="default: a random one, printed")
    parser.add_argument("--keys", type=int, default=300)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--drain-timeout", type=float, default=600.0)
    parser.add_argument(
        "--stall-seconds",
        type=float,
        default=120.0,
        help="the delivery counts as stalled when no message is delivered for this long",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="default: a new temporary one")
    parser.add_argument(
        "--keep", action="store_true", help="keep the database and topic even when it passes"
    )
    args = parser.parse_args()
    if args.sink == "confluent" and importlib.util.find_spec("confluent_kafka") is None:
        raise SystemExit("--sink confluent: the confluent extra is not installed")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1_000_000)
    base_url, bootstrap = environment()
    log_root = args.log_dir or Path(tempfile.mkdtemp(prefix="freeze-soak-"))
    modes = ("transactional", "idempotent") if args.delivery == "both" else (args.delivery,)
    failed = False
    for delivery in modes:
        log_dir = log_root / f"{delivery}-{args.sink}"
        log_dir.mkdir(parents=True, exist_ok=True)
        run = Run(args, delivery, base_url, bootstrap, log_dir)
        try:
            result = run.execute()
        except BaseException:
            print(f"  failed; kept: database {run.database}, topic {run.topic}", flush=True)
            raise
        record(f"{delivery}/{args.sink}", result)
        summarise(result)
        failed |= bool(result["failures"])
        run.clean_up(keep=args.keep or bool(result["failures"]))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
