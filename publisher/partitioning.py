"""Choosing a record's partition before it is sent.

The partition is decided here, stored with the message and passed to the
producer explicitly, so that a record whose fate is unknown can be looked
for in exactly one partition later.
"""

from __future__ import annotations

import uuid

from kafka.partitioner.default import murmur2


def partition_for(key: bytes | None, message_id: uuid.UUID, partition_count: int) -> int:
    """Return the partition of a record among ``partition_count`` partitions.

    Keyed records use Kafka's default partitioner (murmur2 of the key, the same
    as the Java client), so that every producer of a topic agrees on where a
    key lives. Unkeyed records use murmur2 of the message id: deterministic,
    and spread evenly over the partitions.
    """
    if partition_count <= 0:
        raise ValueError(f"a topic has at least one partition, got {partition_count}")
    data = key if key is not None else message_id.bytes
    return (int(murmur2(data)) & 0x7FFFFFFF) % partition_count
