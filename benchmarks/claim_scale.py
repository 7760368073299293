"""Claims next to a backlog they cannot take: what one claim costs as that backlog grows.

A claim reads the pending messages of its own lanes that are not held, in
``seq`` order (the partial index ``messages_pending_by_lane``, one branch per
lane, merged), and tests each: not in an open batch, its key not held back.
So pending messages of its lanes that it cannot take, older than the ones it
can, are read again by every claim unless the publisher's hold pass marked
them held (since migration 0013); those of other publishers' lanes are not
read at all (before migration 0012 they were, at every claim). Three shapes,
each at several sizes N (default 0, 10,000, 100,000 and 1,000,000), one
database per shape and size (those of 1,000,000 take about a minute each to
build):

* ``held``: a hot key whose oldest message is quarantined, with N pending
  messages of that key behind it (held until an operator acts), then 1,000
  free messages of other keys, and the hold pass run once (it marks the N).
  Timed: one claim of 500 free messages, undone (its batch row deleted) so
  that every round claims the same; and the hold pass itself
  (``hold_and_release``: it finds nothing new to mark or release).
* ``unmarked``: the same, without the hold pass: what a claim reads before
  the pass has run (or before 0013). Timed: the same claim.
* ``held_idle``: the quarantined head and the N held messages behind it,
  marked, and nothing else: a publisher with nothing it may claim. Timed: a
  claim (it finds nothing) and the two reads after it.
* ``other_lanes``: N pending messages of one key, in a lane another publisher
  owns, and nothing in this publisher's lanes. Timed: one claim (it finds
  nothing), then the two statements the loop runs when a claim found nothing
  (``work_left``, ``seconds_until_due``).

The databases are built first, and each claims once untimed (a
publisher's connection plans its prepared claim at its first run, then
reuses the plan); then rounds (default 7) time every shape and
size in turn, so that all of them see the same machine, each timed call
after an untimed one on the same database (its pages back in memory, as for
a publisher claiming in a loop). Each figure is the median over the rounds,
with its ratio to the same shape at N = 0.
The results go to benchmarks/results/latest.json under "claim_scale".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from common import environment, record_results, temporary_database

import outbox
from publisher.store import PublisherStore

TOPIC = "orders"
FREE = 1_000
CLAIM = 500
#: Untimed claims on each database before the rounds (see main).
WARM_UP = 1
#: Long enough for every round: nothing renews the lanes' leases here.
LEASE_SECONDS = 3_600.0


def _enqueue(url: str, messages: list[outbox.Message]) -> None:
    for start in range(0, len(messages), 5_000):
        with psycopg.connect(url) as conn:
            outbox.enqueue_many(conn, messages[start : start + 5_000])


def _vacuum(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE outbox.messages")


def _store(url: str) -> PublisherStore:
    store = PublisherStore(url, uuid.uuid4())
    store.register("bench", 0, LEASE_SECONDS)
    store.acquire_lanes(32, LEASE_SECONDS)
    return store


def build_unmarked(url: str, held: int, free: int = FREE) -> PublisherStore:
    """A quarantined head on key "hot", ``held`` messages of it behind, ``free`` free ones."""
    with psycopg.connect(url) as conn:
        head = outbox.enqueue(conn, TOPIC, b"head", key="hot")
        conn.execute(
            "UPDATE outbox.messages SET state = 'quarantined', last_error = 'bench' WHERE id = %s",
            (head,),
        )
    _enqueue(url, [outbox.Message(TOPIC, b"held", key="hot") for _ in range(held)])
    _enqueue(url, [outbox.Message(TOPIC, b"free", key=f"k{i}") for i in range(free)])
    _vacuum(url)
    return _store(url)


def build_held(url: str, held: int, free: int = FREE) -> PublisherStore:
    """``build_unmarked``, then hold passes until the ``held`` messages are all marked."""
    store = build_unmarked(url, held, free)
    marked = 0
    while True:  # a pass marks at most MOST_HELD_PER_KEY of a key
        more, released = store.hold_and_release()
        assert released == 0, released
        if not more:
            break
        marked += more
    assert marked == held, (marked, held)
    _vacuum(url)
    return store


def build_other_lanes(url: str, backlog: int) -> PublisherStore:
    """``backlog`` messages of key "hot" in a lane this publisher does not own."""
    _enqueue(url, [outbox.Message(TOPIC, b"busy", key="hot") for _ in range(backlog)])
    with psycopg.connect(url) as conn:
        lane = outbox.enqueue(conn, TOPIC, b"busy", key="hot")
        [(hot_lane,)] = conn.execute(
            "SELECT lane FROM outbox.messages WHERE id = %s", (lane,)
        ).fetchall()
    _vacuum(url)
    store = _store(url)
    with psycopg.connect(url, autocommit=True) as conn:  # another publisher's, lease live
        conn.execute(
            "UPDATE outbox.lanes SET owner = %s, lease_expires_at = now() + interval '1 hour' "
            "WHERE lane = %s",
            (uuid.uuid4(), hot_lane),
        )
    return store


def time_held_claim(store: PublisherStore) -> float:
    """One claim of the free messages, undone (so every round claims the same); its seconds.

    A claim writes only its batch row, so deleting that row undoes it. Not a
    rollback: psycopg forgets its prepared statements at every ROLLBACK, and
    the publisher's claim is prepared once per connection.
    """
    start = time.perf_counter()
    batch = store.claim(CLAIM, LEASE_SECONDS)
    elapsed = time.perf_counter() - start
    assert batch is not None, "the free messages were not claimed"
    store.conn.execute("DELETE FROM outbox.batches WHERE id = %s", (batch.id,))
    assert len(batch.messages) == CLAIM, len(batch.messages)
    assert all(m.key != b"hot" for m in batch.messages), "a held message was claimed"
    return elapsed


def time_hold_pass(store: PublisherStore) -> float:
    """One hold pass (mark, then release) that finds nothing to do; its seconds."""
    start = time.perf_counter()
    assert store.hold_and_release() == (0, 0)
    return time.perf_counter() - start


def time_empty_claim(store: PublisherStore) -> float:
    """One claim that finds nothing; its seconds."""
    start = time.perf_counter()
    batch = store.claim(CLAIM, LEASE_SECONDS)
    elapsed = time.perf_counter() - start
    assert batch is None, "a message of another publisher's lane was claimed"
    return elapsed


def time_idle_checks(store: PublisherStore, *, work_left: bool) -> float:
    """``work_left`` (which should say ``work_left``) and ``seconds_until_due``, as the loop
    runs them after an empty claim."""
    start = time.perf_counter()
    assert store.work_left() is work_left
    store.seconds_until_due()
    return time.perf_counter() - start


@contextlib.contextmanager
def databases(base_url: str, sizes: list[int]) -> Iterator[dict[tuple[str, int], PublisherStore]]:
    """Every shape at every size, built; their stores, closed and dropped afterwards."""
    builders: dict[str, Callable[[str, int], PublisherStore]] = {
        "held": build_held,
        "unmarked": build_unmarked,
        "held_idle": lambda url, n: build_held(url, n, free=0),
        "other_lanes": build_other_lanes,
    }
    with contextlib.ExitStack() as stack:
        stores: dict[tuple[str, int], PublisherStore] = {}
        for shape, build in builders.items():
            for n in sizes:
                _, url = stack.enter_context(temporary_database(base_url, f"outbox_claims_{shape}"))
                store = build(url, n)
                stack.callback(store.close)
                stores[shape, n] = store
                print(f"  built {shape} with {n:,}", flush=True)
        yield stores


def main() -> None:
    """Build, time in rounds, print and record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 10_000, 100_000, 1_000_000])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    sizes = sorted(set(args.sizes) | {0})
    base_url, _ = environment()
    timers: dict[str, tuple[str, Callable[[PublisherStore], float]]] = {
        "held_claim": ("held", time_held_claim),
        "unmarked_claim": ("unmarked", time_held_claim),
        "hold_pass": ("held", time_hold_pass),
        "held_idle_claim": ("held_idle", time_empty_claim),
        # Only an operator moves the quarantined head: nothing is left to do.
        "held_idle_checks": ("held_idle", functools.partial(time_idle_checks, work_left=False)),
        "other_lanes_claim": ("other_lanes", time_empty_claim),
        "other_lanes_idle_checks": (
            "other_lanes",
            functools.partial(time_idle_checks, work_left=True),
        ),
    }
    seconds: dict[tuple[str, int], list[float]] = {(t, n): [] for t in timers for n in sizes}
    with databases(base_url, sizes) as stores:
        # A publisher's connection plans its prepared claim at its first run,
        # then reuses the plan: time the runs that reuse it.
        for (shape, _), store in stores.items():
            for _ in range(WARM_UP):
                next(m for s, m in timers.values() if s == shape)(store)
        for _ in range(args.rounds):
            for timer, (shape, measure) in timers.items():
                for n in sizes:
                    # Untimed first: the other databases of the round may have pushed
                    # this one's pages out of shared_buffers, where a publisher
                    # claiming in a loop would find them.
                    measure(stores[shape, n])
                    seconds[timer, n].append(measure(stores[shape, n]))
    results: dict[str, Any] = {"rounds": args.rounds, "claim": CLAIM, "free": FREE}
    for timer in timers:
        base = statistics.median(seconds[timer, 0])
        lines = {}
        for n in sizes:
            median = statistics.median(seconds[timer, n])
            lines[str(n)] = {"median_ms": round(median * 1000, 2), "ratio": round(median / base, 1)}
            print(
                f"{timer:24} N={n:>8,}: {median * 1000:8.1f} ms  ({median / base:5.1f}x N=0)",
                flush=True,
            )
        results[timer] = lines
    record_results("claim_scale", results)


if __name__ == "__main__":
    main()
