"""Choosing a record's partition before it is sent.

The partition is decided here, stored with the message and passed to the
producer explicitly, so that a record whose fate is unknown can be looked
for in exactly one partition later.
"""

from __future__ import annotations

import functools
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
    if key is not None and len(key) <= _CACHED_KEY_BYTES:
        return _keyed(key, partition_count)
    if key is not None:
        return (int(murmur2(key)) & 0x7FFFFFFF) % partition_count
    return (int(murmur2(message_id.bytes)) & 0x7FFFFFFF) % partition_count


#: Longer keys are hashed every time, so the cache stays small (at most 16 MiB of keys).
_CACHED_KEY_BYTES = 256


@functools.lru_cache(maxsize=65_536)
def _keyed(key: bytes, partition_count: int) -> int:
    """murmur2 is pure Python in kafka-python; keys recur, so their partitions are kept."""
    return (int(murmur2(key)) & 0x7FFFFFFF) % partition_count
