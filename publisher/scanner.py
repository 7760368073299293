"""Reading a topic partition back, to find records by their ``outbox-id`` header.

This is the evidence side of reconciliation: it answers "which of these
message ids appear in this partition between these offsets?", "which
offsets does the partition still hold?" and "may the broker remove records
from the middle of this topic, and how long does it keep a tombstone?"
(compaction).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka import errors as kafka_errors
from kafka.admin import ConfigResource, ConfigResourceType, OffsetSpec

from outbox.intent import ID_HEADER
from publisher.kafka_security import PLAINTEXT, KafkaSecurity

#: A message id as the publisher writes it into the ``outbox-id`` header
#: (``str(uuid)``: lowercase hex and hyphens), matched on the raw bytes.
_MESSAGE_ID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class ScanIncomplete(Exception):
    """The scan did not reach its end offset in time; what it read so far still counts.

    ``scan`` holds what was read from the range's start up to ``position``
    (the first offset not read), so a later scan can go on from there instead
    of reading the range again: a range longer than one scan can read is still
    read to its end, over several.
    """

    def __init__(self, message: str, scan: Scan, position: int) -> None:
        super().__init__(message)
        self.scan = scan
        self.position = position


@dataclass
class Scan:
    """What one read of a partition range found."""

    #: Offsets of the records whose ``outbox-id`` was wanted, by id.
    found: dict[str, list[int]] = field(default_factory=dict)
    #: The message id of every record (with one) whose key was wanted, by key.
    by_key: dict[bytes, set[str]] = field(default_factory=dict)
    #: How many records of each wanted key were read, with an ``outbox-id`` or not.
    key_records: dict[bytes, int] = field(default_factory=dict)
    #: Records whose ``outbox-id`` holds no message id (not UTF-8, not a UUID as
    #: the publisher writes one, empty, no value): another producer's, skipped.
    foreign_ids: int = 0

    def add(
        self,
        offset: int,
        key: bytes | None,
        headers: Iterable[tuple[str, bytes | None]],
        wanted: Collection[bytes],
        wanted_keys: Collection[bytes],
    ) -> None:
        """Take one record read into account: its id if ``wanted``, its key if wanted.

        A record's id is its last ``outbox-id`` header, the one a consumer
        reads: the publisher writes exactly one, after the message's own
        headers (which may not use the name). Any other producer may write
        anything there, so a value is checked as bytes and decoded only once
        it is known to be an id: a foreign record never stops a scan.
        """
        value: bytes | None = None
        has_id = False
        for name, v in headers:
            if name == ID_HEADER:
                has_id, value = True, v
        wanted_key = key if key is not None and key in wanted_keys else None
        if has_id:
            if value is None or _MESSAGE_ID.fullmatch(value) is None:
                self.foreign_ids += 1
            else:
                if value in wanted:
                    self.found.setdefault(value.decode(), []).append(offset)
                if wanted_key is not None:
                    self.by_key.setdefault(wanted_key, set()).add(value.decode())
        if wanted_key is not None:
            self.key_records[wanted_key] = self.key_records.get(wanted_key, 0) + 1


@dataclass(frozen=True)
class Cleanup:
    """How the broker removes a topic's records, as it describes the topic."""

    #: Its ``cleanup.policy`` values (``delete``, ``compact``).
    policy: frozenset[str]
    #: Its ``delete.retention.ms``, in seconds: how long compaction keeps a
    #: tombstone (a record with a key and no value) after it first cleans the
    #: segment that holds it. None: not described.
    tombstones_kept: float | None = None

    @property
    def compacts(self) -> bool:
        """Whether the broker compacts the topic."""
        return "compact" in self.policy


class EvidenceLost(Exception):
    """Offsets of the range were deleted (retention) before the scan read them.

    The scan cannot say what they held: a record missing from the rest of the
    range is not proven absent. ``scan`` holds what was read before, from the
    range's start up to ``position`` (the first offset not read: a range that
    ends there was read whole), and ``log_start`` is where the partition's log
    starts now.
    """

    def __init__(self, message: str, scan: Scan, log_start: int, position: int) -> None:
        super().__init__(message)
        self.scan = scan
        self.log_start = log_start
        self.position = position


class LogScanner(Protocol):
    """Read access to the Kafka log, as the reconciler needs it."""

    def partition_count(self, topic: str) -> int | None:
        """How many partitions ``topic`` has; ``None`` if the topic does not exist."""
        ...

    def offset_range(
        self, topic: str, partition: int, *, committed: bool = False
    ) -> tuple[int, int]:
        """The partition's log start offset and its end offset (next offset to be written).

        With ``committed``, the end is the last stable offset: below it, no
        transaction is still open.
        """
        ...

    def find(
        self,
        topic: str,
        partition: int,
        start: int,
        end: int,
        ids: Collection[str],
        *,
        keys: Collection[bytes] = (),
        progress: Callable[[], None] = lambda: None,
    ) -> Scan:
        """Read ``[start, end)`` once, for records of ``ids`` and the records of ``keys``.

        Only what a read_committed consumer reads counts: records of no
        transaction and of committed ones. A record of an aborted transaction
        was never delivered, whoever wrote it (an earlier attempt of the same
        message, sent in a transaction before the delivery mode changed, or
        another producer). ``end`` must not be past the last stable offset.

        Records count as ``Scan.add`` counts them: one whose ``outbox-id``
        holds no message id is skipped, never an error. Raises
        ``EvidenceLost`` when part of the range is deleted before it is read,
        and ``ScanIncomplete`` (with what was read, and up to where) when the
        end is not reached in time.
        """
        ...

    def cleanup(self, topic: str) -> Cleanup | None:
        """The topic's ``cleanup.policy`` and ``delete.retention.ms``; ``None`` if the
        broker did not say.

        Compaction removes a record from the middle of the log once a later
        record has the same key, so a record missing from such a topic may
        have been written and removed; and it removes a tombstone too, once
        ``delete.retention.ms`` has passed.
        """
        ...

    def close(self) -> None:
        """Release connections."""
        ...


class _AdminClient(KafkaAdminClient):  # type: ignore[misc]  # kafka-python is untyped
    """A ``KafkaAdminClient`` that stops its IO thread when it cannot bootstrap.

    kafka-python 3.0 starts the thread, then bootstraps; if that fails, the
    thread runs on and ``close()`` does nothing (the client never counted as
    open): one thread per failed attempt, for every pass of an outage.
    """

    def __init__(self, **config: Any) -> None:
        try:
            super().__init__(**config)
        except BaseException:
            self._closed = False  # what close() takes for a client that opened
            with contextlib.suppress(Exception):  # parts that were never built
                self.close()
            raise


#: How long one offset lookup may go on retrying retriable answers (a leader
#: moving or being elected takes well under a second; Kafka away takes longer).
OFFSET_LOOKUP_SECONDS = 15.0


class KafkaLogScanner:
    """Scans with a kafka-python consumer that belongs to no group and commits nothing."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        timeout_seconds: float = 60.0,
        security: KafkaSecurity = PLAINTEXT,
    ) -> None:
        self._bootstrap_servers = bootstrap_servers
        self._security = security
        self._timeout = timeout_seconds
        #: Opened on first use: it reads the scans and answers topic metadata;
        #: offsets are asked through the admin client (``offset_range``).
        self._reader: KafkaConsumer | None = None
        self._admin: KafkaAdminClient | None = None

    @property
    def _consumer(self) -> KafkaConsumer:
        """The read_committed consumer, connected on first use.

        So a publisher starts while Kafka is away; its reconciliation passes
        are postponed until Kafka answers.
        """
        if self._reader is None:
            self._reader = KafkaConsumer(
                bootstrap_servers=self._bootstrap_servers,
                client_id="outbox-reconciler",
                isolation_level="read_committed",
                group_id=None,
                enable_auto_commit=False,
                # Fail within seconds when the broker is away, instead of the
                # consumer's default of five minutes (and of 30 s to find a
                # broker at all); the pass is simply retried.
                request_timeout_ms=15_000,
                bootstrap_timeout_ms=15_000,
                # A position below the log start (retention deleted it while
                # the scan ran) must fail the scan. kafka-python's default
                # would jump to the end of the log and read nothing more.
                auto_offset_reset="none",
                **self._security.kafka_python(),
            )
        return self._reader

    def _admin_client(self) -> KafkaAdminClient:
        """The admin client, connected on first use (as the consumer is)."""
        if self._admin is None:
            self._admin = _AdminClient(
                bootstrap_servers=self._bootstrap_servers,
                client_id="outbox-reconciler-admin",
                request_timeout_ms=15_000,
                bootstrap_timeout_ms=15_000,
                **self._security.kafka_python(),
            )
        return self._admin

    def partition_count(self, topic: str) -> int | None:
        """Ask the broker (fresh metadata) how many partitions the topic has."""
        if topic not in self._consumer.topics():  # topics() refreshes the metadata
            return None
        partitions = self._consumer.partitions_for_topic(topic)
        return len(partitions) if partitions else None

    def offset_range(
        self, topic: str, partition: int, *, committed: bool = False
    ) -> tuple[int, int]:
        """Log start and end offsets (the last stable one, with ``committed``), as of now.

        Asked through the admin client, which looks the partition's leader up
        afresh for every request. A consumer answers from metadata cached for up
        to five minutes, and kafka-python's consumer retries a leader that
        answers "not the leader" without refreshing it (the bug Kafka's own
        client fixed as KAFKA-9535): after a leader moved between two live
        brokers, every lookup failed until the cache expired.

        A retriable answer (a new leader that cannot tell its offsets yet, a
        leader being elected) is asked again, pausing between tries, for up to
        :data:`OFFSET_LOOKUP_SECONDS`; then it is raised and the pass retries.
        A partition with no leader at all (offline) raises
        ``LeaderNotAvailableError`` at once.
        """
        tp = TopicPartition(topic, partition)
        level = "read_committed" if committed else "read_uncommitted"
        deadline = time.monotonic() + OFFSET_LOOKUP_SECONDS

        def ask(spec: OffsetSpec) -> int:
            # timeout_ms bounds the client's own NOT_LEADER retries; each request
            # is bounded by its request_timeout_ms.
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            answer = self._admin_client().list_partition_offsets(
                {tp: spec}, isolation_level=level, timeout_ms=left_ms
            )
            return int(answer[tp].offset)

        pause = 0.05
        while True:
            try:
                return ask(OffsetSpec.EARLIEST), ask(OffsetSpec.LATEST)
            except kafka_errors.UnknownBrokerIdError as exc:
                if exc.args == (-1,):
                    # The admin client sends to the leader its metadata names, and
                    # -1 names none: every replica in sync is down. Not retried.
                    raise kafka_errors.LeaderNotAvailableError(
                        f"{topic}[{partition}] has no leader (its in-sync replicas are all down)"
                    ) from exc
                # A leader on a broker the client's list of brokers lacks (it
                # was down at the list's last refresh, up to five minutes ago):
                # a new client starts from fresh metadata.
                self._close_admin()
                if time.monotonic() + pause > deadline:
                    raise
            except kafka_errors.KafkaError as exc:
                if not exc.retriable or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def find(
        self,
        topic: str,
        partition: int,
        start: int,
        end: int,
        ids: Collection[str],
        *,
        keys: Collection[bytes] = (),
        progress: Callable[[], None] = lambda: None,
    ) -> Scan:
        """Read ``[start, end)`` once, read_committed: the offsets of wanted ids, the ids
        of wanted keys."""
        wanted = {i.encode() for i in ids}
        wanted_keys = set(keys)
        scan = Scan()
        if start >= end or not wanted:
            return scan
        consumer = self._consumer
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, start)
        deadline = time.monotonic() + self._timeout
        while (position := consumer.position(tp)) < end:
            if time.monotonic() > deadline:
                raise ScanIncomplete(
                    f"{topic}[{partition}] read up to {position} of "
                    f"[{start}, {end}) in {self._timeout:g}s",
                    scan,
                    position,
                )
            try:
                polled = consumer.poll(timeout_ms=500)
            except kafka_errors.OffsetOutOfRangeError as exc:
                log_start, _ = self.offset_range(topic, partition)
                raise EvidenceLost(
                    f"offsets of {topic}[{partition}] from {position} to {log_start} were "
                    f"deleted before the scan of [{start}, {end}) read them ({exc})",
                    scan,
                    log_start,
                    position,
                ) from exc
            for records in polled.values():
                for record in records:
                    if record.offset >= end:
                        break
                    scan.add(record.offset, record.key, record.headers or (), wanted, wanted_keys)
            progress()  # a long read is a loop that moves, not one that is stuck
        return scan

    def cleanup(self, topic: str) -> Cleanup | None:
        """Read the topic's cleanup settings from the broker (they can change at any time)."""
        names = ("cleanup.policy", "delete.retention.ms")
        resource = ConfigResource(ConfigResourceType.TOPIC, topic, dict.fromkeys(names))
        described = self._admin_client().describe_configs([resource], config_filter="all")
        entries = described.get("topic", {}).get(topic, {})
        policy, kept = (entries.get(name, {}).get("value") for name in names)
        if policy is None:
            # Not described: the topic is gone, or this client may not read
            # its configs (kafka-python drops the error code).
            return None
        try:
            tombstones_kept = int(kept) / 1000 if kept is not None else None
        except ValueError:
            tombstones_kept = None
        return Cleanup(
            frozenset(value.strip() for value in str(policy).split(",")), tombstones_kept
        )

    def close(self) -> None:
        """Close the consumer and the admin client, if they were ever opened."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._close_admin()

    def _close_admin(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None
