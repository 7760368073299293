"""Helpers for tests against the real services: topics, consuming, waiting."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import (
    ACL,
    ACLOperation,
    ACLPermissionType,
    ACLResourcePatternType,
    NewPartitions,
    NewTopic,
    ResourcePattern,
    ResourceType,
)
from kafka.errors import KafkaError
from psycopg.rows import dict_row

from outbox.states import ABSENCE_GRACE_SECONDS, State
from publisher.config import DELIVERY_MODES as _DELIVERY_MODES
from publisher.config import PublisherConfig
from publisher.outcomes import AttemptOutcome
from publisher.partitioning import partition_for
from publisher.store import ClaimedMessage, PublisherStore, Settlement, claim_statement
from publisher.testing import config_for_tests
from publisher.testing import publish_until_idle as publish_until_idle  # noqa: PLC0414 - re-exported

T = TypeVar("T")

#: The publisher's two producers, for tests that run with each (its ``sink``
#: setting); the confluent one only where its extra is installed.
SINKS = [
    "kafka-python",
    pytest.param(
        "confluent",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("confluent_kafka") is None,
            reason="the confluent extra is not installed",
        ),
    ),
]

#: The publisher's two delivery modes (its ``delivery`` setting), for tests
#: whose claim holds in both.
DELIVERY_MODES: list[str] = list(_DELIVERY_MODES)

#: An absence grace no test waits out. A transactional message that a test
#: sees decided under it was decided without the grace, as it must be.
LONG_ABSENCE_GRACE = 3600.0


def reads_committed(delivery: str) -> bool:
    """Whether a test's consumer reads ``read_committed`` in ``delivery``.

    A transactional publisher promises exactly once only to such consumers;
    in idempotent delivery the consumer reads as the default clients do.
    """
    return delivery == "transactional"


def delivery_flags(delivery: str) -> tuple[str, ...]:
    """``outbox-publisher`` flags for ``delivery``: transactional delivery also gets an
    absence grace of an hour, so that every decision a test sees was made without it."""
    if delivery == "transactional":
        return ("--delivery", delivery, "--absence-grace", f"{LONG_ABSENCE_GRACE:g}")
    return ("--delivery", delivery)


def assert_excerpt_of_file(code: str, base: Path) -> None:
    """A doc's code block that starts ``# <file>`` (relative to ``base``) shows parts of
    that file verbatim, each part between lines ``...``."""
    first, _, rest = code.partition("\n")
    assert first.startswith("# "), f"an excerpt must start with '# <file>': {first!r}"
    source = (base / first[2:]).read_text(encoding="utf-8")
    for part in re.split(r"^\.\.\.\n", rest, flags=re.M):
        assert part.strip() in source, f"not in {first[2:]}:\n{part}"


def waiting_on_lock(database_url: str, application_name: str) -> bool:
    """Whether the session with ``application_name`` is waiting for a lock now."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE application_name = %s",
            (application_name,),
        ).fetchone()
    return row is not None and row[0] == "Lock"


def wait_until(
    condition: Callable[[], T], *, timeout: float, interval: float = 0.05, what: str = "condition"
) -> T:
    """Return the first truthy value of ``condition()``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def submit_until_waiting(
    pool: ThreadPoolExecutor,
    database_url: str,
    application_name: str,
    what: str,
    call: Callable[..., T],
    *args: object,
    **kwargs: object,
) -> Future[T]:
    """``call(*args, **kwargs)`` started in ``pool``, returned once the session named
    ``application_name`` (the one ``call`` uses) waits for a lock; ``what`` names that wait
    in the failure."""
    started = pool.submit(call, *args, **kwargs)
    wait_until(lambda: waiting_on_lock(database_url, application_name), timeout=10, what=what)
    assert not started.done()
    return started


def create_topic(
    bootstrap: str,
    name: str,
    partitions: int = 3,
    configs: dict[str, str] | None = None,
    *,
    replication_factor: int = 1,
) -> None:
    """Create a topic (with topic ``configs``) and wait until its partitions have leaders."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-tests")
    try:
        admin.create_topics(
            [
                NewTopic(
                    name,
                    num_partitions=partitions,
                    replication_factor=replication_factor,
                    topic_configs=configs or {},
                )
            ]
        )
    finally:
        admin.close()
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        wait_until(
            lambda: consumer.partitions_for_topic(name), timeout=30, what=f"topic {name} metadata"
        )
    finally:
        consumer.close()


def grow_topic(bootstrap: str, name: str, partitions: int) -> None:
    """Give ``name`` ``partitions`` partitions in all; wait until the broker lists them."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-tests")
    try:
        admin.create_partitions({name: NewPartitions(total_count=partitions)})
    finally:
        admin.close()
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        wait_until(
            lambda: (
                consumer.topics()  # refreshes the metadata
                and len(consumer.partitions_for_topic(name) or ()) == partitions
            ),
            timeout=30,
            what=f"topic {name} with {partitions} partitions",
        )
    finally:
        consumer.close()


def small_topic(bootstrap: str) -> str:
    """A new topic whose broker-side limit is 2,000 bytes per record batch."""
    name = f"outbox-small-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-tests")
    try:
        admin.create_topics([NewTopic(name, 1, 1, topic_configs={"max.message.bytes": "2000"})])
    finally:
        admin.close()
    return name


@dataclass(frozen=True)
class ConsumedRecord:
    """A record read back from Kafka, headers as a dict of lists."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]

    def header(self, name: str) -> bytes | None:
        """The last value of header ``name``, or ``None``."""
        values = [v for k, v in self.headers if k == name]
        return values[-1] if values else None

    @property
    def outbox_id(self) -> uuid.UUID:
        """The message id the publisher put in the ``outbox-id`` header."""
        value = self.header("outbox-id")
        assert value is not None, "record without an outbox-id header"
        return uuid.UUID(value.decode())


def read_topic(
    bootstrap: str, topic: str, *, timeout: float = 10.0, committed: bool = False
) -> list[ConsumedRecord]:
    """Read every record of ``topic`` from the start to the current end offsets.

    With ``committed``, as a read_committed consumer does (records of aborted
    transactions are skipped), up to the last stable offsets.
    """
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        group_id=None,
        isolation_level="read_committed" if committed else "read_uncommitted",
    )
    try:
        partitions = wait_until(
            lambda: consumer.partitions_for_topic(topic),
            timeout=timeout,
            what=f"topic {topic} metadata",
        )
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        records: list[ConsumedRecord] = []
        deadline = time.monotonic() + timeout
        while any(consumer.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out reading {topic} up to {end}")
            for batch in consumer.poll(timeout_ms=200).values():
                records.extend(
                    ConsumedRecord(r.partition, r.offset, r.key, r.value, list(r.headers))
                    for r in batch
                )
        return records
    finally:
        consumer.close()


def fast_publisher_flags(batch_size: int) -> tuple[str, ...]:
    """``outbox-publisher`` flags with short timeouts, so that leases expire and
    write deadlines pass within seconds in crash and outage tests."""
    return (
        "--batch-size", str(batch_size),
        "--delivery-timeout-ms", "3000",
        "--request-timeout-ms", "1000",
        "--max-block-ms", "2000",
        "--lease-seconds", "5",
        "--heartbeat-interval", "1",
        "--recovery-interval", "0.5",
        "--reconcile-interval", "0.5",
        "--absence-grace", "0",
        "--poll-interval", "0.5",
    )  # fmt: skip


def assert_each_delivered_once(
    database_url: str, kafka_bootstrap: str, topic: str, ids: Collection[uuid.UUID]
) -> None:
    """Every message of ``ids`` is in ``topic`` exactly once, at the location stored for it."""
    assert_each_read_once(database_url, kafka_bootstrap, topic, ids, committed=False)


def assert_each_read_once(
    database_url: str,
    kafka_bootstrap: str,
    topic: str,
    ids: Collection[uuid.UUID],
    *,
    committed: bool,
) -> None:
    """A consumer (``read_committed`` with ``committed``) reads every message of ``ids``
    from ``topic`` exactly once, at the location stored for it."""
    records = read_topic(kafka_bootstrap, topic, committed=committed)
    copies = Counter(r.outbox_id for r in records)
    assert set(copies) == set(ids)
    assert max(copies.values()) == 1, [i for i, n in copies.items() if n > 1]
    with psycopg.connect(database_url) as conn:
        stored = {
            mid: (p, o)
            for mid, p, o in conn.execute(
                "SELECT id, kafka_partition, kafka_offset FROM outbox.messages "
                "WHERE state = 'delivered'"
            )
        }
    assert {r.outbox_id: (r.partition, r.offset) for r in records} == stored


def publisher_config(database_url: str, kafka_bootstrap: str, **overrides: Any) -> PublisherConfig:
    """A publisher config for tests: small polls, exits when idle, no absence grace."""
    return config_for_tests(database_url, kafka_bootstrap, **overrides)


def count_by_state(database_url: str) -> dict[str, int]:
    """Message counts by state, in flight derived from open batches (empty states left out)."""
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT state, count(*) FROM outbox.message_status GROUP BY state"
        ).fetchall()
    return dict(rows)


def status_line(database_url: str, state: str) -> dict[str, Any]:
    """The line of the view ``outbox.status`` for ``state`` over all topics, by column."""
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        row = conn.execute(
            "SELECT * FROM outbox.status WHERE topic IS NULL AND state = %s", (state,)
        ).fetchone()
    assert row is not None, f"no status line for {state!r}"
    return row


def fault_env(*, crash_at: str | None = None, pause_at: str | None = None) -> dict[str, str]:
    """The environment of a publisher that crashes or pauses at a cut (publisher/faults.py):
    the switch, and ``OUTBOX_ENABLE_FAULTS=1``, without which a publisher ignores it."""
    env = {"OUTBOX_ENABLE_FAULTS": "1"}
    if crash_at is not None:
        env["OUTBOX_CRASH_AT"] = crash_at
    if pause_at is not None:
        env["OUTBOX_PAUSE_AT"] = pause_at
    return env


def start_publisher(
    database_url: str, kafka_bootstrap: str, *flags: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Start the installed ``outbox-publisher`` script as a separate process.

    Its HTTP endpoints are off (``OUTBOX_HTTP_PORT=0``) unless a flag or
    ``env`` says otherwise: publishers of concurrent tests would all want the
    default port.
    """
    command, environment = _publisher_command(database_url, kafka_bootstrap, flags, env)
    return subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _publisher_command(
    database_url: str, kafka_bootstrap: str, flags: Sequence[str], env: dict[str, str] | None
) -> tuple[list[str], dict[str, str]]:
    """The installed ``outbox-publisher`` script with ``flags``, and its environment."""
    script = shutil.which("outbox-publisher", path=str(Path(sys.executable).parent))
    assert script is not None, "outbox-publisher is not installed next to this Python"
    environment = {
        **os.environ,
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "OUTBOX_HTTP_PORT": "0",
        **(env or {}),
    }
    return [script, *flags], environment


def stop_process(process: subprocess.Popen[str], sig: signal.Signals, *, timeout: float) -> str:
    """Send ``sig``, wait for the exit and return stderr; kill the process if it hangs."""
    try:
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return stderr


class DrainedPublisher:
    """An ``outbox-publisher`` process (``start_publisher``) whose output is read as it
    comes.

    A publisher that logs more than a pipe holds (64 KiB: an outage's
    connection errors, a line per message decided) blocks on its next log
    line until someone reads, and its loop stops turning. Reading its
    stdout and stderr in background threads keeps a long run from waiting
    on the test.
    """

    def __init__(
        self,
        database_url: str,
        kafka_bootstrap: str,
        *flags: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.process = start_publisher(database_url, kafka_bootstrap, *flags, env=env)
        self._stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.process.stdout, []), (self.process.stderr, self._stderr))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    @property
    def returncode(self) -> int | None:
        """The exit code, once the process has exited."""
        return self.process.returncode

    def stderr_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines the process wrote to stderr so far (for a failure's message)."""
        return "".join(self._stderr[-lines:])

    def stop(self, sig: signal.Signals, *, timeout: float) -> str:
        """Send ``sig``, wait for the exit and return stderr; kill the process if it hangs."""
        try:
            self.process.send_signal(sig)
            self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            for reader in self._readers:
                reader.join(timeout=10)
        return "".join(self._stderr)


SERVICES = Path(__file__).resolve().parent.parent / "services"


def local_service(action: str, name: str) -> None:
    """``services/<action> <name>``: stop or start one local service (``postgres``, ``kafka``)."""
    subprocess.run([str(SERVICES / action), name], check=True, timeout=180, capture_output=True)


def deny(
    bootstrap: str,
    resource: ResourceType,
    name: str,
    operation: ACLOperation,
    pattern: ACLResourcePatternType = ACLResourcePatternType.LITERAL,
) -> ACL:
    """Deny ``operation`` on the resource ``name`` (or, with a PREFIXED ``pattern``, every
    resource whose name starts with it) to the tests' (anonymous) client with an ACL, once
    the broker enforces it. The broker runs ``allow.everyone.if.no.acl.found``: every
    other resource stays open."""
    acl = ACL(
        principal="User:ANONYMOUS",
        host="*",
        operation=operation,
        permission_type=ACLPermissionType.DENY,
        resource_pattern=ResourcePattern(resource, name, pattern),
    )
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-tests")
    try:
        result = admin.create_acls([acl])
        assert not result["failed"], result
        wait_until(lambda: admin.describe_acls(acl)[0], timeout=10, what="the ACL")
    finally:
        admin.close()
    return acl


def allow_again(bootstrap: str, acl: ACL) -> None:
    """Delete an ACL ``deny`` created, once the broker no longer shows it."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-tests")
    try:
        admin.delete_acls([acl])
        wait_until(lambda: not admin.describe_acls(acl)[0], timeout=10, what="the ACL gone")
    finally:
        admin.close()


def local_services_running() -> bool:
    """Whether the services in use are the ones ``services/up`` started from this checkout."""
    state = SERVICES.parent / ".services"
    return (state / "kafka" / "broker.pid").exists() and (state / "postgres" / "data").exists()


def broker_answers(bootstrap: str) -> bool:
    """Whether the broker answers a metadata request now."""
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=bootstrap, client_id="outbox-tests", request_timeout_ms=2000
        )
    except KafkaError:
        return False
    try:
        admin.list_topics()
    except KafkaError:
        return False
    finally:
        admin.close()
    return True


def start_broker_again(bootstrap: str) -> None:
    """Start the local Kafka (``services/up kafka``) and wait until it answers at ``bootstrap``."""
    local_service("up", "kafka")
    wait_until(lambda: broker_answers(bootstrap), timeout=90, interval=0.5, what="Kafka to answer")


# --- uncertain messages and their records, for recovery and reconciliation tests ---


#: A write deadline long enough ago that an operator may decide an uncertain message at
#: once: before the absence grace that follows it ``resolve --pending`` is refused.
DEADLINE_LONG_PAST = -ABSENCE_GRACE_SECONDS - 1.0


def make_uncertain(
    database_url: str, *, partitions: int = 3, write_deadline_seconds: float = DEADLINE_LONG_PAST
) -> dict[uuid.UUID, int]:
    """Claim every pending message and settle it ``uncertain`` after sending began.

    This is what a publisher records when its send timed out: the batch was
    marked as sending (with its confirmed-offset snapshot and a write deadline
    ``write_deadline_seconds`` away: by default long past), then every message
    was settled uncertain with the partition chosen for it. Returns each
    message's id and partition.
    """
    return _make_uncertain(database_url, partitions, write_deadline_seconds, None)


def make_uncertain_in_transaction(
    database_url: str,
    transactional_id: str,
    *,
    partitions: int = 3,
    write_deadline_seconds: float = DEADLINE_LONG_PAST,
) -> dict[uuid.UUID, int]:
    """``make_uncertain``, as a transactional publisher records it: the batch was sent
    under ``transactional_id`` and its transaction's end is unknown."""
    return _make_uncertain(database_url, partitions, write_deadline_seconds, transactional_id)


def _make_uncertain(
    database_url: str,
    partitions: int,
    write_deadline_seconds: float,
    transactional_id: str | None,
) -> dict[uuid.UUID, int]:
    store = claiming_store(database_url)
    try:
        batch = store.claim(1000, lease_seconds=30)
        assert batch is not None, "nothing pending to make uncertain"
        counts = {m.topic: partitions for m in batch.messages}
        held = store.mark_sending(
            batch,
            counts,
            write_deadline_seconds=write_deadline_seconds,
            transactional_id=transactional_id,
        )
        assert held == {m.id for m in batch.messages}
        chosen = {m.id: partition_for(m.key, m.id, partitions) for m in batch.messages}
        settled = store.settle(
            batch,
            [
                Settlement(
                    m.id,
                    m.fence,
                    State.UNCERTAIN,
                    AttemptOutcome.UNCERTAIN,
                    partition=chosen[m.id],
                    error="KafkaTimeoutError: Expiring 1 record(s)",
                )
                for m in batch.messages
            ],
        )
        assert settled == held
    finally:
        store.close()
    return chosen


def send_record(
    bootstrap: str,
    topic: str,
    partition: int,
    message_id: uuid.UUID,
    value: bytes = b"x",
    *,
    key: bytes | None = None,
) -> int:
    """Write one record carrying ``message_id`` in its ``outbox-id`` header; return its offset."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        future = producer.send(
            topic,
            value=value,
            key=key,
            partition=partition,
            headers=[("outbox-id", str(message_id).encode())],
        )
        producer.flush(timeout=30)
        return int(future.get(timeout=30).offset)
    finally:
        producer.close()


def send_raw(
    bootstrap: str,
    topic: str,
    partition: int,
    records: Sequence[tuple[bytes | None, list[tuple[str, bytes]]]],
) -> list[int]:
    """Write records with exactly these keys and headers, as another producer would; return
    their offsets."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        futures = [
            producer.send(topic, value=b"foreign", key=key, partition=partition, headers=headers)
            for key, headers in records
        ]
        producer.flush(timeout=30)
        return [int(f.get(timeout=30).offset) for f in futures]
    finally:
        producer.close()


class TransactionalSession:
    """A producer session under a transactional.id, as a transactional publisher opens one.

    ``send`` writes records carrying a message id in their ``outbox-id``
    header inside the session's open transaction (begun on the first send);
    ``commit`` commits it. A transaction left open is what a publisher that
    died or froze mid-batch leaves behind: a fence aborts it.
    """

    def __init__(self, bootstrap: str, transactional_id: str) -> None:
        self.transactional_id = transactional_id
        self._producer = KafkaProducer(
            bootstrap_servers=bootstrap,
            transactional_id=transactional_id,
            enable_idempotence=True,
            acks="all",
        )
        self._producer.init_transactions()
        self._open = False

    def send(
        self,
        topic: str,
        partition: int,
        message_id: uuid.UUID,
        value: bytes = b"x",
        *,
        key: bytes | None = None,
    ) -> int:
        """Write one record in the open transaction; return its offset (not yet committed)."""
        if not self._open:
            self._producer.begin_transaction()
            self._open = True
        future = self._producer.send(
            topic,
            value=value,
            key=key,
            partition=partition,
            headers=[("outbox-id", str(message_id).encode())],
        )
        self._producer.flush(timeout=30)
        return int(future.get(timeout=30).offset)

    def commit(self) -> None:
        """Commit the open transaction."""
        assert self._open, "no transaction is open"
        self._producer.commit_transaction()
        self._open = False

    def abort(self) -> None:
        """Abort the open transaction."""
        assert self._open, "no transaction is open"
        self._producer.abort_transaction()
        self._open = False

    def close(self) -> None:
        """Close the producer (after the test is done with a transaction it left open)."""
        self._producer.close(timeout=5)


def send_committed(
    bootstrap: str,
    transactional_id: str,
    topic: str,
    partition: int,
    message_id: uuid.UUID,
    *,
    key: bytes | None = None,
) -> int:
    """Write one record carrying ``message_id`` in a committed transaction under
    ``transactional_id``; return its offset."""
    session = TransactionalSession(bootstrap, transactional_id)
    try:
        offset = session.send(topic, partition, message_id, key=key)
        session.commit()
    finally:
        session.close()
    return offset


def delete_topic(bootstrap: str, topic: str) -> None:
    """Delete ``topic`` and wait until the broker no longer lists it.

    Only the full topic listing is polled: the broker creates topics on
    demand, and asking for this topic's metadata would bring it back.
    """
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-tests")
    try:
        admin.delete_topics([topic])
    finally:
        admin.close()
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        wait_until(
            lambda: topic not in consumer.topics(), timeout=30, what=f"topic {topic} deleted"
        )
    finally:
        consumer.close()


class ClaimingStore(PublisherStore):
    """A PublisherStore that owns every lane while it is open.

    Claims only see the claiming publisher's lanes; tests that drive the store
    by hand (no heartbeat, no lane keeper) take all of them over, and give
    them back on ``close()`` so that a real publisher can take them next.
    """

    def take_all_lanes(self) -> None:
        """Own every lane, whoever held it."""
        with psycopg.connect(self.conninfo) as conn:
            conn.execute(
                "UPDATE outbox.lanes SET owner = %s, "
                "lease_expires_at = now() + interval '1 hour', fence = fence + 1",
                (self.publisher_id,),
            )

    def close(self) -> None:
        """Give the lanes back, then close."""
        with psycopg.connect(self.conninfo) as conn:
            conn.execute(
                "UPDATE outbox.lanes SET owner = NULL, lease_expires_at = NULL WHERE owner = %s",
                (self.publisher_id,),
            )
        super().close()


def plan_rows_read(node: dict[str, Any]) -> int:
    """Rows the plan node and its children read from outbox.messages, over all their loops
    (a node of ``EXPLAIN (ANALYZE, FORMAT JSON)``)."""
    read = 0
    if node.get("Relation Name") == "messages":
        per_loop = (
            node.get("Actual Rows", 0)
            + node.get("Rows Removed by Filter", 0)
            + node.get("Rows Removed by Index Recheck", 0)
        )
        read += int(per_loop * node.get("Actual Loops", 1))
    for child in node.get("Plans", []):
        read += plan_rows_read(child)
    return read


def claim_rows_read(store: PublisherStore, *, ahead: bool = False) -> int:
    """Rows of outbox.messages the store's claim of up to 500 reads (``ahead``: made ahead,
    with a horizon of 1,000), the claim rolled back.

    The claim takes no parameters: the plan EXPLAIN shows is the one the
    store prepares and reuses (test_the_store_plans_its_claim_once).
    """
    sql = claim_statement(
        owner=store.publisher_id,
        lease_seconds=30.0,
        limit=500,
        horizon=1_000 if ahead else None,
    )
    with store.conn.transaction():
        [(plan,)] = store.conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql).fetchall()
        raise psycopg.Rollback
    return plan_rows_read(plan[0]["Plan"])


def failed_for_retry(
    message: ClaimedMessage, *, retry_after: float, error: str, send_began: bool = True
) -> Settlement:
    """What a publisher settles for a send Kafka did not take: pending again after
    ``retry_after`` seconds, the failure counted toward ``--max-attempts``."""
    return Settlement(
        message.id,
        message.fence,
        State.PENDING,
        AttemptOutcome.FAILED,
        retry_after=retry_after,
        error=error,
        send_began=send_began,
        counts_as_failure=True,
    )


def claiming_store(database_url: str) -> ClaimingStore:
    """A store that owns every lane until it is closed (see ``ClaimingStore``)."""
    store = ClaimingStore(database_url, uuid.uuid4())
    store.take_all_lanes()
    return store


def run_outbox_cli(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``outbox --database-url URL ARGS...`` as a separate process."""
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", "--database-url", database_url, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def fetch_rows(database_url: str, sql: str, *params: object) -> list[tuple[Any, ...]]:
    """Run one query on its own connection and return every row."""
    with psycopg.connect(database_url) as conn:
        return conn.execute(sql, params).fetchall()


# --- long runs: publishers whose output goes to a file, frozen and woken ---


def start_logged_publisher(
    database_url: str,
    kafka_bootstrap: str,
    *flags: str,
    log: Path,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``outbox-publisher`` as ``start_publisher`` does, its output going to ``log``.

    A run of minutes fills a pipe nobody reads, and a publisher blocked on
    writing its log looks frozen: a file never blocks it.
    """
    command, environment = _publisher_command(database_url, kafka_bootstrap, flags, env)
    with log.open("ab") as output:
        return subprocess.Popen(
            command,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )


def is_frozen(pid: int) -> bool:
    """Whether the process is stopped by a signal (SIGSTOP: state T in /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def stop_and_wait(
    process: subprocess.Popen[bytes], sig: signal.Signals, *, timeout: float
) -> int | None:
    """Wake the process if frozen, send ``sig`` and wait for its exit; kill it if it hangs.

    Returns its exit code, or ``None`` when it had to be killed.
    """
    if process.poll() is not None:
        return process.returncode
    process.send_signal(signal.SIGCONT)
    process.send_signal(sig)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


#: A CA certificate (self-signed, its key thrown away): a CA file that loads.
CA_PEM = """\
-----BEGIN CERTIFICATE-----
MIIBwTCCAWegAwIBAgIUEzaSmjqk+egOnvGmaNa2f71AucYwCgYIKoZIzj0EAwIw
NTEzMDEGA1UEAwwqb3V0Ym94IHVuaXQtdGVzdCBDQSAobm90IHRydXN0ZWQgYW55
d2hlcmUpMCAXDTI2MTIwMzIwNTk1MFoYDzIxMjYxMTA5MjA1OTUwWjA1MTMwMQYD
VQQDDCpvdXRib3ggdW5pdC10ZXN0IENBIChub3QgdHJ1c3RlZCBhbnl3aGVyZSkw
WTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAATr7C6f4lBGZxU+WLEt8EJcZOI8ZaCV
39Hkef2qBRVy+fbbJenBfMcLiz+sD1/+wpMKS6m0wyw1WTXLmisqlUGco1MwUTAd
BgNVHQ4EFgQUbQgQv0d/SCATDlKRIkTrelAtde4wHwYDVR0jBBgwFoAUbQgQv0d/
SCATDlKRIkTrelAtde4wDwYDVR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNIADBF
AiBw8clN75qCr2abzZ0mt2wrr0gjjibf0MSIrZ2EVeSZ6gIhAPqu+3k8Ru0snnNY
1IbhqXMlL/HEhbsHm6ZrmG2hu73U
-----END CERTIFICATE-----
"""
