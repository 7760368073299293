"""``outbox resolve`` and ``outbox-publisher reconcile``: decisions by hand and by evidence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from kafka.admin import ACLOperation, ResourceType

import outbox
from outbox.states import ABSENCE_GRACE_SECONDS, State
from publisher.outcomes import AttemptOutcome
from publisher.store import Settlement
from tests.support import (
    allow_again,
    claiming_store,
    create_topic,
    delete_topic,
    deny,
    fetch_rows,
    make_uncertain,
    make_uncertain_in_transaction,
    run_outbox_cli,
    send_record,
)

pytestmark = pytest.mark.integration


def _outbox(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return run_outbox_cli(url, *args)


def _reconcile(
    *args: str, url: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``outbox-publisher reconcile --database-url URL ARGS...`` as a separate process."""
    return subprocess.run(
        [sys.executable, "-m", "publisher", "reconcile", "--database-url", url, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def _enqueue(database_url: str, topic: str = "t") -> uuid.UUID:
    with psycopg.connect(database_url) as conn:
        return outbox.enqueue(conn, topic, b"payload")


def _state(database_url: str, message_id: uuid.UUID) -> tuple[Any, ...]:
    [row] = fetch_rows(
        database_url,
        "SELECT state, kafka_partition, kafka_offset FROM outbox.messages WHERE id = %s",
        message_id,
    )
    return row


def _fence(database_url: str, message_id: uuid.UUID) -> str:
    """The message's fence as ``outbox inspect --json`` shows it, for a decision's --fence."""
    result = _outbox("inspect", str(message_id), "--json", url=database_url)
    assert result.returncode in (0, 1), result.stderr
    return str(json.loads(result.stdout)["message"]["fence"])


def _decisions(database_url: str) -> list[tuple[Any, ...]]:
    return fetch_rows(
        database_url,
        "SELECT message_id, decided_by, from_state, to_state, reason, evidence "
        "FROM outbox.decisions ORDER BY id",
    )


def _quarantined(database_url: str) -> uuid.UUID:
    """A message the broker refused for good, as a publisher settles it."""
    message_id = _enqueue(database_url)
    store = claiming_store(database_url)
    batch = store.claim(10, lease_seconds=30)
    assert batch is not None
    [m] = batch.messages
    refused = Settlement(
        m.id,
        m.fence,
        State.QUARANTINED,
        AttemptOutcome.FAILED,
        partition=2,  # the partition it was aimed at, as the publisher records it
        error="MessageSizeTooLargeError",
        send_began=False,
    )
    assert store.settle(batch, [refused]) == {message_id}
    store.close()
    return message_id


def _delivered(database_url: str) -> uuid.UUID:
    """A message the broker confirmed, as a publisher settles it."""
    message_id = _enqueue(database_url)
    store = claiming_store(database_url)
    batch = store.claim(10, lease_seconds=30)
    assert batch is not None
    [m] = batch.messages
    confirmed = Settlement(
        m.id, m.fence, State.DELIVERED, AttemptOutcome.DELIVERED, partition=1, offset=4
    )
    assert store.settle(batch, [confirmed]) == {message_id}
    store.close()
    return message_id


def _uncertain_until(database_url: str, seconds: float) -> tuple[uuid.UUID, datetime]:
    """An uncertain message whose write deadline is ``seconds`` away, and that deadline."""
    message_id = _enqueue(database_url)
    make_uncertain(database_url, write_deadline_seconds=seconds)
    [(deadline,)] = fetch_rows(
        database_url,
        "SELECT b.write_deadline FROM outbox.messages AS m "
        "JOIN outbox.batches AS b ON b.id = m.batch_id WHERE m.id = %s",
        message_id,
    )
    return message_id, deadline


def _uncertain(database_url: str) -> uuid.UUID:
    message_id = _enqueue(database_url)
    assert set(make_uncertain(database_url)) == {message_id}
    return message_id


def test_resolve_delivered_records_the_location_and_the_decision(database_url: str) -> None:
    """resolve --delivered marks an uncertain message delivered where the operator found it."""
    message_id = _enqueue(database_url)
    sent_to = make_uncertain(database_url)[message_id]  # the partition its record went to

    result = _outbox(
        "resolve",
        str(message_id),
        "--delivered",
        "--fence",
        _fence(database_url, message_id),
        "--partition",
        str(sent_to),
        "--offset",
        "17",
        "--reason",
        "seen in kafka-console-consumer",
        url=database_url,
    )
    assert result.returncode == 0, result.stderr
    assert "uncertain -> delivered" in result.stdout
    [(state, partition, offset, delivered, last_error)] = fetch_rows(
        database_url,
        "SELECT state, kafka_partition, kafka_offset, delivered_at IS NOT NULL, last_error "
        "FROM outbox.messages",
    )
    assert (state, partition, offset, delivered, last_error) == (
        "delivered",
        sent_to,
        17,
        True,
        None,
    )
    [(decided_id, decided_by, from_state, to_state, reason, evidence)] = _decisions(database_url)
    assert decided_id == message_id
    # Who ran the command, and the database user it logged in as (what was authenticated).
    [(login,)] = fetch_rows(database_url, "SELECT session_user")
    assert decided_by.startswith("operator ")
    assert decided_by.endswith(f" (database user {login})")
    assert (from_state, to_state) == ("uncertain", "delivered")
    assert reason == "seen in kafka-console-consumer"
    assert evidence == {"partition": sent_to, "offset": 17}


def test_resolve_delivered_refuses_a_partition_the_record_was_not_sent_to(
    database_url: str,
) -> None:
    """An uncertain message's send named its partition: a record found in another one is
    not its record (a typo, or another topic's), and is refused before anything moves."""
    message_id = _enqueue(database_url)
    sent_to = make_uncertain(database_url, partitions=3)[message_id]
    elsewhere = (sent_to + 1) % 3
    before = fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq")
    result = _outbox(
        "resolve", str(message_id), "--delivered", "--fence", _fence(database_url, message_id),
        "--partition", str(elsewhere), "--offset", "17", "--reason", "seen", url=database_url,
    )  # fmt: skip
    _assert_refused(result, database_url, before)
    assert (
        f"was sent to partition {sent_to}: the send it is uncertain from wrote its record "
        f"there or nowhere, not in partition {elsewhere}"
    ) in result.stderr
    assert _decisions(database_url) == []


@pytest.mark.parametrize(
    ("make", "keeps_partition"), [(_uncertain, True), (_quarantined, False)],
    ids=["uncertain", "quarantined"],
)  # fmt: skip
def test_resolve_delivered_without_a_location_keeps_only_where_a_send_went(
    database_url: str, make: Callable[[str], uuid.UUID], keeps_partition: bool
) -> None:
    """Left out, the location is the partition an uncertain send went to (its record is
    there if anywhere); a quarantined message's record never reached the one it was
    aimed at, so it gets none."""
    message_id = make(database_url)
    [(aimed_at,)] = fetch_rows(
        database_url, "SELECT kafka_partition FROM outbox.messages WHERE id = %s", message_id
    )
    assert aimed_at is not None
    result = _outbox(
        "resolve", str(message_id), "--delivered", "--fence", _fence(database_url, message_id),
        "--reason", "found it", url=database_url,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected = aimed_at if keeps_partition else None
    assert _state(database_url, message_id) == ("delivered", expected, None)


@pytest.mark.parametrize("make", [_uncertain, _quarantined], ids=["uncertain", "quarantined"])
@pytest.mark.parametrize(
    ("flag", "to_state"), [("--pending", "pending"), ("--discard", "discarded")]
)
@pytest.mark.parametrize("force", [[], ["--force-before-deadline"]], ids=["", "forced-needlessly"])
def test_resolve_pending_or_discard_moves_the_message_with_a_decision(
    database_url: str,
    make: Callable[[str], uuid.UUID],
    flag: str,
    to_state: str,
    force: list[str],
) -> None:
    """resolve --pending / --discard moves an uncertain or quarantined message, with a decision.
    Its write deadline has passed: --force-before-deadline overrides nothing, and the
    decision's evidence does not say it was forced."""
    message_id = make(database_url)
    [(from_state,)] = fetch_rows(database_url, "SELECT state FROM outbox.messages")

    result = _outbox(
        "resolve",
        str(message_id),
        flag,
        *force,
        "--fence",
        _fence(database_url, message_id),
        "--reason",
        "checked by hand",
        url=database_url,
    )
    assert result.returncode == 0, result.stderr
    assert f"{from_state} -> {to_state}" in result.stdout
    [(state, available, escalated, last_error)] = fetch_rows(
        database_url,
        "SELECT state, available_at <= now(), escalated_at IS NULL, last_error "
        "FROM outbox.messages",
    )
    assert (state, available, escalated) == (to_state, True, True)
    assert last_error == f"{to_state} by an operator: checked by hand"
    [(decided_id, decided_by, was, now, reason, evidence)] = _decisions(database_url)
    assert decided_id == message_id
    assert decided_by.startswith("operator ")
    assert (was, now, reason, evidence) == (from_state, to_state, "checked by hand", {})
    store = claiming_store(database_url)
    claimed = store.claim(10, lease_seconds=30)
    store.close()
    assert (claimed is not None) == (to_state == "pending")


def _assert_refused(
    result: subprocess.CompletedProcess[str], database_url: str, before: list[tuple[Any, ...]]
) -> None:
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("outbox: ")
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
    assert fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq") == before
    assert _decisions(database_url) == []


def _assert_usage_error(
    result: subprocess.CompletedProcess[str], database_url: str, before: list[tuple[Any, ...]]
) -> None:
    """Refused for its arguments alone, before connecting: the command's usage and the
    error, exit 2, nothing changed."""
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("usage: outbox resolve ")
    assert result.stderr.splitlines()[-1].startswith("outbox resolve: error: ")
    assert "Traceback" not in result.stderr
    assert fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq") == before
    assert _decisions(database_url) == []


def test_resolve_refuses_a_pending_message_naming_its_state(database_url: str) -> None:
    """Resolving a pending message exits 2 and says it is pending."""
    message_id = _enqueue(database_url)
    before = fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq")
    result = _outbox("resolve", str(message_id), "--discard", "--reason", "x", url=database_url)
    _assert_refused(result, database_url, before)
    assert f"message {message_id} is pending" in result.stderr


def test_resolve_refuses_a_delivered_message_naming_its_state(database_url: str) -> None:
    """Resolving a delivered message exits 2 and says it is delivered."""
    message_id = _delivered(database_url)
    fence = _fence(database_url, message_id)
    before = fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq")
    result = _outbox(
        "resolve", str(message_id), "--pending", "--fence", fence, "--reason", "x", url=database_url
    )
    _assert_refused(result, database_url, before)
    assert f"message {message_id} is delivered" in result.stderr


def test_resolve_refuses_an_unknown_id(database_url: str) -> None:
    """Resolving an id that is not in the outbox exits 2 and says there is no such message."""
    _uncertain(database_url)
    before = fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq")
    unknown = uuid.uuid4()
    result = _outbox("resolve", str(unknown), "--discard", "--reason", "x", url=database_url)
    _assert_refused(result, database_url, before)
    assert f"no message {unknown}" in result.stderr


def test_resolve_without_a_reason_is_a_usage_error(database_url: str) -> None:
    """Leaving out --reason is refused by the argument parser with exit code 2."""
    message_id = _uncertain(database_url)
    result = _outbox("resolve", str(message_id), "--discard", url=database_url)
    assert result.returncode == 2
    assert "--reason" in result.stderr
    assert "required" in result.stderr
    assert _state(database_url, message_id)[0] == "uncertain"
    assert _decisions(database_url) == []


def test_resolve_refuses_an_offset_with_pending(database_url: str) -> None:
    """--offset with --pending exits 2 and says the location only goes with --delivered."""
    message_id = _uncertain(database_url)
    before = fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq")
    result = _outbox(
        "resolve", str(message_id), "--pending", "--offset", "3", "--reason", "x", url=database_url
    )
    _assert_usage_error(result, database_url, before)
    assert "only go with --delivered" in result.stderr


@pytest.mark.parametrize(
    ("location", "says"),
    [
        (["--offset", "5"], "go together"),
        (["--partition", "1"], "go together"),
        (["--partition", "-1", "--offset", "5"], "--partition: must be from 0 to"),
        (["--partition", "0", "--offset", "-7"], "--offset: must be from 0 to"),
        (["--partition", "2147483648", "--offset", "0"], "--partition: must be from 0 to"),
    ],
)
def test_resolve_delivered_refuses_a_location_half_given_or_negative(
    database_url: str, location: list[str], says: str
) -> None:
    """A record's location is a partition and an offset, both 0 or more: anything else
    is refused (exit 2) before the message is touched."""
    message_id = _uncertain(database_url)
    [(fence,)] = fetch_rows(
        database_url, "SELECT fence FROM outbox.messages WHERE id = %s", message_id
    )
    before = fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq")
    result = _outbox(
        "resolve", str(message_id), "--delivered", "--fence", str(fence), *location,
        "--reason", "seen in the topic", url=database_url,
    )  # fmt: skip
    _assert_usage_error(result, database_url, before)
    assert says in result.stderr


def test_reconcile_command_decides_found_and_absent_messages(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """outbox-publisher reconcile delivers the found message, returns the absent one, exits 0."""
    found = _enqueue(database_url, topic)
    absent = _enqueue(database_url, topic)
    partitions = make_uncertain(database_url)
    offset = send_record(kafka_bootstrap, topic, partitions[found], found)

    result = _reconcile(
        "--kafka-bootstrap", kafka_bootstrap, "--absence-grace", "0", url=database_url
    )
    assert result.returncode == 0, result.stderr
    assert "reconciled: 1 delivered, 1 pending (proven absent), 0 escalated" in result.stdout
    assert _state(database_url, found) == ("delivered", partitions[found], offset)
    assert _state(database_url, absent)[0] == "pending"
    assert fetch_rows(
        database_url, "SELECT count(*) FROM outbox.messages WHERE state = 'uncertain'"
    ) == [(0,)]
    decisions = _decisions(database_url)
    assert {(d[0], d[3]) for d in decisions} == {(found, "delivered"), (absent, "pending")}
    assert all(d[1].startswith("operator ") for d in decisions)
    assert all(d[1].endswith("(outbox-publisher reconcile)") for d in decisions)


def test_reconcile_command_whose_reader_went_away_still_decides_everything(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Its output piped to a reader that stopped reading (``| head -0``): no traceback, and
    the passes go on to their end (the first line broke the pipe, after the leases were
    recovered and before anything was reconciled)."""
    absent = _enqueue(database_url, topic)
    make_uncertain(database_url)
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader is gone before the first line
    try:
        result = subprocess.run(
            [sys.executable, "-m", "publisher", "reconcile", "--database-url", database_url,
             "--kafka-bootstrap", kafka_bootstrap, "--absence-grace", "0"],
            stdout=write_fd,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )  # fmt: skip
    finally:
        os.close(write_fd)
    assert (result.returncode, result.stderr) == (0, "")
    assert _state(database_url, absent)[0] == "pending"


def test_reconcile_command_says_until_when_a_message_waits_for_the_absence_grace(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Not found, but the grace after its write deadline has not passed: deferred, and the
    command says until when (the time to run it again, in UTC whatever the session's time
    zone), not to decide it by hand."""
    _enqueue(database_url, topic)
    make_uncertain(database_url)
    result = _reconcile(
        "--kafka-bootstrap", kafka_bootstrap, "--absence-grace", "3600", url=database_url,
        env={"PGTZ": "Asia/Tokyo"},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "0 escalated, 1 deferred" in result.stdout
    [(until,)] = fetch_rows(
        database_url,
        "SELECT to_char((available_at + interval '1 hour') AT TIME ZONE 'UTC', "
        "'YYYY-MM-DD HH24:MI:SS') FROM outbox.messages",
    )
    assert (
        f"1 wait for their write deadline and the absence grace, until {until} UTC at the "
        "latest: run this again then"
    ) in result.stdout
    assert "escalated:" not in result.stdout


def _escalated_by_reconcile(
    database_url: str, kafka_bootstrap: str
) -> tuple[uuid.UUID, subprocess.CompletedProcess[str]]:
    """An uncertain message whose topic was deleted, and the reconcile run that escalated it
    (its evidence is gone)."""
    gone = f"outbox-test-{uuid.uuid4().hex[:12]}"
    create_topic(kafka_bootstrap, gone, partitions=3)
    message_id = _enqueue(database_url, gone)
    make_uncertain(database_url)
    delete_topic(kafka_bootstrap, gone)
    result = _reconcile(
        "--kafka-bootstrap", kafka_bootstrap, "--absence-grace", "0", url=database_url
    )
    return message_id, result


def test_reconcile_command_exits_1_when_a_message_is_escalated(
    database_url: str, kafka_bootstrap: str
) -> None:
    """outbox-publisher reconcile exits 1 when evidence is gone and a message stays uncertain."""
    message_id, result = _escalated_by_reconcile(database_url, kafka_bootstrap)
    assert result.returncode == 1, result.stderr
    assert "0 delivered, 0 pending (proven absent), 1 escalated" in result.stdout
    assert (
        "1 escalated: the reconciler could not decide them; decide each with `outbox resolve`"
        in result.stdout
    )
    assert " wait for " not in result.stdout
    [(state, escalated)] = fetch_rows(
        database_url, "SELECT state, escalated_at IS NOT NULL FROM outbox.messages"
    )
    assert (state, escalated) == ("uncertain", True)
    [decision] = _decisions(database_url)
    assert (decision[0], decision[3]) == (message_id, "uncertain")


def test_a_refusal_names_a_fence_never_reached_and_an_escalation_as_such(
    database_url: str, kafka_bootstrap: str
) -> None:
    """A fence above the message's own was never its fence (a typo, not a change since);
    the reconciler's escalation shows as "escalated", not "uncertain -> uncertain"."""
    message_id, reconciled = _escalated_by_reconcile(database_url, kafka_bootstrap)
    assert "1 escalated" in reconciled.stdout, reconciled.stderr
    now = _fence(database_url, message_id)

    refused = _outbox(
        "resolve", str(message_id), "--pending", "--fence", "99", "--reason", "r",
        url=database_url,
    )  # fmt: skip
    assert refused.returncode == 2
    [line] = refused.stderr.splitlines()
    assert line.startswith(
        f"outbox: message {message_id} was never at fence 99, the fence this decision names: "
        f"it is uncertain at fence {now}"
    )
    assert "; last decision escalated by operator " in line


def test_reconcile_command_says_why_a_session_it_cannot_fence_waits(
    database_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """An ACL denies the fence: the command defers the message, prints why and what to
    grant, and exits 1 with the message still uncertain."""
    waiting = _enqueue(database_url, topic)
    session = f"outbox-{uuid.uuid4()}-1"
    make_uncertain_in_transaction(database_url, session)
    acl = deny(kafka_bootstrap, ResourceType.TRANSACTIONAL_ID, session, ACLOperation.WRITE)
    try:
        result = _reconcile("--kafka-bootstrap", kafka_bootstrap, url=database_url)
    finally:
        allow_again(kafka_bootstrap, acl)
    assert result.returncode == 1, result.stderr
    assert "0 escalated, 1 deferred" in result.stdout
    assert (
        f"  1 of them: reconciliation waits: the producer session {session} that sent it "
        "could not be fenced (TransactionalIdAuthorizationFailedError); grant "
    ) in result.stdout
    assert "1 undecided for now: their last_error says why" in result.stdout
    assert _state(database_url, waiting)[0] == "uncertain"


def test_reconcile_command_without_kafka_is_a_usage_error(database_url: str) -> None:
    """outbox-publisher reconcile with no Kafka exits 2 and names the flag and the variable."""
    message_id = _uncertain(database_url)
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_KAFKA_BOOTSTRAP"}
    result = subprocess.run(
        [sys.executable, "-m", "publisher", "reconcile", "--database-url", database_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert result.returncode == 2
    assert "--kafka-bootstrap" in result.stderr
    assert "OUTBOX_KAFKA_BOOTSTRAP" in result.stderr
    assert _state(database_url, message_id)[0] == "uncertain"
    assert _decisions(database_url) == []


def test_outbox_reconcile_names_the_publisher_command_and_its_extra(database_url: str) -> None:
    """outbox reconcile, old flags and all, decides nothing, exits 2 and says what to run."""
    message_id = _uncertain(database_url)
    result = _outbox("reconcile", "--kafka-bootstrap", "localhost:1", url=database_url)
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert "`outbox-publisher reconcile`" in line
    assert "pip install 'pg-kafka-outbox[publisher]'" in line
    assert _state(database_url, message_id)[0] == "uncertain"
    assert _decisions(database_url) == []


# --- decisions name the fence they were made from ------------------------------


def test_resolve_pending_or_delivered_without_a_fence_is_refused(database_url: str) -> None:
    """resolve --pending / --delivered without --fence exits 2, names --fence, moves nothing."""
    message_id = _uncertain(database_url)
    before = fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq")
    for flag in ("--pending", "--delivered"):
        result = _outbox("resolve", str(message_id), flag, "--reason", "x", url=database_url)
        _assert_usage_error(result, database_url, before)
        assert f"{flag} needs --fence N" in result.stderr
        assert f"outbox inspect {message_id}" in result.stderr


def test_a_pending_decision_from_a_stale_reading_is_refused(database_url: str) -> None:
    """Two operators read the same uncertain message; the first sends it again and that
    attempt is uncertain too: the second's --pending, made from the first reading, is refused
    with exit 2 naming what changed, and the message is not sent a third time."""
    message_id = _uncertain(database_url)
    read = _fence(database_url, message_id)
    first = _outbox(
        "resolve",
        str(message_id),
        "--pending",
        "--fence",
        read,
        "--reason",
        "absent",
        url=database_url,
    )
    assert first.returncode == 0, first.stderr
    assert set(make_uncertain(database_url)) == {message_id}  # the retry is uncertain again
    now = _fence(database_url, message_id)

    second = _outbox(
        "resolve",
        str(message_id),
        "--pending",
        "--fence",
        read,
        "--reason",
        "absent",
        url=database_url,
    )

    assert second.returncode == 2
    assert second.stdout == ""
    [line] = second.stderr.splitlines()
    assert line.startswith(f"outbox: message {message_id} changed since fence {read}")
    assert f"it is uncertain at fence {now}, after 2 attempt(s)" in line
    assert "last decision uncertain -> pending by operator " in line
    assert f"run `outbox inspect {message_id}`" in line
    assert _state(database_url, message_id)[0] == "uncertain"
    assert [d[3] for d in _decisions(database_url)] == ["pending"]


def test_a_discard_from_a_stale_reading_of_a_retried_message_is_refused(
    database_url: str,
) -> None:
    """An operator retries a quarantined message; another, who read it quarantined, discards
    it with the fence read: refused (exit 2), the message stays pending for its retry."""
    message_id = _quarantined(database_url)
    read = _fence(database_url, message_id)
    retried = _outbox(
        "retry", str(message_id), "--fence", read, "--reason", "limit raised", url=database_url
    )
    assert retried.returncode == 0, retried.stderr
    assert retried.stderr == ""

    discarded = _outbox(
        "discard", str(message_id), "--fence", read, "--reason", "too big", url=database_url
    )

    assert discarded.returncode == 2
    assert f"message {message_id} changed since fence {read}" in discarded.stderr
    assert "last decision quarantined -> pending" in discarded.stderr
    assert _state(database_url, message_id)[0] == "pending"
    assert [d[3] for d in _decisions(database_url)] == ["pending"]


def test_a_decision_without_a_fence_applies_with_a_warning(database_url: str) -> None:
    """discard (and retry) without --fence decide, exit 0, and warn that nothing was checked."""
    message_id = _quarantined(database_url)
    result = _outbox("discard", str(message_id), "--reason", "obsolete", url=database_url)
    assert result.returncode == 0, result.stderr
    assert "quarantined -> discarded" in result.stdout
    [warning] = result.stderr.splitlines()
    assert warning.startswith("outbox: warning: no --fence given")
    assert f"outbox inspect {message_id}" in warning
    assert _state(database_url, message_id)[0] == "discarded"


def test_list_and_inspect_show_the_fence_a_decision_names(database_url: str) -> None:
    """outbox list (table and JSON) and inspect show the message's fence, the same number."""
    message_id = _quarantined(database_url)
    fence = _fence(database_url, message_id)
    listed = _outbox("list", "--state", "quarantined", "--json", url=database_url)
    assert listed.returncode == 0, listed.stderr
    [shown] = json.loads(listed.stdout)["messages"]
    assert str(shown["fence"]) == fence
    table = _outbox("list", "--state", "quarantined", url=database_url)
    header, row = table.stdout.splitlines()
    assert header.split()[5] == "FENCE"
    assert row.split()[5] == fence
    story = _outbox("inspect", str(message_id), url=database_url)
    assert f"outbox retry ID --fence {fence}" in story.stdout


# --- --pending waits until nothing can write the record -------------------------


def test_resolve_pending_before_the_write_deadline_is_refused_unless_forced(
    database_url: str,
) -> None:
    """--pending on an uncertain message whose producer may still write it exits 2 and names
    the deadline; --force-before-deadline decides anyway and records that it was forced."""
    message_id, deadline = _uncertain_until(database_url, 600)
    fence = _fence(database_url, message_id)
    before = fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq")

    refused = _outbox(
        "resolve",
        str(message_id),
        "--pending",
        "--fence",
        fence,
        "--reason",
        "absent",
        url=database_url,
    )

    _assert_refused(refused, database_url, before)
    assert f"may still be written by the producer that sent it until {deadline.isoformat()}" in (
        refused.stderr
    )
    assert "--force-before-deadline" in refused.stderr

    _assert_forced(database_url, message_id, fence, "pending")


def _assert_forced(database_url: str, message_id: uuid.UUID, fence: str, to_state: str) -> None:
    """``resolve --pending|--discard --force-before-deadline`` decides, recording that it
    was forced."""
    resolution = "--pending" if to_state == "pending" else "--discard"
    forced = _outbox(
        "resolve",
        str(message_id),
        resolution,
        "--fence",
        fence,
        "--force-before-deadline",
        "--reason",
        "the producer host is gone for good",
        url=database_url,
    )
    assert forced.returncode == 0, forced.stderr
    assert _state(database_url, message_id)[0] == to_state
    [decision] = _decisions(database_url)
    assert decision[5] == {"forced_before_deadline": True}


@pytest.mark.parametrize("command", [("discard",), ("resolve", "--discard")])
def test_discarding_an_uncertain_message_before_the_write_deadline_is_refused_unless_forced(
    database_url: str, command: tuple[str, ...]
) -> None:
    """A discard releases the key: while the record may still be written, a later message of
    the key could be sent first and the discarded one land after it. Refused (exit 2, naming
    the deadline); resolve --discard --force-before-deadline decides anyway."""
    message_id = _enqueue(database_url)
    make_uncertain(database_url, write_deadline_seconds=600)
    fence = _fence(database_url, message_id)
    before = fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq")

    refused = _outbox(*command[:1], str(message_id), *command[1:], "--reason", "obsolete",
                      url=database_url)  # fmt: skip

    _assert_refused(refused, database_url, before)
    assert "may still be written by the producer that sent it until" in refused.stderr
    assert "after later messages of the key" in refused.stderr
    assert (
        f"`outbox resolve {message_id} --discard --force-before-deadline --reason TEXT` overrides "
        "this check" in refused.stderr
    )

    _assert_forced(database_url, message_id, fence, "discarded")


def _refused_while_unfenced(
    database_url: str, resolution: str
) -> tuple[uuid.UUID, tuple[str, ...], subprocess.CompletedProcess[str]]:
    """An uncertain message sent in a Kafka transaction whose session is not fenced yet, and
    ``outbox resolve ID <resolution>`` refused on it (exit 2, naming the session): the
    message, the command's arguments, and its result."""
    message_id = _enqueue(database_url)
    session = f"outbox-test-session-{uuid.uuid4().hex[:6]}"
    make_uncertain_in_transaction(database_url, session)
    fence = _fence(database_url, message_id)
    before = fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq")
    args = ("resolve", str(message_id), resolution, "--fence", fence, "--reason", "checked")
    refused = _outbox(*args, url=database_url)
    _assert_refused(refused, database_url, before)
    assert f"producer session {session}, which has not been fenced" in refused.stderr
    return message_id, args, refused


def test_resolve_pending_of_an_unfenced_transaction_names_the_reconciler(
    database_url: str,
) -> None:
    """--pending on a message sent in a Kafka transaction whose session is not fenced yet exits
    2 and says outbox-publisher reconcile fences and decides it; once the reconciler fenced the
    session (and escalated the message), --pending applies."""
    message_id, args, refused = _refused_while_unfenced(database_url, "--pending")
    assert "`outbox-publisher reconcile`: it fences the session" in refused.stderr

    # What the reconciler leaves after fencing the session, when the evidence is gone.
    fetch_rows(
        database_url,
        "UPDATE outbox.messages SET escalated_at = now(), last_error = 'topic deleted' "
        "RETURNING id",
    )
    decided = _outbox(*args, url=database_url)
    assert decided.returncode == 0, decided.stderr
    assert _state(database_url, message_id)[0] == "pending"


def test_resolve_delivered_before_the_write_deadline_applies(database_url: str) -> None:
    """--delivered sends nothing, so the write deadline does not hold it back."""
    message_id = _enqueue(database_url)
    make_uncertain(database_url, write_deadline_seconds=600)
    fence = _fence(database_url, message_id)
    result = _outbox(
        "resolve",
        str(message_id),
        "--delivered",
        "--fence",
        fence,
        "--reason",
        "seen in topic",
        url=database_url,
    )
    assert result.returncode == 0, result.stderr
    assert _state(database_url, message_id)[0] == "delivered"


def test_resolve_pending_waits_the_absence_grace_after_the_write_deadline(
    database_url: str,
) -> None:
    """Just after the write deadline a record written by then may not be readable yet (its
    in-sync followers have not all copied it): not finding it proves nothing, so --pending
    is refused until the absence grace has passed too, naming when; --discard is not."""
    message_id, deadline = _uncertain_until(database_url, -1.0)
    fence = _fence(database_url, message_id)
    before = fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq")

    refused = _outbox("resolve", str(message_id), "--pending", "--fence", fence,
                      "--reason", "absent", url=database_url)  # fmt: skip

    _assert_refused(refused, database_url, before)
    decidable = deadline + timedelta(seconds=ABSENCE_GRACE_SECONDS)
    assert f"may have been written by its write deadline ({deadline.isoformat()})" in (
        refused.stderr
    )
    assert f"Decide it from {decidable.isoformat()} on" in refused.stderr
    discarded = _outbox("resolve", str(message_id), "--discard", "--fence", fence,
                        "--reason", "obsolete", url=database_url)  # fmt: skip
    assert discarded.returncode == 0, discarded.stderr


def test_resolve_delivered_of_an_unfenced_transaction_is_refused_unless_forced(
    database_url: str,
) -> None:
    """A record read in a transaction that is not committed may yet be aborted: --delivered
    of a message whose session is unfenced is refused (exit 2, naming the reconciler);
    --force-before-deadline decides it, recorded as forced."""
    message_id, args, refused = _refused_while_unfenced(database_url, "--delivered")
    assert "may yet be aborted with that transaction" in refused.stderr
    forced = _outbox(*args, "--force-before-deadline", url=database_url)
    assert forced.returncode == 0, forced.stderr
    assert _state(database_url, message_id)[0] == "delivered"
    [decision] = _decisions(database_url)
    assert decision[5] == {"forced_before_deadline": True}


def _overtaken_quarantined(database_url: str) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """Two messages of a key sent in one batch: the first refused for good (quarantined),
    the second written; and a quarantined message of another key that nothing overtook."""
    with psycopg.connect(database_url) as conn:
        first, second, alone = outbox.enqueue_many(
            conn,
            [
                outbox.Message("t", b"1", key="K"),
                outbox.Message("t", b"2", key="K"),
                outbox.Message("t", b"3", key="other"),
            ],
        )
    store = claiming_store(database_url)
    try:
        batch = store.claim(10, lease_seconds=30)
        assert batch is not None
        fences = {m.id: m.fence for m in batch.messages}

        def refused(message_id: uuid.UUID) -> Settlement:
            return Settlement(message_id, fences[message_id], State.QUARANTINED,
                              AttemptOutcome.FAILED, error="MessageSizeTooLargeError",
                              send_began=False)  # fmt: skip

        store.settle(
            batch,
            [
                refused(first),
                Settlement(
                    second,
                    fences[second],
                    State.DELIVERED,
                    AttemptOutcome.DELIVERED,
                    partition=0,
                    offset=7,
                ),
                refused(alone),
            ],
        )
    finally:
        store.close()
    return first, second, alone


def test_retry_of_a_message_a_later_one_of_its_key_overtook_is_refused_unless_out_of_order(
    database_url: str,
) -> None:
    """Sent again, a quarantined message whose key's later message is already in Kafka would
    reach consumers after it: retry ID is refused (exit 2, naming that message) unless
    --out-of-order, recorded in the decision's evidence."""
    first, second, _ = _overtaken_quarantined(database_url)
    fence = _fence(database_url, first)
    before = fetch_rows(database_url, "SELECT * FROM outbox.messages ORDER BY seq")

    refused = _outbox("retry", str(first), "--fence", fence, url=database_url)

    _assert_refused(refused, database_url, before)
    assert f"later messages of its key may already be in Kafka: {second} (delivered)" in (
        refused.stderr
    )
    assert f"`outbox retry {first} --out-of-order`" in refused.stderr
    retried = _outbox("retry", str(first), "--fence", fence, "--out-of-order", url=database_url)
    assert retried.returncode == 0, retried.stderr
    assert _state(database_url, first)[0] == "pending"
    [decision] = _decisions(database_url)
    assert decision[5] == {"sent_after": [str(second)], "sent_after_count": 1}


def test_retry_quarantined_leaves_a_message_a_later_one_of_its_key_overtook(
    database_url: str,
) -> None:
    """retry --quarantined sends the others again and leaves the overtaken one quarantined,
    naming it and the command that decides it; exit 1, something is left for a person."""
    first, second, alone = _overtaken_quarantined(database_url)

    result = _outbox("retry", "--quarantined", "--reason", "fixed", url=database_url)

    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith("1 quarantined message(s) -> pending (fixed)\n")
    assert (
        f"left quarantined: {first}: later messages of its key may already be in Kafka: "
        f"{second} (delivered); `outbox retry {first} --out-of-order`"
    ) in result.stdout
    assert (_state(database_url, first)[0], _state(database_url, alone)[0]) == (
        "quarantined",
        "pending",
    )
    assert [d[0] for d in _decisions(database_url)] == [alone]


def test_retry_of_a_message_whose_last_batch_was_purged_cannot_tell_what_overtook_it(
    database_url: str,
) -> None:
    """Retention purged the record of the batch that last sent it (its evidence window
    passed): what was sent with it cannot be told, so a retry is refused unless
    --out-of-order, saying so, and retry --quarantined leaves it."""
    first, _, _ = _overtaken_quarantined(database_url)
    fetch_rows(database_url, "DELETE FROM outbox.batches RETURNING id")  # as purge_batches does
    fence = _fence(database_url, first)

    refused = _outbox("retry", str(first), "--fence", fence, url=database_url)

    assert refused.returncode == 2, refused.stderr
    assert "whether later messages of its key were sent with it cannot be told" in refused.stderr
    left = _outbox("retry", "--quarantined", url=database_url)
    assert left.returncode == 1, left.stderr
    assert f"left quarantined: {first}: whether later messages" in left.stdout
    retried = _outbox("retry", str(first), "--fence", fence, "--out-of-order", url=database_url)
    assert retried.returncode == 0, retried.stderr
    assert _state(database_url, first)[0] == "pending"
