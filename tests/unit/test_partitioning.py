"""Choosing a record's partition before sending (publisher/partitioning.py)."""

from __future__ import annotations

import random
import uuid
from collections import Counter

import pytest

from outbox.ids import new_message_id
from publisher.partitioning import partition_for

PARTITION_COUNTS = (1, 3, 7, 12)

# Reference vectors from Apache Kafka's Java client, org.apache.kafka.common.utils.Utils 4.4.0
# (kafka-clients-4.4.0.jar): Utils.toPositive(Utils.murmur2(key.getBytes(UTF_8))) % n for
# n = 1, 3, 7, 12, printed by a throwaway Java 17 program run against that jar. The raw
# Utils.murmur2 value is kept for the record.
JAVA_REFERENCE: list[tuple[str, int, tuple[int, int, int, int]]] = [
    ("", 275646681, (0, 0, 2, 9)),
    ("a", -1563381124, (0, 1, 5, 4)),
    ("customer-7", -1283830537, (0, 1, 6, 7)),
    ("key-0", 29210041, (0, 1, 0, 1)),
    ("key-1", 193331640, (0, 0, 5, 0)),
    ("key-2", 852269702, (0, 2, 4, 2)),
    ("key-3", -1839136101, (0, 2, 4, 11)),
    ("key-4", 647367033, (0, 0, 5, 9)),
    ("0123456789" * 10, 2142101513, (0, 2, 6, 5)),
    ("h\u00e9llo", 614509002, (0, 0, 2, 6)),
    ("orders", -1029842276, (0, 0, 1, 0)),
    ("\u043a\u043b\u044e\u0447-\u00fc", -1722112641, (0, 2, 5, 11)),
]


@pytest.mark.parametrize(
    ("key", "expected"),
    [(key, expected) for key, _, expected in JAVA_REFERENCE],
    ids=[f"{key[:12]!r}" for key, _, _ in JAVA_REFERENCE],
)
def test_keyed_partition_agrees_with_the_java_client(
    key: str, expected: tuple[int, int, int, int]
) -> None:
    """A keyed record lands where Kafka's Java client would put the same UTF-8 key."""
    message_id = uuid.UUID(int=0)
    got = tuple(partition_for(key.encode(), message_id, n) for n in PARTITION_COUNTS)
    assert got == expected


def test_keyed_partition_ignores_the_message_id() -> None:
    """Two messages with the same key land in the same partition whatever their ids."""
    partitions = {partition_for(b"customer-7", new_message_id(), 12) for _ in range(50)}
    assert partitions == {7}


def test_unkeyed_partition_is_the_hash_of_the_message_id() -> None:
    """An unkeyed record is placed by murmur2 of message_id.bytes, the same each time."""
    rng = random.Random(5)
    for _ in range(200):
        message_id = uuid.UUID(int=rng.getrandbits(128))
        first = partition_for(None, message_id, 12)
        assert partition_for(None, message_id, 12) == first
        assert partition_for(message_id.bytes, uuid.UUID(int=0), 12) == first


@pytest.mark.parametrize("id_kind", ["random", "uuid7"])
def test_unkeyed_records_spread_over_every_partition(id_kind: str) -> None:
    """3,000 unkeyed records give each of 3 partitions at least 800 of them."""
    rng = random.Random(11)

    def make_id() -> uuid.UUID:
        return uuid.UUID(int=rng.getrandbits(128)) if id_kind == "random" else new_message_id()

    counts = Counter(partition_for(None, make_id(), 3) for _ in range(3_000))
    assert set(counts) == {0, 1, 2}
    assert min(counts.values()) >= 800, counts


@pytest.mark.parametrize("partition_count", [0, -1])
def test_partition_count_below_one_is_refused(partition_count: int) -> None:
    """A partition count of zero or less raises ValueError."""
    with pytest.raises(ValueError, match="at least one partition"):
        partition_for(b"k", uuid.UUID(int=0), partition_count)
