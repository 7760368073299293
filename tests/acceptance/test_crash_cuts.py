"""The real publisher killed at each cut of the crash timeline, then a fresh one takes over.

Each test enqueues a few hundred messages, runs ``outbox-publisher`` with
``OUTBOX_CRASH_AT=<cut>:2`` and ``OUTBOX_ENABLE_FAULTS=1`` (it dies with
``os._exit`` at that cut of its second batch), checks what the database says
at that moment, then runs a fresh publisher until nothing is left and checks
the end state: every message delivered exactly once in Kafka, at the offset
stored for it, and a second recovery and reconciliation pass changes nothing.

Every cut runs in both delivery modes. In transactional delivery the
consumers read ``read_committed``, as that mode requires of them, and the
publishers run with an absence grace of an hour: an uncertain message decided
within the test was decided by the fence and the committed log alone. Two
cuts exist only in that mode, and each has a test that walks through the
recovery and the reconciliation step by step: the records were handed to
the producer but the transaction was not committed, and the transaction was
committed but nothing was recorded.

Without ``OUTBOX_ENABLE_FAULTS=1`` the switch is ignored: the last test
checks that a publisher so started delivers everything and says why it did
not crash.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter

import psycopg
import pytest

import outbox
from publisher.faults import CRASH_EXIT_CODE
from publisher.fencing import KafkaFencer
from publisher.reconciler import Reconciler
from publisher.scanner import KafkaLogScanner
from publisher.store import PublisherStore
from tests.support import (
    DELIVERY_MODES,
    LONG_ABSENCE_GRACE,
    assert_each_read_once,
    count_by_state,
    delivery_flags,
    fast_publisher_flags,
    fault_env,
    read_topic,
    reads_committed,
    start_publisher,
    status_line,
    wait_until,
)

pytestmark = pytest.mark.acceptance

TOTAL = 300
BATCH = 100
FAST = fast_publisher_flags(BATCH)
TRANSACTIONAL = delivery_flags("transactional")

CUTS = ("after_claim", "after_send", "after_ack", "after_confirm")


def _batches(database_url: str) -> list[tuple[object, ...]]:
    """Each batch of the run in claim order: began sending, settled, its transactional.id."""
    with psycopg.connect(database_url) as conn:
        return conn.execute(
            "SELECT send_began_at IS NOT NULL, settled_at IS NOT NULL, transactional_id "
            "FROM outbox.batches ORDER BY id"
        ).fetchall()


def _batch_ids(database_url: str, offset: int) -> set[uuid.UUID]:
    """The messages the run's ``offset``-th batch (from 0) claimed."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT message_ids FROM outbox.batches ORDER BY id OFFSET %s LIMIT 1", (offset,)
        ).fetchone()
    assert row is not None, f"no batch {offset}"
    return set(row[0])


def _crash(database_url: str, kafka_bootstrap: str, cut: str, *flags: str, batch: int = 2) -> str:
    process = start_publisher(
        database_url, kafka_bootstrap, *FAST, *flags, env=fault_env(crash_at=f"{cut}:{batch}")
    )
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == CRASH_EXIT_CODE, stderr
    assert f"injected crash at {cut} (batch {batch})" in stderr
    return stderr


def _finish(
    database_url: str,
    kafka_bootstrap: str,
    topic: str,
    ids: list[uuid.UUID],
    *flags: str,
    committed: bool = False,
) -> list[tuple[object, ...]]:
    """Run a fresh publisher until idle; check every message delivered once; the evidence.

    Returns the attempts that did not deliver, as (outcome, send_began, count).
    """
    finisher = start_publisher(database_url, kafka_bootstrap, *FAST, *flags, "--exit-when-idle")
    _, stderr = finisher.communicate(timeout=180)
    assert finisher.returncode == 0, stderr
    assert count_by_state(database_url) == {"delivered": TOTAL}
    assert_each_read_once(database_url, kafka_bootstrap, topic, ids, committed=committed)
    with psycopg.connect(database_url) as conn:
        return conn.execute(
            "SELECT a.outcome, a.send_began, count(*) FROM outbox.attempts a "
            "WHERE a.outcome <> 'delivered' GROUP BY 1, 2"
        ).fetchall()


def _ids_in_kafka(kafka_bootstrap: str, topic: str, *, committed: bool) -> Counter[uuid.UUID]:
    return Counter(r.outbox_id for r in read_topic(kafka_bootstrap, topic, committed=committed))


def _decisions(database_url: str) -> dict[str, int]:
    with psycopg.connect(database_url) as conn:
        return dict(
            conn.execute(
                "SELECT to_state, count(*) FROM outbox.decisions GROUP BY to_state"
            ).fetchall()
        )


def _enqueue(database_url: str, topic: str) -> list[uuid.UUID]:
    """TOTAL messages on 13 keys: while a batch is in flight, every key is held by it, so
    no batch is claimed ahead of it."""
    with psycopg.connect(database_url) as conn:
        return outbox.enqueue_many(
            conn, [outbox.Message(topic, f"m{i}", key=f"k{i % 13}") for i in range(TOTAL)]
        )


def _claimed_ahead_of_the_crash(database_url: str, counts: dict[str, int]) -> bool:
    """After a crash at after_confirm of batch 2: was batch 3 claimed ahead (never sent)?

    The claim-ahead started while batch 2 was sent finds every key held by
    it, unless its snapshot was taken after batch 2 settled: then it claimed
    batch 3, which was not sent (as after a crash at after_claim).
    """
    batches = [(began, settled) for began, settled, _ in _batches(database_url)]
    if len(batches) == 3:
        assert counts == {"delivered": 2 * BATCH, "in_flight": TOTAL - 2 * BATCH}
        assert batches == [(True, True), (True, True), (False, False)]
        return True
    assert counts == {"delivered": 2 * BATCH, "pending": TOTAL - 2 * BATCH}
    assert batches == [(True, True), (True, True)]
    return False


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("delivery", DELIVERY_MODES)
def test_crash_at_each_cut_ends_with_every_message_delivered_exactly_once(
    database_url: str, kafka_bootstrap: str, topic: str, delivery: str, cut: str
) -> None:
    """Whatever the cut and the delivery mode, the database says what happened and nothing
    is lost or duplicated."""
    mode = delivery_flags(delivery)
    committed = reads_committed(delivery)
    transactional = delivery == "transactional"
    ids = _enqueue(database_url, topic)
    _crash(database_url, kafka_bootstrap, cut, *mode)

    # What the database knows at the moment of the crash (docs/guarantees.md).
    counts = count_by_state(database_url)
    in_kafka = _ids_in_kafka(kafka_bootstrap, topic, committed=committed)
    claimed_ahead = False
    if cut == "after_confirm":
        assert sum(in_kafka.values()) == 2 * BATCH
        claimed_ahead = _claimed_ahead_of_the_crash(database_url, counts)
    else:
        assert counts == {"delivered": BATCH, "in_flight": BATCH, "pending": TOTAL - 2 * BATCH}
        # The second batch holds every message in flight, under the crashed
        # publisher's live lease, and was not settled.
        in_flight = status_line(database_url, "in_flight")
        assert (in_flight["messages"], in_flight["leases_expired"]) == (BATCH, 0)
        assert len(in_flight["lease_owners"]) == 1
        (_, settled_1, _), (began, settled_2, _) = _batches(database_url)
        assert (settled_1, settled_2) == (True, False)
        assert began is (cut != "after_claim")
        if cut == "after_claim" or (transactional and cut in ("after_send", "after_ack")):
            # Nothing of the second batch is visible: not sent, or not committed.
            assert sum(in_kafka.values()) == BATCH
        if cut == "after_ack":
            # Acknowledged, but not recorded (and, in transactional delivery,
            # not committed): the records are in the log.
            written = _ids_in_kafka(kafka_bootstrap, topic, committed=False)
            assert sum(written.values()) == 2 * BATCH

    # A fresh publisher recovers, reconciles and delivers the rest.
    evidence = _finish(database_url, kafka_bootstrap, topic, ids, *mode, committed=committed)
    decisions = _decisions(database_url)

    # The crashed batch left its evidence: a recovered attempt per message,
    # saying whether sending had begun; uncertain ones were decided from Kafka.
    if cut == "after_confirm":
        assert evidence == ([("recovered", False, TOTAL - 2 * BATCH)] if claimed_ahead else [])
        assert decisions == {}
    else:
        assert evidence == [("recovered", cut != "after_claim", BATCH)]
    if cut == "after_claim":
        assert decisions == {}
    if cut in ("after_send", "after_ack") and transactional:
        # Fenced: its transaction was aborted, so nothing of it was committed;
        # proven absent at once (no grace) and sent again.
        assert decisions == {"pending": BATCH}
    elif cut == "after_ack":
        assert decisions == {"delivered": BATCH}  # all found in Kafka, none resent
    elif cut == "after_send":
        assert sum(decisions.values()) == BATCH
        assert set(decisions) <= {"delivered", "pending"}

    # A second pass of recovery and reconciliation finds nothing to do.
    store = PublisherStore(database_url, uuid.uuid4())
    scanner = KafkaLogScanner(kafka_bootstrap)
    try:
        assert store.recover_expired_leases() == []
        reconciler = Reconciler(
            store, scanner, "test", absence_grace=0, fencer=KafkaFencer(kafka_bootstrap)
        )
        assert reconciler.run_once().decided == 0
    finally:
        scanner.close()
        store.close()
    assert count_by_state(database_url) == {"delivered": TOTAL}


@pytest.mark.parametrize("delivery", DELIVERY_MODES)
def test_a_crash_with_a_batch_claimed_ahead_returns_it_unsent(
    database_url: str, kafka_bootstrap: str, topic: str, delivery: str
) -> None:
    """Every message its own key: batch 3 is claimed ahead while 2 is sent, then the crash.

    In transactional delivery a full batch claimed ahead would join the open
    transaction and be sent with it; one batch per transaction keeps the
    batch claimed ahead apart, as in idempotent delivery.
    """
    mode = delivery_flags(delivery)
    if delivery == "transactional":
        mode += ("--transaction-records", str(BATCH))
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(
            conn, [outbox.Message(topic, f"m{i}", key=f"k{i}") for i in range(TOTAL)]
        )
    process = start_publisher(
        database_url, kafka_bootstrap, *FAST, *mode, env=fault_env(crash_at="after_claim:3")
    )
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == CRASH_EXIT_CODE, stderr

    # Batches 1 and 2 delivered; batch 3 in flight under a live lease, never sent.
    assert count_by_state(database_url) == {"delivered": 2 * BATCH, "in_flight": BATCH}
    with psycopg.connect(database_url) as conn:
        third = conn.execute(
            "SELECT send_began_at, settled_at FROM outbox.batches ORDER BY id OFFSET 2"
        ).fetchall()
    assert third == [(None, None)]

    evidence = _finish(
        database_url, kafka_bootstrap, topic, ids, *mode, committed=reads_committed(delivery)
    )
    with psycopg.connect(database_url) as conn:
        decisions = conn.execute("SELECT count(*) FROM outbox.decisions").fetchone()
    # Recovered as never sent: back to pending, nothing to reconcile.
    assert evidence == [("recovered", False, BATCH)]
    assert decisions == (0,)


def _recover_by_hand(database_url: str, crashed: set[uuid.UUID]) -> None:
    """Once the crashed publisher's leases expired, recovery makes its batches uncertain."""
    wait_until(
        lambda: status_line(database_url, "in_flight")["leases_expired"] == len(crashed),
        timeout=30,
        interval=0.2,
        what="the crashed publisher's lease to expire",
    )
    store = PublisherStore(database_url, uuid.uuid4())
    try:
        recovered = store.recover_expired_leases()
    finally:
        store.close()
    assert {r.message_id for r in recovered} == crashed
    assert {r.state.value for r in recovered} == {"uncertain"}  # sending had begun


def _reconcile_by_hand(
    database_url: str, kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> tuple[list[uuid.UUID], list[uuid.UUID], str]:
    """One pass of a reconciler that fences, with an absence grace no test waits out.

    Returns the messages it made delivered and pending, and its log.
    """
    store = PublisherStore(database_url, uuid.uuid4())
    scanner = KafkaLogScanner(kafka_bootstrap)
    try:
        with caplog.at_level(logging.INFO, logger="publisher.reconciler"):
            report = Reconciler(
                store,
                scanner,
                "test",
                absence_grace=LONG_ABSENCE_GRACE,
                fencer=KafkaFencer(kafka_bootstrap),
            ).run_once()
    finally:
        scanner.close()
        store.close()
    # Decided in this one pass: nothing waits for a grace or a write deadline.
    assert (report.deferred, report.escalated) == ([], [])
    return report.delivered, report.pending, caplog.text


def test_transactional_crash_before_the_commit_is_fenced_proven_absent_and_resent(
    database_url: str, kafka_bootstrap: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Records handed over, transaction not committed: in flight at the crash; recovery
    makes them uncertain; the reconciler fences the session and, reading committed, proves
    them absent at once (no grace); they are sent again and read once."""
    ids = _enqueue(database_url, topic)
    _crash(database_url, kafka_bootstrap, "after_send", *TRANSACTIONAL)
    crashed = _batch_ids(database_url, 1)
    assert len(crashed) == BATCH

    # At the crash: in flight under a live lease; the batch began sending in
    # the crashed session's transaction, which nobody committed.
    assert count_by_state(database_url) == {
        "delivered": BATCH,
        "in_flight": BATCH,
        "pending": TOTAL - 2 * BATCH,
    }
    assert status_line(database_url, "in_flight")["leases_expired"] == 0
    (began_1, settled_1, session), (began_2, settled_2, crashed_session) = _batches(database_url)
    assert (began_1, settled_1, began_2, settled_2) == (True, True, True, False)
    assert crashed_session is not None
    assert crashed_session == session  # the same producer session sent both batches
    committed_before = _ids_in_kafka(kafka_bootstrap, topic, committed=True)
    assert set(committed_before) == _batch_ids(database_url, 0)
    assert max(committed_before.values()) == 1

    _recover_by_hand(database_url, crashed)
    assert count_by_state(database_url) == {
        "delivered": BATCH,
        "uncertain": BATCH,
        "pending": TOTAL - 2 * BATCH,
    }
    delivered, pending, logged = _reconcile_by_hand(database_url, kafka_bootstrap, caplog)
    assert f"fenced producer session {crashed_session}" in logged
    assert delivered == []
    assert set(pending) == crashed
    with psycopg.connect(database_url) as conn:
        decided = conn.execute(
            "SELECT message_id, from_state, to_state, reason FROM outbox.decisions"
        ).fetchall()
    assert {mid for mid, *_ in decided} == crashed
    assert {(f, t) for _, f, t, _ in decided} == {("uncertain", "pending")}
    assert all(reason.startswith("proven absent") for *_, reason in decided)
    # The fence aborted the open transaction: nothing of it is committed now.
    assert _ids_in_kafka(kafka_bootstrap, topic, committed=True) == committed_before

    evidence = _finish(database_url, kafka_bootstrap, topic, ids, *TRANSACTIONAL, committed=True)
    assert evidence == [("recovered", True, BATCH)]
    assert _decisions(database_url) == {"pending": BATCH}
    # A read_uncommitted consumer may also read what the crashed transaction
    # wrote before it was aborted: copies of its batch only.
    copies = _ids_in_kafka(kafka_bootstrap, topic, committed=False)
    assert set(copies) == set(ids)
    assert {mid for mid, n in copies.items() if n > 1} <= crashed


def test_transactional_crash_after_the_commit_is_fenced_found_and_not_resent(
    database_url: str, kafka_bootstrap: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Commit done, nothing settled: in flight at the crash; recovery makes the batch
    uncertain; the reconciler fences the session and finds every record committed, at once:
    delivered at the offsets found, and nothing is sent again."""
    ids = _enqueue(database_url, topic)
    _crash(database_url, kafka_bootstrap, "after_commit", *TRANSACTIONAL)
    crashed = _batch_ids(database_url, 1)
    assert len(crashed) == BATCH

    # At the crash: in flight under a live lease, not settled; yet its
    # transaction is committed, so read_committed consumers read it already.
    assert count_by_state(database_url) == {
        "delivered": BATCH,
        "in_flight": BATCH,
        "pending": TOTAL - 2 * BATCH,
    }
    assert status_line(database_url, "in_flight")["leases_expired"] == 0
    assert [(b, s) for b, s, _ in _batches(database_url)] == [(True, True), (True, False)]
    crashed_session = _batches(database_url)[1][2]
    assert crashed_session is not None
    records = read_topic(kafka_bootstrap, topic, committed=True)
    assert Counter(r.outbox_id for r in records) == Counter(_batch_ids(database_url, 0) | crashed)
    committed_at = {r.outbox_id: (r.partition, r.offset) for r in records if r.outbox_id in crashed}

    _recover_by_hand(database_url, crashed)
    assert count_by_state(database_url) == {
        "delivered": BATCH,
        "uncertain": BATCH,
        "pending": TOTAL - 2 * BATCH,
    }
    delivered, pending, logged = _reconcile_by_hand(database_url, kafka_bootstrap, caplog)
    assert f"fenced producer session {crashed_session}" in logged
    assert pending == []
    assert set(delivered) == crashed
    with psycopg.connect(database_url) as conn:
        stored = {
            mid: (p, o)
            for mid, p, o in conn.execute(
                "SELECT id, kafka_partition, kafka_offset FROM outbox.messages WHERE id = ANY(%s)",
                (list(crashed),),
            )
        }
    assert stored == committed_at  # where the committed transaction wrote them

    evidence = _finish(database_url, kafka_bootstrap, topic, ids, *TRANSACTIONAL, committed=True)
    assert evidence == [("recovered", True, BATCH)]
    assert _decisions(database_url) == {"delivered": BATCH}
    # Nothing was aborted or sent again: even a read_uncommitted consumer
    # reads each message once.
    copies = _ids_in_kafka(kafka_bootstrap, topic, committed=False)
    assert set(copies) == set(ids)
    assert max(copies.values()) == 1


@pytest.mark.parametrize(
    "crash_at",
    [
        pytest.param(("after_send", 3), id="before_the_commit"),
        pytest.param(("after_commit", 1), id="after_the_commit"),
    ],
)
def test_transactional_crash_in_a_transaction_of_several_batches_decides_them_together(
    database_url: str,
    kafka_bootstrap: str,
    topic: str,
    caplog: pytest.LogCaptureFixture,
    crash_at: tuple[str, int],
) -> None:
    """Under backlog the full batches claimed ahead join the open transaction. A crash
    before its commit (the third batch handed over) leaves every batch of it in flight and
    nothing committed: fenced, all proven absent and sent again. A crash after the commit
    leaves them in flight too, all committed: fenced, all found, nothing sent again."""
    with psycopg.connect(database_url) as conn:
        ids = outbox.enqueue_many(
            conn, [outbox.Message(topic, f"m{i}", key=f"k{i}") for i in range(TOTAL)]
        )  # every message its own key: each full batch claimed ahead joins the transaction
    cut, batch = crash_at
    _crash(database_url, kafka_bootstrap, cut, *TRANSACTIONAL, batch=batch)

    committed = cut == "after_commit"
    batches = _batches(database_url)
    assert [(began, settled) for began, settled, _ in batches] == [(True, False)] * 3
    assert len({session for *_, session in batches}) == 1  # one session, one transaction
    assert {mid for offset in range(3) for mid in _batch_ids(database_url, offset)} == set(ids)
    assert count_by_state(database_url) == {"in_flight": TOTAL}
    records = read_topic(kafka_bootstrap, topic, committed=True)
    assert Counter(r.outbox_id for r in records) == (Counter(ids) if committed else Counter())
    committed_at = {r.outbox_id: (r.partition, r.offset) for r in records}

    _recover_by_hand(database_url, set(ids))
    assert count_by_state(database_url) == {"uncertain": TOTAL}
    delivered, pending, logged = _reconcile_by_hand(database_url, kafka_bootstrap, caplog)
    assert logged.count("fenced producer session") == 1
    if committed:
        assert (set(delivered), pending) == (set(ids), [])
        with psycopg.connect(database_url) as conn:
            stored = {
                mid: (p, o)
                for mid, p, o in conn.execute(
                    "SELECT id, kafka_partition, kafka_offset FROM outbox.messages"
                )
            }
        assert stored == committed_at
    else:
        assert (delivered, set(pending)) == ([], set(ids))

    evidence = _finish(database_url, kafka_bootstrap, topic, ids, *TRANSACTIONAL, committed=True)
    assert evidence == [("recovered", True, TOTAL)]
    assert _decisions(database_url) == {"delivered" if committed else "pending": TOTAL}


def test_a_crash_switch_without_the_gate_is_ignored_with_one_warning(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Without OUTBOX_ENABLE_FAULTS=1 the switches do nothing; one warning names them."""
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(conn, [outbox.Message(topic, f"m{i}", key=f"k{i}") for i in range(3)])
    env = {
        "OUTBOX_ENABLE_FAULTS": "",  # whatever the test runner's environment says
        "OUTBOX_CRASH_AT": "after_claim:1",
        "OUTBOX_PAUSE_AT": "after_send:1",
    }
    process = start_publisher(database_url, kafka_bootstrap, *FAST, "--exit-when-idle", env=env)
    try:
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:  # frozen at the pause after all: end it
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert count_by_state(database_url) == {"delivered": 3}
    assert "injected" not in stderr
    warnings = [line for line in stderr.splitlines() if "ignored" in line]
    assert len(warnings) == 1, stderr
    assert "OUTBOX_CRASH_AT and OUTBOX_PAUSE_AT set but ignored" in warnings[0]
    assert "after_claim" not in warnings[0]
