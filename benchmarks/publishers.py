"""Publishers: one vs two ``outbox-publisher`` processes draining the same backlog.

A backlog of records (``throughput.make_records``: about 200 bytes, keyed
over 1,000 keys) is committed as pending intents; then one, or two, real
``outbox-publisher`` processes (``--exit-when-idle --http-port 0
--batch-size 1000``, otherwise their defaults) are started together and
deliver it. Two figures per run:

* delivery rate: messages / (first claim -> last confirmation stored), from
  the batch records, the figure to judge;
* wall rate: messages / (processes started -> all exited), which adds the
  processes' start (imports, connections, registration) and stop.

Runs alternate (one, two, one, two, ...) on fresh databases and topics. The
publishers share the work by lanes (a fair share each, rebalanced every
second), and on this machine they also share two cores with PostgreSQL
and Kafka, so the ratio two / one may stay well below 2: the CPU seconds of
the publisher processes, of PostgreSQL (this database's backends and the
rest) and of Kafka, read from /proc, say where the time goes.
Results go to benchmarks/results/latest.json under "publishers".
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import time
from typing import Any

import psycopg
from common import (
    CpuWatch,
    delete_topic,
    environment,
    kafka_pids,
    make_records,
    new_topic,
    postgres_groups,
    record_results,
    start_publisher,
    stop_publisher,
    temporary_database,
)

import outbox

FLAGS = ("--exit-when-idle", "--batch-size", "1000")


def drain(
    base_url: str, bootstrap: str, records: list[outbox.Message], count: int
) -> dict[str, Any]:
    """Deliver the backlog with ``count`` publisher processes; rates and CPU seconds."""
    with temporary_database(base_url, "outbox_bench_publishers") as (name, url):
        topic = new_topic(bootstrap)
        with psycopg.connect(url) as conn:
            outbox.enqueue_many(conn, [outbox.Message(topic, r.value, key=r.key) for r in records])
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE outbox.messages")
            conn.execute("CHECKPOINT")
        processes: list[subprocess.Popen[bytes]] = []

        def groups() -> dict[str, list[int]]:
            return {
                "publishers": [p.pid for p in processes],
                **postgres_groups(name),
                "kafka": kafka_pids(),
            }

        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            with CpuWatch(groups) as cpu:
                start = time.perf_counter()
                processes.extend(start_publisher(url, bootstrap, *FLAGS) for _ in range(count))
                for p in processes:
                    p.wait()
                wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
        finally:
            codes = [stop_publisher(p) for p in processes]
            delete_topic(bootstrap, topic)
        if any(codes):
            raise SystemExit(f"outbox-publisher exited {codes}")
        with psycopg.connect(url) as conn:
            delivered = conn.execute(
                "SELECT count(*) FROM outbox.messages WHERE state = 'delivered'"
            ).fetchone()
            window = conn.execute(
                "SELECT extract(epoch FROM max(settled_at) - min(claimed_at))::float8 "
                "FROM outbox.batches"
            ).fetchone()
            per_publisher = conn.execute(
                """
                SELECT count(*),
                       extract(epoch FROM min(b.claimed_at) - (SELECT min(claimed_at)
                                                              FROM outbox.batches))::float8,
                       extract(epoch FROM max(b.settled_at) - min(b.claimed_at))::float8,
                       count(DISTINCT b.id)
                FROM outbox.messages AS m
                JOIN outbox.batches AS b ON b.id = m.batch_id
                WHERE m.state = 'delivered'
                GROUP BY b.publisher_id
                ORDER BY 2
                """
            ).fetchall()
    if delivered != (len(records),):
        raise SystemExit(f"delivered {delivered}, expected {len(records)}")
    assert window is not None
    busy, idle = cpu.machine()
    used = cpu.used()
    # The publishers' own count, whole: sampling misses their last moments.
    exact = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    used["everything else"] -= exact - used.get("publishers", 0.0)
    used["publishers"] = exact
    return {
        "delivery_msgs_per_s": len(records) / window[0],
        "wall_msgs_per_s": len(records) / wall,
        "delivery_seconds": window[0],
        "wall_seconds": wall,
        "publishers": [
            {
                "delivered": n,
                "first_claim_after_s": round(first, 2),
                "active_s": round(active, 2),
                "batches": batches,
            }
            for n, first, active, batches in per_publisher
        ],
        "cpu_seconds": {k: round(v, 2) for k, v in used.items()},
        "machine_busy_seconds": round(busy, 2),
        "machine_idle_seconds": round(idle, 2),
    }


def describe(count: int, run: dict[str, Any]) -> str:
    shares = ", ".join(
        f"{p['delivered']:,} in {p['batches']} batches from {p['first_claim_after_s']:.1f} s"
        for p in run["publishers"]
    )
    cpu = "  ".join(f"{k} {v:.1f}" for k, v in run["cpu_seconds"].items() if v >= 0.05)
    return (
        f"{count} publisher{'s' if count > 1 else ' '}: delivery {run['delivery_msgs_per_s']:7,.0f}"
        f" msg/s ({run['delivery_seconds']:.1f} s), wall {run['wall_msgs_per_s']:7,.0f} msg/s "
        f"({run['wall_seconds']:.1f} s)\n"
        f"    messages: {shares}\n"
        f"    CPU seconds: {cpu}; machine busy {run['machine_busy_seconds']:.1f} of "
        f"{run['machine_busy_seconds'] + run['machine_idle_seconds']:.1f} s"
    )


def main() -> None:
    """Alternate runs with one and two publishers; print rates, CPU and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each")
    args = parser.parse_args()
    base_url, bootstrap = environment()
    records = make_records(args.messages)
    print(
        f"{args.messages:,} records backlog, outbox-publisher {' '.join(FLAGS)}, "
        f"{args.rounds} runs of each, alternating"
    )
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for round_no in range(1, args.rounds + 1):
        for count in (1, 2):
            run = drain(base_url, bootstrap, records, count)
            runs[count].append(run)
            print(f"round {round_no}: {describe(count, run)}")

    def median(count: int, figure: str) -> float:
        return float(statistics.median(r[figure] for r in runs[count]))

    one, two = median(1, "delivery_msgs_per_s"), median(2, "delivery_msgs_per_s")
    wall_one, wall_two = median(1, "wall_msgs_per_s"), median(2, "wall_msgs_per_s")
    ratio = two / one
    record_results(
        "publishers",
        {
            "messages": args.messages,
            "flags": list(FLAGS),
            "one": runs[1],
            "two": runs[2],
            "ratio_of_median_delivery_rates": round(ratio, 3),
            "ratio_of_median_wall_rates": round(wall_two / wall_one, 3),
        },
    )
    print(
        f"median delivery rate: one {one:,.0f} msg/s, two {two:,.0f} msg/s; "
        f"wall: one {wall_one:,.0f}, two {wall_two:,.0f} (ratio {wall_two / wall_one:.2f})"
    )
    print(f"publishers: ratio two / one publisher {ratio:.2f} (delivery rates, medians)")


if __name__ == "__main__":
    main()
