"""Several publishers share the work: no loss, no duplicate, each key in order.

Three publishers deliver a stream of keyed messages while a writer keeps
committing more; one publisher is killed with SIGKILL and another is started
mid-run. Its lanes move to the survivors once their lease expires, and its
in-flight batch is recovered and reconciled before later messages of the same
keys go out.
"""

from __future__ import annotations

import signal
import threading
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

import outbox
from publisher.app import build_publisher
from publisher.store import LANES
from publisher.testing import config_for_tests
from tests.support import (
    DELIVERY_MODES,
    assert_each_read_once,
    count_by_state,
    delivery_flags,
    fast_publisher_flags,
    read_topic,
    reads_committed,
    start_publisher,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.acceptance

KEYS = 40
FIRST, MORE = 3_000, 3_000
FAST = fast_publisher_flags(100)


def _enqueue(database_url: str, topic: str, start: int, count: int, per_tx: int) -> list[uuid.UUID]:
    """Messages ``start..start+count`` with value ``key:n``, n rising per key in commit order."""
    ids: list[uuid.UUID] = []
    with psycopg.connect(database_url) as conn:
        for first in range(start, start + count, per_tx):
            with conn.transaction():
                ids += outbox.enqueue_many(
                    conn,
                    [
                        outbox.Message(topic, f"k{i % KEYS}:{i}", key=f"k{i % KEYS}")
                        for i in range(first, min(first + per_tx, start + count))
                    ],
                )
    return ids


def _lane_owners(database_url: str) -> tuple[int, int]:
    """How many publishers own lanes under a live lease, and how many lanes they own."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(DISTINCT owner), count(owner) FROM outbox.lanes "
            "WHERE lease_expires_at > now()"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _delivered(database_url: str) -> int:
    return count_by_state(database_url).get("delivered", 0)


@pytest.mark.parametrize("delivery", DELIVERY_MODES)
def test_three_publishers_one_killed_one_added_deliver_everything_once_in_key_order(
    database_url: str, kafka_bootstrap: str, topic: str, delivery: str
) -> None:
    """SIGKILL one of three publishers and start a fourth mid-run: all delivered once, in order
    (in transactional delivery, as a read_committed consumer reads)."""
    flags = (*FAST, *delivery_flags(delivery))
    committed = reads_committed(delivery)
    publishers = [start_publisher(database_url, kafka_bootstrap, *flags) for _ in range(3)]
    # The lanes shared first: the first publisher up takes them all, and one
    # publisher alone can deliver the whole stream before its next heartbeat
    # gives the others their share.
    wait_until(
        lambda: _lane_owners(database_url) == (3, LANES),
        timeout=60,
        interval=0.2,
        what="the three publishers to share the lanes",
    )
    ids = _enqueue(database_url, topic, 0, FIRST, per_tx=500)
    more: list[uuid.UUID] = []
    writer = threading.Thread(
        target=lambda: more.extend(_enqueue(database_url, topic, FIRST, MORE, per_tx=20))
    )
    try:
        writer.start()
        wait_until(
            lambda: _delivered(database_url) >= 1_000, timeout=60, what="the first deliveries"
        )
        victim = publishers.pop(1)
        victim.kill()  # SIGKILL: no settle, no release; its leases must expire
        victim.communicate(timeout=30)
        publishers.append(start_publisher(database_url, kafka_bootstrap, *flags))
        writer.join(timeout=120)
        assert not writer.is_alive()
        wait_until(
            lambda: count_by_state(database_url) == {"delivered": FIRST + MORE},
            timeout=240,
            interval=0.5,
            what="every message to be delivered",
        )
    finally:
        logs = [stop_process(p, signal.SIGTERM, timeout=60) for p in publishers]
    assert all(p.returncode == 0 for p in publishers), logs

    assert_each_read_once(database_url, kafka_bootstrap, topic, [*ids, *more], committed=committed)
    # Each key's records are in the order they were committed.
    per_key: dict[bytes | None, list[int]] = defaultdict(list)
    records = read_topic(kafka_bootstrap, topic, committed=committed)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        per_key[r.key].append(int(r.value.split(b":")[1]))
    assert len(per_key) == KEYS
    assert all(values == sorted(values) for values in per_key.values())

    with psycopg.connect(database_url) as conn:
        deliverers = conn.execute(
            # A delivery's record is its batch.
            "SELECT count(DISTINCT b.publisher_id) FROM outbox.messages AS m "
            "JOIN outbox.batches AS b ON b.id = m.batch_id WHERE m.state = 'delivered'"
        ).fetchone()
        owners = conn.execute(
            "SELECT count(*) FROM outbox.lanes WHERE owner IS NOT NULL"
        ).fetchone()
    assert deliverers is not None
    assert deliverers[0] >= 3  # the work was shared
    assert owners == (0,)  # the survivors gave their lanes back when they stopped


def test_a_publisher_cut_off_from_kafka_lets_another_deliver_its_keys(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """A publisher whose host cannot reach the brokers holds every lane, then another that
    can starts: the cut-off one lets its lanes go once it has not reached Kafka for a
    lease, and the other delivers every key, each message once."""
    timeouts = {
        "exit_when_idle": False,
        "lease_seconds": 6.0,
        "heartbeat_interval": 1.0,
        "max_block_ms": 1000,
        "request_timeout_ms": 1000,
        "delivery_timeout_ms": 2000,
        "retry_base_seconds": 0.2,
        "retry_cap_seconds": 1.0,
    }
    cut_off = build_publisher(config_for_tests(database_url, "127.0.0.1:1", **timeouts))
    healthy = build_publisher(config_for_tests(database_url, kafka_bootstrap, **timeouts))
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(cut_off.run)]
        try:
            wait_until(
                lambda: _lane_owners(database_url) == (1, LANES),
                timeout=15,
                what="the cut-off publisher to take every lane",
            )
            ids = _enqueue(database_url, topic, 0, 200, per_tx=50)
            running.append(pool.submit(healthy.run))
            wait_until(
                lambda: _delivered(database_url) == len(ids),
                timeout=90,
                what="every message delivered, those of the cut-off publisher's lanes too",
            )
            assert cut_off.heartbeat is not None
            assert cut_off.heartbeat.stepped_back
            with psycopg.connect(database_url) as conn:
                owners = conn.execute(
                    "SELECT DISTINCT owner FROM outbox.lanes WHERE lease_expires_at > now()"
                ).fetchall()
            assert owners == [(healthy.publisher_id,)]
        finally:
            for publisher in (cut_off, healthy):
                publisher.request_stop()
            for future in running:
                future.result(timeout=60)
    assert_each_read_once(database_url, kafka_bootstrap, topic, ids, committed=False)
