"""Sinks: the publisher end to end with kafka-python vs confluent-kafka, in one run.

The same backlog (records of about 200 bytes, keyed over 1,000 keys, already
committed as pending intents) is delivered by one in-process publisher
built with ``--sink kafka-python`` and with ``--sink confluent``, each on a
fresh database and topic, interleaved over several rounds (the order
alternates), so the noise of a shared machine hits both alike. The clock
runs from the publisher's start until the last confirmation is stored; the
CPU time is this process's (the publisher's threads and librdkafka's).
Each round also times both producers alone (send every record, flush) for
context. The figure to judge is the ratio of the end-to-end medians,
confluent / kafka-python. Printed only; ``--record`` also keeps it under
``sinks`` in benchmarks/results/latest.json.

    . ./.services.env && .venv/bin/python benchmarks/sinks.py [--messages N] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from typing import Any

from common import (
    KEYS,
    PARTITIONS,
    delete_topic,
    environment,
    make_records,
    new_topic,
    record_results,
)
from confluent_kafka import Producer
from throughput import bare_producer, end_to_end

import outbox
from publisher.config import PublisherConfig
from publisher.partitioning import partition_for

SINKS = ("kafka-python", "confluent")


def _prepared(records: list[outbox.Message]) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    return [
        (
            str(r.key).encode(),
            r.value if isinstance(r.value, bytes) else str(r.value).encode(),
            [("outbox-id", str(uuid.uuid4()).encode())],
        )
        for r in records
    ]


def bare(bootstrap: str, records: list[outbox.Message], sink: str) -> float:
    """Seconds for the producer alone (idempotent, acks=all, linger 5 ms) to send and flush all."""
    if sink == "kafka-python":
        return bare_producer(bootstrap, records)
    topic = new_topic(bootstrap)
    prepared = _prepared(records)
    try:
        delivered: list[int] = []

        def on_delivery(error: Any, _message: Any) -> None:
            if error is None:
                delivered.append(1)

        rd = Producer(
            {
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "batch.size": 256 * 1024,
            }
        )
        rd.list_topics(topic, timeout=10)
        start = time.perf_counter()
        for key, value, headers in prepared:
            rd.produce(
                topic,
                value=value,
                key=key,
                headers=headers,  # type: ignore[arg-type]
                partition=partition_for(key, uuid.UUID(int=0), PARTITIONS),
                on_delivery=on_delivery,
            )
            rd.poll(0)
        rd.flush()
        elapsed = time.perf_counter() - start
        if len(delivered) != len(records):
            raise SystemExit(f"bare confluent delivered {len(delivered)} of {len(records)}")
        return elapsed
    finally:
        delete_topic(bootstrap, topic)


def main() -> None:
    """Interleaved rounds; print both sinks' rates and the ratio confluent / kafka-python."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=PublisherConfig.batch_size)
    parser.add_argument("--record", action="store_true", help="keep the figures in latest.json")
    args = parser.parse_args()
    base_url, bootstrap = environment()
    records = make_records(args.messages)
    size = statistics.mean(len(r.value) + len(str(r.key)) for r in records)
    print(
        f"{args.messages} records of ~{size:.0f} bytes, {KEYS} keys, {PARTITIONS} partitions, "
        f"publisher batch {args.batch_size}, {args.rounds} interleaved rounds"
    )
    e2e: dict[str, list[float]] = {s: [] for s in SINKS}
    cpu_per_k: dict[str, list[float]] = {s: [] for s in SINKS}
    alone: dict[str, list[float]] = {s: [] for s in SINKS}
    for round_no in range(1, args.rounds + 1):
        order = SINKS if round_no % 2 else tuple(reversed(SINKS))
        line = []
        for sink in order:
            run = end_to_end(base_url, bootstrap, records, args.batch_size, sink)
            e2e[sink].append(args.messages / run.seconds)
            cpu_per_k[sink].append(run.cpu_seconds / args.messages * 1000)
            alone[sink].append(args.messages / bare(bootstrap, records, sink))
            line.append(
                f"{sink}: end to end {e2e[sink][-1]:,.0f} msg/s "
                f"({cpu_per_k[sink][-1] * 1000:.0f} ms CPU per 1k), alone {alone[sink][-1]:,.0f}"
            )
        print(f"round {round_no}: " + "   ".join(line))

    median = {s: statistics.median(e2e[s]) for s in SINKS}
    bare_median = {s: statistics.median(alone[s]) for s in SINKS}
    cpu_median = {s: statistics.median(cpu_per_k[s]) for s in SINKS}
    ratio = median["confluent"] / median["kafka-python"]
    for s in SINKS:
        print(
            f"{s}: end to end median {median[s]:,.0f} msg/s, "
            f"{cpu_median[s] * 1000:.0f} ms publisher CPU per 1k messages; "
            f"producer alone median {bare_median[s]:,.0f} msg/s"
        )
    print(f"ratio end to end, confluent / kafka-python: {ratio:.2f}")
    print(
        "ratio producer alone, confluent / kafka-python: "
        f"{bare_median['confluent'] / bare_median['kafka-python']:.2f}"
    )
    if args.record:
        record_results(
            "sinks",
            {
                "messages": args.messages,
                "batch_size": args.batch_size,
                "end_to_end_msgs_per_s": {s: [round(r) for r in e2e[s]] for s in SINKS},
                "publisher_cpu_ms_per_1k": {
                    s: [round(c * 1000) for c in cpu_per_k[s]] for s in SINKS
                },
                "producer_alone_msgs_per_s": {s: [round(r) for r in alone[s]] for s in SINKS},
                "ratio_of_end_to_end_medians": round(ratio, 3),
            },
        )


if __name__ == "__main__":
    main()
