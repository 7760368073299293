"""Throughput: the outbox end to end against kafka-python alone, in one run.

Both sides send the same records (about 200 bytes, keyed over 1,000 keys)
to the same broker with the same producer settings (idempotent, acks=all):

* bare: one kafka-python producer sends every record and flushes;
* end to end: the records are already committed as pending intents; one
  publisher claims, sends and confirms them all (rows -> Kafka acknowledged
  -> confirmation stored). The clock runs from the publisher's start until
  the last confirmation is stored. It runs with the default sink
  (kafka-python) and, when confluent-kafka is installed, with
  ``--sink confluent`` too, and in transactional delivery with kafka-python
  (judged against the idempotent run: target 0.8);
* database cycle alone: the publisher's statements for the same backlog
  (claim, mark sending, settle), one after the other, with nothing sent:
  what bounds one publisher's rate on this machine; and the same for the
  cycle before migration 0007 (``baseline_cycle.sql``, on a database at
  schema version 6), which wrote every message three times (target: today's
  at least twice as fast).

They are interleaved for several rounds on fresh topics and databases, so
the noise of a shared machine hits all alike; the ratio of the medians, end
to end / bare, is the figure to judge (one per sink). Results also go to
benchmarks/results/latest.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg
from common import (
    KEYS,
    PARTITIONS,
    backlog,
    delete_topic,
    environment,
    make_records,
    new_topic,
    publisher_on_backlog,
    record_results,
    temporary_database,
)
from kafka import KafkaProducer

import outbox
from outbox.queries import parse_queries
from outbox.states import State
from publisher.config import PublisherConfig
from publisher.outcomes import AttemptOutcome
from publisher.partitioning import partition_for
from publisher.store import PublisherStore, Settlement

TARGET = 0.85
#: The database cycle against the cycle before 0007, measured in the same run.
CYCLE_GAIN_TARGET = 2.0
#: Transactional delivery end to end against idempotent, same sink, same run.
TRANSACTIONAL_TARGET = 0.8


def bare_producer(bootstrap: str, records: list[outbox.Message]) -> float:
    """Seconds for kafka-python alone to send and flush every record."""
    topic = new_topic(bootstrap)
    try:
        producer = KafkaProducer(
            bootstrap_servers=bootstrap,
            enable_idempotence=True,
            acks="all",
            linger_ms=5,
            batch_size=256 * 1024,
        )
        # Metadata fetched before the clock starts, as for the publisher.
        producer.partitions_for(topic)
        prepared = [
            (str(r.key).encode(), r.value, [("outbox-id", str(uuid.uuid4()).encode())])
            for r in records
        ]
        start = time.perf_counter()
        for key, value, headers in prepared:
            producer.send(
                topic,
                value=value,
                key=key,
                headers=headers,
                partition=partition_for(key, uuid.UUID(int=0), PARTITIONS),
            )
        producer.flush()
        elapsed = time.perf_counter() - start
        producer.close()
        return elapsed
    finally:
        delete_topic(bootstrap, topic)


@dataclass(frozen=True, slots=True)
class Run:
    """One end-to-end run: wall seconds, this process's CPU seconds, batches."""

    seconds: float
    cpu_seconds: float
    batches: int


def end_to_end(
    database_url: str,
    bootstrap: str,
    records: list[outbox.Message],
    batch_size: int,
    sink: str = "kafka-python",
    *,
    delivery: str = "idempotent",
) -> Run:
    """A publisher (with ``sink``, in ``delivery`` mode) delivers and confirms every pending
    record; how long it took.

    The CPU time is this process's: the publisher's threads (and librdkafka's).
    """
    topic = new_topic(bootstrap)
    try:
        with temporary_database(database_url, "outbox_bench") as (_, url):
            publisher = publisher_on_backlog(
                url, bootstrap, topic, records, batch_size, sink=sink, delivery=delivery
            )
            cpu, start = time.process_time(), time.perf_counter()
            totals = publisher.run()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            with psycopg.connect(url) as conn:
                delivered = conn.execute(
                    "SELECT count(*) FROM outbox.messages WHERE state = 'delivered'"
                ).fetchone()
            if delivered != (len(records),) or totals.delivered != len(records):
                raise SystemExit(
                    f"{sink}, {delivery}: delivered {delivered}, expected {len(records)}"
                )
            return Run(elapsed, cpu, totals.batches)
    finally:
        delete_topic(bootstrap, topic)


#: The cycle before migration 0007 (a claim and a settle that each wrote every
#: message row, plus an attempt row per delivery), measured beside today's.
BASELINE_STATEMENTS = parse_queries(
    (Path(__file__).parent / "baseline_cycle.sql").read_text(encoding="utf-8")
)
#: The schema version the baseline statements run on.
BASELINE_SCHEMA = 6


def database_cycle(
    database_url: str, records: list[outbox.Message], batch_size: int, *, baseline: bool = False
) -> float:
    """Seconds for the publisher's database work alone on the same backlog, nothing sent.

    The same store calls as a publisher's batch (claim, mark sending, settle
    as delivered at made-up offsets), one after the other, with no Kafka and
    no claim-ahead: what one publisher's statements cost, a bound on its rate
    here. Not a delivery: nothing reaches a broker. With ``baseline``, the
    cycle as it was before 0007, on a database at that schema version.
    """
    with temporary_database(
        database_url, "outbox_bench_cycle", target=BASELINE_SCHEMA if baseline else None
    ) as (_, url):
        backlog(url, "cycle", records)
        store = PublisherStore(
            url, uuid.uuid4(), statements=BASELINE_STATEMENTS if baseline else None
        )
        if baseline:
            # As the publisher then ran them: every statement planned at each
            # run, none prepared (today's claim is, see PublisherStore.conn).
            store.conn.prepare_threshold = None
        store.register("bench", 0, 60)
        store.acquire_lanes(1_000, 60)  # every lane
        offset = 0
        start = time.perf_counter()
        while (batch := store.claim(batch_size, 60)) is not None:
            store.mark_sending(batch, {"cycle": PARTITIONS}, 30)
            settlements = []
            for m in batch.messages:
                settlements.append(
                    Settlement(m.id, m.fence, State.DELIVERED, AttemptOutcome.DELIVERED, 0, offset)
                )
                offset += 1
            store.settle(batch, settlements)
        elapsed = time.perf_counter() - start
        store.mark_stopped()
        store.close()
        if offset != len(records):
            raise SystemExit(f"database cycle settled {offset}, expected {len(records)}")
        return elapsed


def main() -> None:
    """Run the interleaved rounds and print rates and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--batch-size", type=int, default=PublisherConfig.batch_size, help="publisher batch"
    )
    args = parser.parse_args()
    database_url, bootstrap = environment()
    records = make_records(args.messages)
    size = statistics.mean(len(r.value) + len(str(r.key)) for r in records)
    print(
        f"{args.messages} records of ~{size:.0f} bytes, {KEYS} keys, {PARTITIONS} partitions, "
        f"publisher batch {args.batch_size}, {args.rounds} interleaved rounds"
    )

    sinks = ["kafka-python"]
    if importlib.util.find_spec("confluent_kafka") is not None:
        sinks.append("confluent")  # the optional faster sink (pg-kafka-outbox[confluent])
    bare_rates: list[float] = []
    e2e_rates: dict[str, list[float]] = {sink: [] for sink in sinks}
    cycle_rates: list[float] = []
    baseline_rates: list[float] = []
    txn_rates: list[float] = []
    for round_no in range(1, args.rounds + 1):
        bare = args.messages / bare_producer(bootstrap, records)
        bare_rates.append(bare)
        line = [f"bare {bare:,.0f} msg/s"]
        for sink in sinks:
            run = end_to_end(database_url, bootstrap, records, args.batch_size, sink)
            e2e_rates[sink].append(args.messages / run.seconds)
            line.append(
                f"end to end ({sink}) {e2e_rates[sink][-1]:,.0f} msg/s, "
                f"ratio {e2e_rates[sink][-1] / bare:.2f}"
            )
        txn = end_to_end(
            database_url, bootstrap, records, args.batch_size, delivery="transactional"
        )
        txn_rates.append(args.messages / txn.seconds)
        line.append(
            f"transactional (kafka-python) {txn_rates[-1]:,.0f} msg/s, "
            f"{txn_rates[-1] / e2e_rates['kafka-python'][-1]:.2f} of idempotent"
        )
        cycle_rates.append(args.messages / database_cycle(database_url, records, args.batch_size))
        baseline_rates.append(
            args.messages / database_cycle(database_url, records, args.batch_size, baseline=True)
        )
        line.append(
            f"database cycle alone {cycle_rates[-1]:,.0f} msg/s "
            f"(before 0007: {baseline_rates[-1]:,.0f}, x{cycle_rates[-1] / baseline_rates[-1]:.2f})"
        )
        print(f"round {round_no}: " + "   ".join(line) + f"   ({run.batches} batches)")

    bare_median = statistics.median(bare_rates)
    e2e_median = {sink: statistics.median(rates) for sink, rates in e2e_rates.items()}
    cycle_median = statistics.median(cycle_rates)
    baseline_median = statistics.median(baseline_rates)
    txn_ratio = statistics.median(txn_rates) / e2e_median["kafka-python"]
    ratio = {sink: rate / bare_median for sink, rate in e2e_median.items()}
    record_results(
        "throughput",
        {
            "messages": args.messages,
            "batch_size": args.batch_size,
            "bare_msgs_per_s": [round(r) for r in bare_rates],
            # The default sink's figures keep the keys they always had.
            "end_to_end_msgs_per_s": [round(r) for r in e2e_rates["kafka-python"]],
            "ratio_of_medians": round(ratio["kafka-python"], 3),
            "end_to_end_by_sink_msgs_per_s": {
                sink: [round(r) for r in rates] for sink, rates in e2e_rates.items()
            },
            "ratio_of_medians_by_sink": {sink: round(r, 3) for sink, r in ratio.items()},
            "database_cycle_alone_msgs_per_s": [round(r) for r in cycle_rates],
            "database_cycle_ratio_of_medians": round(cycle_median / bare_median, 3),
            "database_cycle_before_0007_msgs_per_s": [round(r) for r in baseline_rates],
            "database_cycle_gain_over_before_0007": round(cycle_median / baseline_median, 3),
            "database_cycle_gain_target": CYCLE_GAIN_TARGET,
            "transactional_msgs_per_s": [round(r) for r in txn_rates],
            "transactional_over_idempotent": round(txn_ratio, 3),
            "transactional_target": TRANSACTIONAL_TARGET,
            "target": TARGET,
        },
    )
    print(
        f"medians: bare producer {bare_median:,.0f} msg/s; "
        + "; ".join(f"end to end ({sink}) {rate:,.0f}" for sink, rate in e2e_median.items())
        + f"; database cycle alone {cycle_median:,.0f} (the bound on one publisher here)"
    )
    print(
        f"transactional / idempotent end to end (kafka-python): {txn_ratio:.2f} "
        f"({'met' if txn_ratio >= TRANSACTIONAL_TARGET else 'MISSED'}, "
        f"target {TRANSACTIONAL_TARGET})"
    )
    gain = cycle_median / baseline_median
    print(
        f"database cycle / the cycle before 0007 (one write per message): {gain:.2f} "
        f"({'met' if gain >= CYCLE_GAIN_TARGET else 'MISSED'}, target {CYCLE_GAIN_TARGET})"
    )
    print(
        "throughput ratio end to end / bare producer: "
        + ", ".join(
            f"{ratio[sink]:.2f} with {sink} ({'met' if ratio[sink] >= TARGET else 'MISSED'})"
            for sink in sinks
        )
        + f" (target {TARGET})"
    )


if __name__ == "__main__":
    main()
