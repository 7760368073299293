"""Throughput: the outbox end to end against kafka-python alone, in one run.

Both sides send the same records (about 200 bytes, keyed over 1,000 keys)
to the same broker with the same producer settings (idempotent, acks=all):

* bare: one kafka-python producer sends every record and flushes;
* end to end: the records are already committed as pending intents; one
  publisher claims, sends and confirms them all (rows -> Kafka acknowledged
  -> confirmation stored). The clock runs from the publisher's start until
  the last confirmation is stored.

The two are interleaved for several rounds on fresh topics and databases, so
the noise of a shared machine hits both alike; the ratio of the medians is
the figure to judge. Results also go to benchmarks/results/latest.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import psycopg
from common import (
    KEYS,
    PARTITIONS,
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
from publisher.config import PublisherConfig
from publisher.partitioning import partition_for


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


def end_to_end(
    database_url: str, bootstrap: str, records: list[outbox.Message], batch_size: int
) -> tuple[float, int]:
    """Seconds for a publisher to deliver and confirm every pending record; and its batches."""
    topic = new_topic(bootstrap)
    try:
        with temporary_database(database_url, "outbox_bench") as (_, url):
            publisher = publisher_on_backlog(url, bootstrap, topic, records, batch_size)
            start = time.perf_counter()
            totals = publisher.run()
            elapsed = time.perf_counter() - start
            with psycopg.connect(url) as conn:
                delivered = conn.execute(
                    "SELECT count(*) FROM outbox.messages WHERE state = 'delivered'"
                ).fetchone()
            if delivered != (len(records),) or totals.delivered != len(records):
                raise SystemExit(f"end to end delivered {delivered}, expected {len(records)}")
            return elapsed, totals.batches
    finally:
        delete_topic(bootstrap, topic)


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

    bare_rates, e2e_rates, batches = [], [], 0
    for round_no in range(1, args.rounds + 1):
        bare = args.messages / bare_producer(bootstrap, records)
        seconds, batches = end_to_end(database_url, bootstrap, records, args.batch_size)
        e2e = args.messages / seconds
        bare_rates.append(bare)
        e2e_rates.append(e2e)
        print(
            f"round {round_no}: bare {bare:,.0f} msg/s   end to end {e2e:,.0f} msg/s   "
            f"ratio {e2e / bare:.2f}   ({batches} batches: one claim and one confirm each)"
        )

    bare_median, e2e_median = statistics.median(bare_rates), statistics.median(e2e_rates)
    ratio = e2e_median / bare_median
    record_results(
        "throughput",
        {
            "messages": args.messages,
            "batch_size": args.batch_size,
            "bare_msgs_per_s": [round(r) for r in bare_rates],
            "end_to_end_msgs_per_s": [round(r) for r in e2e_rates],
            "ratio_of_medians": round(ratio, 3),
            "target": 0.85,
        },
    )
    print(
        f"bare producer median {bare_median:,.0f} msg/s, end to end median {e2e_median:,.0f} msg/s"
    )
    verdict = "met" if ratio >= 0.85 else "MISSED"
    print(f"throughput ratio end to end / bare producer: {ratio:.2f} (target 0.85): {verdict}")


if __name__ == "__main__":
    main()
