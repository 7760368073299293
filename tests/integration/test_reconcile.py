"""The reconciler decides uncertain messages from what the Kafka partition holds.

Most tests run in both delivery modes (the ``delivery`` fixture). In
transactional delivery the uncertain batch was sent under a transactional.id,
a record of it that was written is in a committed transaction of that
session, and the reconciler fences the session before it reads the partition
read_committed. Tests of what exists in one mode only say why.
"""

from __future__ import annotations

import re
import socket
import threading
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from kafka import KafkaAdminClient, TopicPartition
from kafka.admin import ACLOperation, ResourceType
from kafka.errors import KafkaError
from psycopg.conninfo import make_conninfo

import outbox
from outbox.inspection import list_messages, read_timeline
from outbox.operator import DecisionRefused, OutOfOrder, Resolution, discard, resolve
from outbox.render import listing_text
from outbox.states import OVERTAKEN_NOTE, WAITING_NOTE, State
from outbox.status import read_held_keys, read_status
from publisher.fencing import KafkaFencer
from publisher.outcomes import AttemptOutcome
from publisher.partitioning import partition_for
from publisher.reconciler import Reconciler, ReconcileReport, held_back_note
from publisher.scanner import KafkaLogScanner, Scan, ScanIncomplete
from publisher.store import Settlement
from tests.support import (
    DELIVERY_MODES,
    LONG_ABSENCE_GRACE,
    ClaimingStore,
    TransactionalSession,
    allow_again,
    claiming_store,
    create_topic,
    delete_topic,
    deny,
    fetch_rows,
    grow_topic,
    make_uncertain,
    make_uncertain_in_transaction,
    publish_until_idle,
    read_topic,
    reads_committed,
    send_committed,
    send_raw,
    send_record,
)

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Sent:
    """How the uncertain batch of a test was sent, in one delivery mode."""

    delivery: str
    bootstrap: str
    #: The producer session's transactional.id (transactional delivery), else None.
    transactional_id: str | None

    @property
    def committed(self) -> bool:
        """Whether consumers of this mode read read_committed."""
        return reads_committed(self.delivery)

    def make_uncertain(
        self, database_url: str, *, partitions: int = 3, write_deadline_seconds: float = 0.0
    ) -> dict[uuid.UUID, int]:
        """Every pending message sent in a batch of this mode and settled uncertain."""
        if self.transactional_id is None:
            return make_uncertain(
                database_url, partitions=partitions, write_deadline_seconds=write_deadline_seconds
            )
        return make_uncertain_in_transaction(
            database_url,
            self.transactional_id,
            partitions=partitions,
            write_deadline_seconds=write_deadline_seconds,
        )

    def write(
        self, topic: str, partition: int, message_id: uuid.UUID, *, key: bytes | None = None
    ) -> int:
        """The message's record as its batch wrote it (in a committed transaction of the
        session, in transactional delivery); its offset."""
        if self.transactional_id is None:
            return send_record(self.bootstrap, topic, partition, message_id, key=key)
        return send_committed(
            self.bootstrap, self.transactional_id, topic, partition, message_id, key=key
        )

    def end_after(self, offset: int) -> int:
        """The partition's end offset once ``write`` put a record at ``offset``: in a
        transaction, its commit marker takes the next offset."""
        return offset + (2 if self.transactional_id is not None else 1)


@pytest.fixture(params=DELIVERY_MODES)
def sent(request: pytest.FixtureRequest, kafka_bootstrap: str) -> Sent:
    """The test's uncertain batch, sent in each delivery mode in turn."""
    delivery: str = request.param
    transactional_id = f"outbox-{uuid.uuid4()}-1" if delivery == "transactional" else None
    return Sent(delivery, kafka_bootstrap, transactional_id)


@pytest.fixture
def reconciler(database_url: str, kafka_bootstrap: str) -> Iterator[Reconciler]:
    """A reconciler with a real scanner and fencer, recording its decisions as "test"."""
    store = claiming_store(database_url)
    scanner = KafkaLogScanner(kafka_bootstrap)
    yield Reconciler(store, scanner, "test", absence_grace=0, fencer=KafkaFencer(kafka_bootstrap))
    scanner.close()
    store.close()


def _reconcile_once(
    database_url: str, scanner: KafkaLogScanner, *, absence_grace: float = 0
) -> ReconcileReport:
    """One reconciliation pass with a store of its own, ``scanner`` and a real fencer;
    the store and the scanner are closed after."""
    store = claiming_store(database_url)
    try:
        return Reconciler(
            store,
            scanner,
            "test",
            absence_grace=absence_grace,
            fencer=KafkaFencer(scanner._bootstrap_servers),
        ).run_once()
    finally:
        scanner.close()
        store.close()


def _enqueue(database_url: str, topic: str) -> uuid.UUID:
    with psycopg.connect(database_url) as conn:
        return outbox.enqueue(conn, topic, b"payload")


def _message(database_url: str, message_id: uuid.UUID) -> tuple[Any, ...]:
    [row] = fetch_rows(
        database_url,
        "SELECT state, kafka_partition, kafka_offset, escalated_at IS NOT NULL, last_error "
        "FROM outbox.message_status WHERE id = %s",
        message_id,
    )
    return row


def _decisions(database_url: str) -> list[tuple[Any, ...]]:
    return fetch_rows(
        database_url,
        "SELECT message_id, decided_by, from_state, to_state, reason, evidence "
        "FROM outbox.decisions ORDER BY id",
    )


def test_record_found_in_kafka_makes_the_message_delivered_at_its_offset(
    database_url: str, kafka_bootstrap: str, topic: str, reconciler: Reconciler, sent: Sent
) -> None:
    """An uncertain message whose record is in its partition becomes delivered at that offset."""
    message_id = _enqueue(database_url, topic)
    partition = sent.make_uncertain(database_url)[message_id]
    # Another message's record lies before it in the same partition.
    send_record(kafka_bootstrap, topic, partition, uuid.uuid4())
    offset = sent.write(topic, partition, message_id)

    report = reconciler.run_once()
    assert report.delivered == [message_id]
    assert report.pending == report.escalated == []
    state, kafka_partition, kafka_offset, escalated, last_error = _message(database_url, message_id)
    assert (state, kafka_partition, kafka_offset, escalated, last_error) == (
        "delivered",
        partition,
        offset,
        False,
        None,
    )
    [(_, decided_by, from_state, to_state, reason, evidence)] = _decisions(database_url)
    assert (decided_by, from_state, to_state) == ("test", "uncertain", "delivered")
    assert str(offset) in reason
    assert evidence["topic"] == topic
    assert evidence["partition"] == partition
    assert evidence["scan_from"] == 0
    assert evidence["scan_to"] == sent.end_after(offset)
    assert evidence["found_offsets"] == [offset]
    assert fetch_rows(
        database_url,
        "SELECT confirmed_offset FROM outbox.partition_offsets "
        "WHERE topic = %s AND kafka_partition = %s",
        topic,
        partition,
    ) == [(offset,)]

    again = reconciler.run_once()
    assert again.decided == 0
    assert len(_decisions(database_url)) == 1
    assert _message(database_url, message_id)[:3] == ("delivered", partition, offset)


def test_record_proven_absent_makes_the_message_pending_and_it_is_delivered_once(
    database_url: str, kafka_bootstrap: str, topic: str, reconciler: Reconciler, sent: Sent
) -> None:
    """An uncertain message absent from its scanned range goes pending, then arrives once.

    In transactional delivery its record was written in a transaction its
    session left open (the publisher died or froze before the commit): the
    fence aborts it, so the record is not in the committed log, and the
    session can commit nothing any more.
    """
    message_id = _enqueue(database_url, topic)
    partition = sent.make_uncertain(database_url)[message_id]
    unrelated = send_record(kafka_bootstrap, topic, partition, uuid.uuid4())
    end = unrelated + 1
    zombie = None
    if sent.transactional_id is not None:
        zombie = TransactionalSession(kafka_bootstrap, sent.transactional_id)
        end = zombie.send(topic, partition, message_id) + 2  # the record, then the abort marker

    try:
        report = reconciler.run_once()
        if zombie is not None:
            with pytest.raises(KafkaError, match="ProducerFenced"):
                zombie.commit()
    finally:
        if zombie is not None:
            zombie.close()
    assert report.pending == [message_id]
    assert report.delivered == []
    state, _, kafka_offset, escalated, last_error = _message(database_url, message_id)
    assert (state, kafka_offset, escalated) == ("pending", None, False)
    assert last_error.startswith("proven absent")
    [(_, decided_by, from_state, to_state, reason, evidence)] = _decisions(database_url)
    assert (decided_by, from_state, to_state) == ("test", "uncertain", "pending")
    assert reason == last_error
    assert evidence == {
        "topic": topic,
        "partition": partition,
        "scan_from": 0,
        "scan_to": end,
        "log_start": 0,
        "passes": 1,
        "cleanup_policy": ["delete"],
    }
    assert f"offsets [0, {end})" in reason

    totals = publish_until_idle(database_url, kafka_bootstrap, delivery=sent.delivery)
    assert totals.delivered == 1
    records = read_topic(kafka_bootstrap, topic, committed=sent.committed)
    mine = [r for r in records if r.outbox_id == message_id]
    assert len(mine) == 1
    assert _message(database_url, message_id)[:3] == (
        "delivered",
        mine[0].partition,
        mine[0].offset,
    )


def test_scan_starts_above_the_offset_confirmed_before_the_attempt(
    database_url: str, kafka_bootstrap: str, topic: str, reconciler: Reconciler, sent: Sent
) -> None:
    """A record with the message's id at or below the attempt's confirmed offset is not searched."""
    message_id = _enqueue(database_url, topic)
    partition = partition_for(None, message_id, 3)
    # This record was written, and its offset confirmed, before the attempt
    # began sending, so it cannot be the record of this attempt.
    old = sent.write(topic, partition, message_id)
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "INSERT INTO outbox.partition_offsets (topic, kafka_partition, confirmed_offset) "
            "VALUES (%s, %s, %s)",
            (topic, partition, old),
        )
    assert sent.make_uncertain(database_url) == {message_id: partition}
    [(snapshot,)] = fetch_rows(database_url, "SELECT confirmed_offsets FROM outbox.batches")
    assert snapshot == {topic: {str(partition): old}}

    report = reconciler.run_once()
    assert report.pending == [message_id]
    assert report.delivered == []
    assert _message(database_url, message_id)[0] == "pending"
    [(_, _, _, to_state, _, evidence)] = _decisions(database_url)
    assert to_state == "pending"
    assert evidence["scan_from"] == old + 1
    assert evidence["scan_to"] == sent.end_after(old)


# Idempotent delivery only: a transactional message has no write deadline to
# wait for (see test_a_transactional_message_is_decided_at_once_after_the_fence).
def test_message_before_its_write_deadline_is_not_decided(
    database_url: str, kafka_bootstrap: str, topic: str, reconciler: Reconciler
) -> None:
    """An uncertain message whose producer may still write is left undecided."""
    message_id = _enqueue(database_url, topic)
    partition = make_uncertain(database_url, write_deadline_seconds=300)[message_id]
    send_record(kafka_bootstrap, topic, partition, message_id)

    report = reconciler.run_once()
    assert report.decided == 0
    assert report.deferred == []
    assert _message(database_url, message_id)[:4] == ("uncertain", partition, None, False)
    assert _decisions(database_url) == []


def test_deleted_topic_escalates_the_message_once(
    database_url: str, kafka_bootstrap: str, topic: str, reconciler: Reconciler, sent: Sent
) -> None:
    """When the topic is gone the message stays uncertain, escalated with the reason."""
    message_id = _enqueue(database_url, topic)
    partition = sent.make_uncertain(database_url)[message_id]
    sent.write(topic, partition, message_id)
    delete_topic(kafka_bootstrap, topic)

    report = reconciler.run_once()
    assert report.escalated == [message_id]
    assert report.delivered == report.pending == []
    escalated_row = _message(database_url, message_id)
    state, _, kafka_offset, escalated, last_error = escalated_row
    assert (state, kafka_offset, escalated) == ("uncertain", None, True)
    assert last_error.startswith("evidence unavailable")
    assert "no longer exists" in last_error
    [(_, decided_by, from_state, to_state, reason, evidence)] = _decisions(database_url)
    assert (decided_by, from_state, to_state) == ("test", "uncertain", "uncertain")
    assert reason == last_error
    assert evidence["topic"] == topic

    again = reconciler.run_once()
    assert again.decided == 0
    assert len(_decisions(database_url)) == 1
    assert _message(database_url, message_id) == escalated_row


def test_deleted_records_where_the_message_could_be_escalate_instead_of_pending(
    database_url: str, kafka_bootstrap: str, topic: str, reconciler: Reconciler, sent: Sent
) -> None:
    """With no confirmed offset, records deleted below the log start escalate the message."""
    message_id = _enqueue(database_url, topic)
    partition = sent.make_uncertain(database_url)[message_id]
    [(snapshot,)] = fetch_rows(database_url, "SELECT confirmed_offsets FROM outbox.batches")
    assert snapshot == {}
    # The message's record may have been among these; they are deleted.
    sent.write(topic, partition, message_id)
    last = send_record(kafka_bootstrap, topic, partition, uuid.uuid4())
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="outbox-tests")
    try:
        admin.delete_records({TopicPartition(topic, partition): last})
    finally:
        admin.close()

    report = reconciler.run_once()
    assert report.escalated == [message_id]
    assert report.pending == report.delivered == []
    state, _, _, escalated, last_error = _message(database_url, message_id)
    assert (state, escalated) == ("uncertain", True)
    assert "were deleted" in last_error
    [(_, _, _, to_state, _, evidence)] = _decisions(database_url)
    assert to_state == "uncertain"
    assert evidence["log_start"] == last
    assert evidence["scan_to"] == last + 1


def test_scan_starts_above_the_confirmed_offset_when_sharing_a_pass(
    database_url: str, kafka_bootstrap: str, topic: str, reconciler: Reconciler, sent: Sent
) -> None:
    """A record at or below a message's confirmed offset is ignored when sharing a scan."""
    with psycopg.connect(database_url) as conn:
        first = outbox.enqueue(conn, topic, b"first", key="k")
    # The first attempt began sending with nothing confirmed: it is searched from 0.
    partition = sent.make_uncertain(database_url)[first]
    # Another key of the same partition: a later message of key "k" would be
    # held back behind the uncertain first one and never claimed.
    other = next(
        k for k in (f"k{i}" for i in range(100)) if partition_for(k.encode(), first, 3) == partition
    )
    with psycopg.connect(database_url) as conn:
        second = outbox.enqueue(conn, topic, b"second", key=other)
    old = sent.write(topic, partition, second)
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "INSERT INTO outbox.partition_offsets (topic, kafka_partition, confirmed_offset) "
            "VALUES (%s, %s, %s)",
            (topic, partition, old),
        )
    # The second attempt began sending after `old` was confirmed: searched from old + 1.
    assert sent.make_uncertain(database_url) == {second: partition}

    reconciler.run_once()
    decisions = {d[0]: d for d in _decisions(database_url)}
    assert decisions[second][5]["scan_from"] == old + 1
    assert decisions[second][3] == "pending"  # as when it is reconciled alone


def _delete_records_below(bootstrap: str, topic: str, partition: int, offset: int) -> None:
    """What retention does: the partition's log now starts at ``offset``."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="outbox-tests")
    try:
        admin.delete_records({TopicPartition(topic, partition): offset})
    finally:
        admin.close()


def test_a_topic_created_again_escalates_instead_of_proving_absence(
    database_url: str, kafka_bootstrap: str, sent: Sent
) -> None:
    """The confirmed offsets of a deleted topic's log prove nothing about its successor's."""
    topic = f"outbox-test-{uuid.uuid4().hex[:12]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(conn, [outbox.Message(topic, f"old {i}") for i in range(5)])
    publish_until_idle(database_url, kafka_bootstrap, delivery=sent.delivery)
    confirmed = "SELECT confirmed_offset FROM outbox.partition_offsets WHERE topic = %s"
    assert fetch_rows(database_url, confirmed, topic) == [(4,)]
    delete_topic(kafka_bootstrap, topic)
    create_topic(kafka_bootstrap, topic, partitions=1)
    message_id = _enqueue(database_url, topic)
    sent.make_uncertain(database_url, partitions=1)
    # Its record was written: the first of the new log.
    assert sent.write(topic, 0, message_id) == 0
    end = sent.end_after(0)
    report = _reconcile_once(database_url, KafkaLogScanner(kafka_bootstrap))

    assert report.escalated == [message_id]
    assert report.pending == report.delivered == []
    state, _, _, escalated, last_error = _message(database_url, message_id)
    assert (state, escalated) == ("uncertain", True)
    assert f"ends at offset {end}, below offset 4 confirmed before its attempt" in last_error
    [(_, _, _, to_state, _, evidence)] = _decisions(database_url)
    assert to_state == "uncertain"
    assert (evidence["confirmed_before"], evidence["log_end"]) == (4, end)
    records = read_topic(kafka_bootstrap, topic, committed=sent.committed)
    assert [r.outbox_id for r in records] == [message_id]
    delete_topic(kafka_bootstrap, topic)


class _RetentionDuringTheScan(KafkaLogScanner):
    """The real scanner, with retention deleting the partition's records just after
    the reconciler read its offsets and before the scan reads them."""

    def offset_range(
        self, topic: str, partition: int, *, committed: bool = False
    ) -> tuple[int, int]:
        log_start, end = super().offset_range(topic, partition, committed=committed)
        _delete_records_below(self._bootstrap_servers, topic, partition, end)
        return log_start, end


def test_records_deleted_while_the_scan_reads_them_escalate_instead_of_proving_absence(
    database_url: str, kafka_bootstrap: str, topic: str, sent: Sent
) -> None:
    """A scan whose range is deleted under it fails; the message is escalated, not resent."""
    message_id = _enqueue(database_url, topic)
    partition = sent.make_uncertain(database_url)[message_id]
    send_record(kafka_bootstrap, topic, partition, uuid.uuid4())
    at = sent.write(topic, partition, message_id)
    end = send_record(kafka_bootstrap, topic, partition, uuid.uuid4()) + 1
    report = _reconcile_once(
        database_url, _RetentionDuringTheScan(kafka_bootstrap, timeout_seconds=20)
    )

    assert report.escalated == [message_id]
    assert report.pending == report.delivered == []
    state, _, _, escalated, last_error = _message(database_url, message_id)
    assert (state, escalated) == ("uncertain", True)
    assert at == 1
    assert f"offsets [0, {end})" in last_error
    assert f"were deleted before the scan of [0, {end}) read them" in last_error


def test_on_a_compacted_topic_absence_is_proof_only_with_no_later_record_of_its_key(
    database_url: str, kafka_bootstrap: str, reconciler: Reconciler, sent: Sent
) -> None:
    """Compaction removes a record once a later one has its key: a missing record with
    such a later record may have been compacted away; one with none is proven absent."""
    topic = f"outbox-test-{uuid.uuid4().hex[:12]}"
    create_topic(kafka_bootstrap, topic, partitions=1, configs={"cleanup.policy": "compact"})
    with psycopg.connect(database_url) as conn:
        crowded, found, lonely = (
            outbox.enqueue(conn, topic, b"v", key=k) for k in ("crowded", "found", "lonely")
        )
    sent.make_uncertain(database_url, partitions=1)
    # Another producer's record with the crowded message's key, after it.
    send_record(kafka_bootstrap, topic, 0, uuid.uuid4(), key=b"crowded")
    at = sent.write(topic, 0, found, key=b"found")

    report = reconciler.run_once()

    assert report.escalated == [crowded]
    assert report.delivered == [found]
    assert report.pending == [lonely]
    state, _, _, escalated, last_error = _message(database_url, crowded)
    assert (state, escalated) == ("uncertain", True)
    assert "the topic is compacted and later records of its key are there" in last_error
    assert _message(database_url, found)[:3] == ("delivered", 0, at)


def test_on_a_compacted_topic_that_keeps_tombstones_briefly_no_absence_is_proof(
    database_url: str, kafka_bootstrap: str, reconciler: Reconciler, sent: Sent
) -> None:
    """A tombstone of its key written after the attempt began could have compacted its
    record away and been removed itself once the topic's delete.retention.ms passed: with
    that shorter than the time since sending began, a record missing with no record of its
    key in the range is escalated, not sent again."""
    topic = f"outbox-test-{uuid.uuid4().hex[:12]}"
    create_topic(
        kafka_bootstrap,
        topic,
        partitions=1,
        configs={"cleanup.policy": "compact", "delete.retention.ms": "1000"},
    )
    with psycopg.connect(database_url) as conn:
        lonely = outbox.enqueue(conn, topic, b"v", key="lonely")
    sent.make_uncertain(database_url, partitions=1)

    report = reconciler.run_once()

    assert report.escalated == [lonely]
    state, _, _, escalated, last_error = _message(database_url, lonely)
    assert (state, escalated) == ("uncertain", True)
    assert re.search(r"its attempt began sending \d+s ago, and tombstones are kept 1s", last_error)


# Idempotent delivery only: the records of a transactional batch are committed
# together or not at all, so one cannot be lost while a later one is written.
def test_an_absent_message_whose_key_moved_on_in_kafka_escalates_instead_of_resending(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Sent together, the first record of a key was lost and the second written: resending
    the first would put it after the second, so it is escalated, not made pending."""
    with psycopg.connect(database_url) as conn:
        first, second = outbox.enqueue_many(
            conn, [outbox.Message(topic, f"{i}", key="K") for i in range(2)]
        )
        other = outbox.enqueue(conn, topic, b"x", key="other")
    partition = partition_for(b"K", first, 3)
    store = claiming_store(database_url)
    try:
        batch = store.claim(10, lease_seconds=30)
        assert batch is not None
        store.mark_sending(batch, {topic: 3}, write_deadline_seconds=0.0)
        offset = send_record(kafka_bootstrap, topic, partition, second, key=b"K")
        fences = {m.id: m.fence for m in batch.messages}
        other_partition = partition_for(b"other", other, 3)
        store.settle(
            batch,
            [
                Settlement(
                    first,
                    fences[first],
                    State.UNCERTAIN,
                    AttemptOutcome.UNCERTAIN,
                    partition=partition,
                    error="KafkaTimeoutError: Expiring 1 record(s)",
                ),
                Settlement(
                    second,
                    fences[second],
                    State.DELIVERED,
                    AttemptOutcome.DELIVERED,
                    partition,
                    offset,
                ),
                Settlement(
                    other,
                    fences[other],
                    State.UNCERTAIN,
                    AttemptOutcome.UNCERTAIN,
                    partition=other_partition,
                    error="KafkaTimeoutError: Expiring 1 record(s)",
                ),
            ],
        )
    finally:
        store.close()
    report = _reconcile_once(database_url, KafkaLogScanner(kafka_bootstrap))

    assert report.escalated == [first]
    # A message whose key did not move on is still proven absent, as before.
    assert report.pending == [other]
    state, _, _, escalated, last_error = _message(database_url, first)
    assert (state, escalated) == ("uncertain", True)
    assert last_error.startswith(f"{OVERTAKEN_NOTE}1 (first: {second}), written after it was sent")
    [(*_, evidence)] = [d for d in _decisions(database_url) if d[0] == first]
    assert (evidence["later_of_key"], evidence["later_of_key_count"]) == ([str(second)], 1)
    # Nothing of its evidence is gone: the next action offers what fits, not --delivered.
    with psycopg.connect(database_url) as conn:
        timeline = read_timeline(conn, first)
        [line] = [s for s in read_status(conn) if s.state == "uncertain" and s.topic is None]
    assert timeline is not None
    action = timeline.next_action
    assert action.startswith("its record was never written, and later messages of its key were")
    assert "--pending" in action
    assert "--discard" in action
    assert line.next_action.startswith("1 escalated: the reconciler could not decide them")

    # An operator may send it after the second one, knowingly, or drop it; its record
    # proven absent, --delivered would lose it.
    [(fence,)] = fetch_rows(database_url, "SELECT fence FROM outbox.messages WHERE id = %s", first)
    with psycopg.connect(database_url) as conn:
        with pytest.raises(DecisionRefused, match="proved its record absent"):
            resolve(conn, first, Resolution.DELIVERED, "seen it", fence=fence)
        with pytest.raises(OutOfOrder, match=re.escape(f"{second} (delivered)")):
            resolve(conn, first, Resolution.PENDING, "resend", fence=fence)
        resolve(conn, first, Resolution.PENDING, "resend it", fence=fence, out_of_order=True)
    assert _message(database_url, first)[0] == "pending"
    *_, (decided, *_, to_state, _, evidence) = _decisions(database_url)
    assert (decided, to_state) == (first, "pending")
    assert evidence == {"sent_after": [str(second)], "sent_after_count": 1}


# Idempotent delivery only: a fenced transactional session leaves nothing above
# the high watermark to wait for (see the test after this one).
def test_absence_is_proof_only_after_the_grace_but_a_record_found_is_delivered_at_once(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Within the grace after the write deadline, an absent record may still become
    visible (written but not yet replicated): the message waits; a found one does not."""
    with psycopg.connect(database_url) as conn:
        absent, present = (outbox.enqueue(conn, topic, b"v", key=k) for k in ("a", "b"))
    partitions = make_uncertain(database_url)
    at = send_record(kafka_bootstrap, topic, partitions[present], present)
    scanner = KafkaLogScanner(kafka_bootstrap)
    within = _reconcile_once(database_url, scanner, absence_grace=600)
    after = _reconcile_once(database_url, scanner)  # the scanner reconnects on use

    assert (within.delivered, within.deferred) == ([present], [absent])
    assert within.pending == within.escalated == []
    assert _message(database_url, present)[:3] == ("delivered", partitions[present], at)
    assert after.pending == [absent]
    assert [d[0] for d in _decisions(database_url)] == [present, absent]


def test_a_transactional_message_is_decided_at_once_after_the_fence(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Transactional delivery only: with its write deadline five minutes ahead and an
    absence grace of an hour, an uncertain batch is decided in the first pass, once its
    session is fenced. The first batch's commit reached the broker (its answer was lost):
    found. The second session died inside its batch's transaction: the fence aborts it,
    the session can commit nothing more, and its record is proven absent."""
    with psycopg.connect(database_url) as conn:
        committed = outbox.enqueue(conn, topic, b"v", key="c")
    first = f"outbox-{uuid.uuid4()}-1"
    partitions = make_uncertain_in_transaction(database_url, first, write_deadline_seconds=300)
    at = send_committed(kafka_bootstrap, first, topic, partitions[committed], committed, key=b"c")
    with psycopg.connect(database_url) as conn:
        left_open = outbox.enqueue(conn, topic, b"v", key="o")
    second = f"outbox-{uuid.uuid4()}-2"
    partitions |= make_uncertain_in_transaction(database_url, second, write_deadline_seconds=300)
    zombie = TransactionalSession(kafka_bootstrap, second)
    try:
        zombie.send(topic, partitions[left_open], left_open, key=b"o")
        report = _reconcile_once(
            database_url, KafkaLogScanner(kafka_bootstrap), absence_grace=LONG_ABSENCE_GRACE
        )
        with pytest.raises(KafkaError, match="ProducerFenced"):
            zombie.commit()
    finally:
        zombie.close()

    assert (report.delivered, report.pending) == ([committed], [left_open])
    assert report.escalated == report.deferred == []
    assert _message(database_url, committed)[:3] == ("delivered", partitions[committed], at)
    assert _message(database_url, left_open)[0] == "pending"
    assert [d[3] for d in _decisions(database_url)] == ["delivered", "pending"]
    # The aborted record stays in the log, where only read_uncommitted consumers see it.
    assert {r.outbox_id for r in read_topic(kafka_bootstrap, topic, committed=True)} == {committed}
    assert {r.outbox_id for r in read_topic(kafka_bootstrap, topic)} == {committed, left_open}


def test_an_aborted_record_of_an_earlier_attempt_is_no_evidence_after_a_mode_change(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """The delivery mode changed from transactional to idempotent. The message's first
    attempt, in a transaction, wrote its record and died: the fence aborted it, and the
    message went back to pending. Its retry, idempotent, is uncertain and wrote nothing.
    The aborted record lies in the retry's range (nothing was confirmed since), where a
    read_uncommitted consumer sees it. It proves nothing: no read_committed consumer
    will ever read it, so the message is proven absent and sent again."""
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, topic, b"v", key="k")
    session = f"outbox-{uuid.uuid4()}-1"
    partition = make_uncertain_in_transaction(database_url, session)[message_id]
    zombie = TransactionalSession(kafka_bootstrap, session)
    try:
        aborted_at = zombie.send(topic, partition, message_id, key=b"k")
        first = _reconcile_once(database_url, KafkaLogScanner(kafka_bootstrap))
    finally:
        zombie.close()
    assert first.pending == [message_id]
    assert make_uncertain(database_url) == {message_id: partition}  # the idempotent retry

    report = _reconcile_once(database_url, KafkaLogScanner(kafka_bootstrap))

    assert report.pending == [message_id]
    assert report.delivered == report.escalated == report.deferred == []
    assert _message(database_url, message_id)[0] == "pending"
    evidence = _decisions(database_url)[-1][5]
    assert (evidence["scan_from"], evidence["scan_to"]) == (0, aborted_at + 2)
    assert [(r.offset, r.outbox_id) for r in read_topic(kafka_bootstrap, topic)] == [
        (aborted_at, message_id)
    ]
    assert read_topic(kafka_bootstrap, topic, committed=True) == []


def test_pages_of_due_messages_follow_each_other_from_pass_to_pass(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """With a page of one message, and the first one waiting for a fence this reconciler
    cannot take (it has no fencer), the second pass decides the second message, and the
    third starts over."""
    waits = _enqueue(database_url, topic)
    make_uncertain_in_transaction(database_url, f"outbox-{uuid.uuid4()}-1")
    absent = _enqueue(database_url, topic)
    make_uncertain(database_url)
    store = claiming_store(database_url)
    scanner = KafkaLogScanner(kafka_bootstrap)
    try:
        reconciler = Reconciler(store, scanner, "test", absence_grace=0, limit=1)
        reports = [reconciler.run_once() for _ in range(3)]
    finally:
        scanner.close()
        store.close()

    assert [(r.deferred, r.pending) for r in reports] == [
        ([waits], []),
        ([], [absent]),
        ([waits], []),
    ]
    assert (_message(database_url, waits)[0], _message(database_url, absent)[0]) == (
        "uncertain",
        "pending",
    )


def test_a_session_the_broker_will_not_let_be_fenced_says_so_on_its_messages(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """An ACL denies the fencer the session's transactional.id: the message stays
    uncertain, and outbox list shows why and what to grant; the attempt keeps its own
    error; a second pass that fails the same way writes nothing. Once the ACL is gone,
    the next pass decides the message."""
    message = _enqueue(database_url, topic)
    session = f"outbox-{uuid.uuid4()}-1"
    make_uncertain_in_transaction(database_url, session)
    acl = deny(kafka_bootstrap, ResourceType.TRANSACTIONAL_ID, session, ACLOperation.WRITE)
    try:
        report = _reconcile_once(database_url, KafkaLogScanner(kafka_bootstrap))
        assert report.deferred == [message]
        state, *_, note = _message(database_url, message)
        assert state == "uncertain"
        assert note.startswith(f"reconciliation waits: the producer session {session} ")
        assert "TransactionalIdAuthorizationFailedError" in note
        assert f"Write and Describe on TransactionalId {session}" in note
        with psycopg.connect(database_url) as conn:
            listed = listing_text(list_messages(conn, State.UNCERTAIN), now=datetime.now(UTC))
        assert f"{session} that sent it could not be fenced" in listed
        [(attempt_error, written_at)] = fetch_rows(
            database_url,
            "SELECT a.error, m.updated_at FROM outbox.attempts AS a "
            "JOIN outbox.messages AS m ON m.id = a.message_id WHERE a.message_id = %s",
            message,
        )
        assert attempt_error == "KafkaTimeoutError: Expiring 1 record(s)"

        again = _reconcile_once(database_url, KafkaLogScanner(kafka_bootstrap))
        assert again.deferred == [message]
        [(updated_at,)] = fetch_rows(
            database_url, "SELECT updated_at FROM outbox.messages WHERE id = %s", message
        )
        assert updated_at == written_at
        # Once a fence succeeds, the reconciler takes its note back: the attempt's error.
        store = claiming_store(database_url)
        try:
            due = store.uncertain_due()
            assert store.note_waiting(due, None) == 1
            assert store.note_waiting(due, None) == 0  # no note left to take back
        finally:
            store.close()
        assert _message(database_url, message)[-1] == attempt_error
    finally:
        allow_again(kafka_bootstrap, acl)

    assert _reconcile_once(database_url, KafkaLogScanner(kafka_bootstrap)).pending == [message]
    state, *_, reason = _message(database_url, message)
    assert state == "pending"
    assert reason.startswith("proven absent: no record with its id")


def test_the_status_and_held_keys_views_give_the_waiting_note_as_the_next_action(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """An ACL denies the fencer the session of a keyed message that a later message of its
    key waits behind: outbox.held_keys gives the note as the key's reason, the status
    view's uncertain line quotes it as its next action (a publisher running, not overdue:
    still healthy), and outbox inspect points to it, where all three said to wait for
    reconciliation."""
    with psycopg.connect(database_url) as conn:
        stuck = outbox.enqueue(conn, topic, b"first", key="k")
    session = f"outbox-{uuid.uuid4()}-1"
    make_uncertain_in_transaction(database_url, session)
    with psycopg.connect(database_url) as conn:
        outbox.enqueue(conn, topic, b"second", key="k")
    acl = deny(kafka_bootstrap, ResourceType.TRANSACTIONAL_ID, session, ACLOperation.WRITE)
    try:
        assert _reconcile_once(database_url, KafkaLogScanner(kafka_bootstrap)).deferred == [stuck]
    finally:
        allow_again(kafka_bootstrap, acl)
    note = _message(database_url, stuck)[-1]
    assert note.startswith(f"reconciliation waits: the producer session {session} ")

    running = claiming_store(database_url)  # a publisher holding lanes: one is running
    try:
        with psycopg.connect(database_url) as conn:
            lines = read_status(conn)
            held = [h for h in read_held_keys(conn) if h.topic == topic]
            timeline = read_timeline(conn, stuck)
    finally:
        running.close()
    [key] = held
    assert (key.held_by, key.state, key.waiting) == (stuck, "uncertain", 1)
    assert key.reason == f"uncertain, {note}"
    assert key.next_action.startswith("do what the reason says: ")
    assert timeline is not None
    assert timeline.next_action.startswith("do what its last error says: ")
    uncertain = [line for line in lines if line.state == "uncertain" and line.messages]
    assert [line.topic for line in uncertain] == [None, topic]  # all topics, then its own
    for line in uncertain:
        assert line.next_action == f"1 of them: {note} (outbox list --state uncertain shows each)"
        assert line.healthy, line

    # Escalated, it needs a person's decision: that comes first, note or not.
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE outbox.messages SET escalated_at = now() WHERE id = %s", (stuck,))
        [key] = [h for h in read_held_keys(conn) if h.topic == topic]
        [line] = [line for line in read_status(conn) if line.state == "uncertain" and line.topic]
    assert key.reason == f"uncertain, escalated: {note}"
    assert line.next_action.startswith("1 escalated: the reconciler could not decide them")


def test_a_transaction_left_open_below_a_range_is_named_on_its_message(
    database_url: str, kafka_bootstrap: str
) -> None:
    """Another producer's transaction, open below where an uncertain message's record may
    be, holds read_committed reads back: once it has held them a minute the message says
    so (last_error, and inspect's next action points to it); once it is aborted, the
    message is decided as any other."""
    topic = f"outbox-test-{uuid.uuid4().hex[:12]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    other = TransactionalSession(kafka_bootstrap, f"other-{uuid.uuid4()}")
    store = claiming_store(database_url)
    scanner = KafkaLogScanner(kafka_bootstrap)
    try:
        assert other.send(topic, 0, uuid.uuid4()) == 0  # left open
        message_id = _enqueue(database_url, topic)
        assert make_uncertain(database_url, partitions=1) == {message_id: 0}
        now = [0.0]
        reconciler = Reconciler(
            store, scanner, "test", absence_grace=0, held_back_note_after=75, clock=lambda: now[0]
        )
        assert reconciler.run_once().deferred == [message_id]
        attempt_error = _message(database_url, message_id)[-1]
        assert not attempt_error.startswith(WAITING_NOTE)  # a transaction may be short

        now[0] += 75
        report = reconciler.run_once()
        note = held_back_note(topic, 0, 0)
        assert report.waiting == {note: 1}
        assert _message(database_url, message_id)[-1] == note
        # A reconciler that has not timed it (outbox-publisher reconcile) leaves it.
        fresh = Reconciler(store, scanner, "test", absence_grace=0)
        assert fresh.run_once().deferred == [message_id]
        assert _message(database_url, message_id)[-1] == note
        running = claiming_store(database_url)  # a publisher holding lanes: one is running
        try:
            with psycopg.connect(database_url) as conn:
                timeline = read_timeline(conn, message_id)
        finally:
            running.close()
        assert timeline is not None
        assert timeline.next_action.startswith("do what its last error says: ")

        other.abort()
        assert reconciler.run_once().pending == [message_id]
        assert _message(database_url, message_id)[-1].startswith("proven absent: ")
    finally:
        other.close()
        scanner.close()
        store.close()


def test_a_fence_that_cannot_reach_the_broker_gives_up_within_its_timeout() -> None:
    """A fence is tried from the publisher's loop: with no broker to answer it fails
    within its timeout, and the loop goes on."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # nobody listens there once it is closed
    fencer = KafkaFencer(f"127.0.0.1:{port}", timeout_ms=2000)
    failures: list[BaseException] = []

    def fence() -> None:
        try:
            fencer.fence("outbox-unreachable-1")
        except Exception as exc:  # noqa: BLE001 - the failure is the expected outcome
            failures.append(exc)

    attempt = threading.Thread(target=fence, daemon=True)
    attempt.start()
    attempt.join(timeout=10)
    assert not attempt.is_alive(), "the fence still waited 10 s after it began (timeout: 2 s)"
    assert failures  # it failed: the session's messages wait for a later pass


def test_a_message_reclaimed_after_its_topic_grew_is_looked_for_where_it_was_sent(
    database_url: str, kafka_bootstrap: str, sent: Sent
) -> None:
    """The claim clears the partition an earlier attempt stored: once the topic has grown,
    the retry that becomes uncertain is looked for (and found) in the partition it went to."""
    topic = f"outbox-test-{uuid.uuid4().hex[:12]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    # A key that leaves partition 0 when the topic grows to three partitions.
    # (A keyed record's partition does not depend on its id.)
    key = next(k for k in (b"k%d" % i for i in range(100)) if partition_for(k, uuid.uuid4(), 3))
    moved = partition_for(key, uuid.uuid4(), 3)
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, topic, b"v", key=key)
    # The first attempt, on one partition, is uncertain and then proven absent:
    # back to pending, with partition 0 stored.
    assert sent.make_uncertain(database_url, partitions=1) == {message_id: 0}
    assert _reconcile_once(database_url, KafkaLogScanner(kafka_bootstrap)).pending == [message_id]
    assert _message(database_url, message_id)[:3] == ("pending", 0, None)
    grow_topic(kafka_bootstrap, topic, 3)

    store = claiming_store(database_url)
    try:
        batch = store.claim(10, lease_seconds=30)
        assert batch is not None
        assert [m.id for m in batch.messages] == [message_id]
        assert _message(database_url, message_id)[:3] == ("in_flight", None, None)
        held = store.mark_sending(
            batch, {topic: 3}, write_deadline_seconds=0.0, transactional_id=sent.transactional_id
        )
        assert held == {message_id}
        offset = sent.write(topic, moved, message_id, key=key)
        # The publisher dies before it settles: its lease expires, and recovery
        # makes the message uncertain from the batch's evidence alone.
        with psycopg.connect(database_url) as conn:
            conn.execute(
                "UPDATE outbox.batches SET lease_expires_at = now() - interval '1 second' "
                "WHERE id = %s",
                (batch.id,),
            )
        assert [r.state for r in store.recover_expired_leases()] == [State.UNCERTAIN]
    finally:
        store.close()
    assert _message(database_url, message_id)[:3] == ("uncertain", None, None)

    report = _reconcile_once(database_url, KafkaLogScanner(kafka_bootstrap))
    assert report.delivered == [message_id]
    assert _message(database_url, message_id)[:3] == ("delivered", moved, offset)


#: ``outbox-id`` headers that carry no message id, as other producers may write them.
FOREIGN_ID_HEADERS: list[list[tuple[str, bytes]]] = [
    [("outbox-id", b"\xff\xfe\x80")],  # not UTF-8
    [("outbox-id", b"not-a-uuid")],
    [("outbox-id", b"")],
    [("outbox-id", str(uuid.uuid4()).upper().encode())],  # a UUID, not as the publisher writes it
    [("outbox-id", str(uuid.uuid4()).encode()), ("outbox-id", b"\x80")],  # repeated
    [("outbox-id", str(uuid.uuid4()).encode())],  # well formed, but no message of this outbox
]


def test_records_with_foreign_or_undecodable_id_headers_do_not_stop_a_pass(
    database_url: str, kafka_bootstrap: str, sent: Sent
) -> None:
    """Records of the messages' keys whose outbox-id is not a message id (undecodable, not a
    UUID, empty, repeated) are skipped: the pass still finds one message and proves the
    other absent."""
    topic = f"outbox-test-{uuid.uuid4().hex[:12]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    with psycopg.connect(database_url) as conn:
        found, absent = (outbox.enqueue(conn, topic, b"v", key=k) for k in ("found", "absent"))
    assert sent.make_uncertain(database_url, partitions=1) == {found: 0, absent: 0}
    foreign = [
        (key, headers) for key in (b"found", b"absent", None) for headers in FOREIGN_ID_HEADERS
    ]
    send_raw(kafka_bootstrap, topic, 0, foreign)
    offset = sent.write(topic, 0, found, key=b"found")
    send_raw(kafka_bootstrap, topic, 0, foreign)

    report = _reconcile_once(database_url, KafkaLogScanner(kafka_bootstrap))

    assert (report.delivered, report.pending, report.escalated) == ([found], [absent], [])
    assert _message(database_url, found)[:3] == ("delivered", 0, offset)
    assert _message(database_url, absent)[0] == "pending"


def test_a_record_whose_outbox_id_header_has_no_value_does_not_stop_a_pass(
    database_url: str, kafka_bootstrap: str, sent: Sent
) -> None:
    """A record of the message's key with a null outbox-id value (kafka-python's producer
    cannot write one; librdkafka can) is skipped, and the message is found after it."""
    ck = pytest.importorskip("confluent_kafka", reason="the confluent extra is not installed")
    topic = f"outbox-test-{uuid.uuid4().hex[:12]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, topic, b"v", key="k")
    assert sent.make_uncertain(database_url, partitions=1) == {message_id: 0}
    producer = ck.Producer({"bootstrap.servers": kafka_bootstrap, "acks": "all"})
    producer.produce(topic, value=b"foreign", key=b"k", partition=0, headers=[("outbox-id", None)])
    assert producer.flush(30) == 0
    offset = sent.write(topic, 0, message_id, key=b"k")
    assert offset == 1  # the valueless record is before it

    report = _reconcile_once(database_url, KafkaLogScanner(kafka_bootstrap))

    assert report.delivered == [message_id]
    assert _message(database_url, message_id)[:3] == ("delivered", 0, offset)


class _BusyPartitionScanner(KafkaLogScanner):
    """The real scanner on a busy partition: another producer appends 3 records at every
    look at its end, and a scan reads at most 4 offsets, as one that runs out of time."""

    per_pass = 4

    def offset_range(
        self, topic: str, partition: int, *, committed: bool = False
    ) -> tuple[int, int]:
        send_raw(self._bootstrap_servers, topic, partition, [(b"other", [])] * 3)
        return super().offset_range(topic, partition, committed=committed)

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
        stop = min(end, start + self.per_pass)
        scan = super().find(topic, partition, start, stop, ids, keys=keys)
        if stop < end:
            raise ScanIncomplete(
                f"{topic}[{partition}] read up to {stop} of [{start}, {end})", scan, stop
            )
        return scan


@pytest.mark.parametrize("present", [True, False], ids=["found", "proven-absent"])
def test_a_range_longer_than_a_pass_on_a_busy_partition_is_decided(
    database_url: str, kafka_bootstrap: str, topic: str, sent: Sent, *, present: bool
) -> None:
    """The partition grows at every look and a pass reads 4 offsets: each pass goes on
    where the last stopped, up to the end first seen once the producer could write nothing
    more, so the message is decided in a few passes instead of never."""
    message_id = _enqueue(database_url, topic)
    partition = sent.make_uncertain(database_url)[message_id]
    send_raw(kafka_bootstrap, topic, partition, [(b"other", [])] * 10)
    at = sent.write(topic, partition, message_id) if present else None
    store = claiming_store(database_url)
    scanner = _BusyPartitionScanner(kafka_bootstrap)
    reconciler = Reconciler(
        store, scanner, "test", absence_grace=0, fencer=KafkaFencer(kafka_bootstrap)
    )
    try:
        passes = 0
        while passes < 20 and (report := reconciler.run_once()).decided == 0:
            passes += 1
    finally:
        scanner.close()
        store.close()

    assert passes < 6
    assert (report.delivered, report.pending) == (
        ([message_id], []) if present else ([], [message_id])
    )
    state, _, kafka_offset, _, _ = _message(database_url, message_id)
    assert (state, kafka_offset) == (("delivered", at) if present else ("pending", None))
    [(_, _, _, _, _, evidence)] = _decisions(database_url)
    assert evidence["passes"] == passes + 1 > 1


def test_a_message_an_operator_is_deciding_is_left_for_a_later_pass(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """An operator's decision not committed yet (held open in its caller's transaction)
    holds its message's row: the reconciler decides the other messages and leaves that one,
    instead of waiting for the caller."""
    held = _enqueue(database_url, topic)
    other = _enqueue(database_url, topic)
    make_uncertain(database_url)
    [(fence,)] = fetch_rows(database_url, "SELECT fence FROM outbox.messages WHERE id = %s", held)
    # Waiting for the operator's transaction would fail after 5 s instead of hanging.
    store = ClaimingStore(make_conninfo(database_url, options="-c lock_timeout=5s"), uuid.uuid4())
    store.take_all_lanes()
    scanner = KafkaLogScanner(kafka_bootstrap)
    try:
        with psycopg.connect(database_url) as operator:
            operator.execute("SELECT 1")  # the caller's transaction, left open
            resolve(
                operator,
                held,
                Resolution.PENDING,
                "sent again by hand",
                fence=fence,
                decided_by="an operator",
            )

            report = Reconciler(store, scanner, "test", absence_grace=0).run_once()

            assert report.pending == [other]
            assert _message(database_url, held)[0] == "uncertain"  # not committed yet
            operator.commit()
    finally:
        scanner.close()
        store.close()
    [(login,)] = fetch_rows(database_url, "SELECT session_user")
    assert [(d[0], d[1], d[3]) for d in _decisions(database_url)] == [
        (held, f"an operator (database user {login})", "pending"),
        (other, "test", "pending"),
    ]


def test_an_operator_decision_read_before_the_reconcilers_is_refused(
    database_url: str, kafka_bootstrap: str, topic: str, reconciler: Reconciler
) -> None:
    """An operator reads an uncertain message at fence N; the reconciler proves it absent
    and makes it pending. A discard made from that reading names fence N: refused, as the
    reconciler's decision raised the fence, and the message is sent."""
    message_id = _enqueue(database_url, topic)
    make_uncertain(database_url)
    [(fence,)] = fetch_rows(
        database_url, "SELECT fence FROM outbox.messages WHERE id = %s", message_id
    )
    assert reconciler.run_once().pending == [message_id]

    with psycopg.connect(database_url) as operator, pytest.raises(DecisionRefused):
        discard(operator, message_id, "obsolete, as read a moment ago", fence=fence)
    assert _message(database_url, message_id)[0] == "pending"
