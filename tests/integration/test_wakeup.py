"""Commits wake a sleeping publisher, notify only while one sleeps, and miss no publisher.

A publisher announces its sleep by holding ``outbox.wakeup`` (``Waker.fall_asleep``);
an enqueuing transaction notifies as it commits only if it cannot take that lock.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.migrations import migrate
from publisher.app import build_publisher
from publisher.loop import Publisher
from publisher.waker import Waker
from tests.support import count_by_state, publisher_config, wait_until

pytestmark = pytest.mark.integration

#: Far longer than any wait below: a delivery within the wait proves a NOTIFY woke it.
LONG_POLL = 60.0
#: The application name of a waker's announcing connection.
ANNOUNCER = "outbox-publisher wakeup"


class Notifications:
    """A LISTEN session of the test's own, counting what commits sent."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.conn = psycopg.connect(database_url, autocommit=True)
        self.conn.execute("LISTEN outbox_pending")

    def since_last(self) -> int:
        """Notifications of the commits made since the last call.

        A sentinel is sent now: notifications arrive in commit order, so every
        earlier commit's notification is in before it, and none is waited for.
        """
        with psycopg.connect(self.database_url, autocommit=True) as other:
            other.execute("SELECT pg_notify('outbox_pending', 'sentinel')")
        for count, note in enumerate(self.conn.notifies(timeout=10)):
            if note.payload == "sentinel":
                return count
        raise AssertionError("the sentinel notification did not come within 10 s")

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def notifications(database_url: str) -> Iterator[Notifications]:
    """Counts the notifications of commits to the test's database."""
    listening = Notifications(database_url)
    yield listening
    listening.close()


@pytest.fixture
def waker(database_url: str) -> Iterator[Waker]:
    """A waker on the test's database, its thread not started: its announcements only."""
    announcing = Waker(database_url)
    yield announcing
    announcing.stop()


def _commit_enqueue(database_url: str, topic: str = "orders", **settings: Any) -> uuid.UUID:
    with psycopg.connect(database_url, **settings) as conn:
        return outbox.enqueue(conn, topic, b"wake up")


def _sleeping(database_url: str) -> int:
    """How many sessions hold outbox.wakeup as an announced sleep does."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE relation = 'outbox.wakeup'::regclass "
            "AND mode = 'ShareLock' AND granted"
        ).fetchone()
    return int(row[0]) if row else 0


def _announcement_waiting(database_url: str) -> bool:
    """Whether a waker's announcement in this database waits for a lock now."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = %s AND wait_event_type = 'Lock'",
            (ANNOUNCER,),
        ).fetchone()
    return row is not None and row[0] > 0


def test_commits_notify_only_while_a_publisher_sleeps(
    database_url: str, notifications: Notifications, waker: Waker
) -> None:
    """With no publisher asleep, commits send nothing; announced asleep, each commit notifies
    once (several rows too); awake again, nothing."""
    for _ in range(3):
        _commit_enqueue(database_url)
    assert notifications.since_last() == 0

    assert waker.fall_asleep() is True
    assert waker.fall_asleep() is False  # announced already
    assert _sleeping(database_url) == 1
    _commit_enqueue(database_url)
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(conn, [outbox.Message("orders", b"x") for _ in range(5)])
    assert notifications.since_last() == 2

    waker.awake()
    assert _sleeping(database_url) == 0
    _commit_enqueue(database_url)
    assert notifications.since_last() == 0


def test_a_publisher_stopped_while_asleep_does_not_make_every_commit_notify_for_ever(
    database_url: str, notifications: Notifications
) -> None:
    """Announced asleep, then stopped (SIGSTOP, a paused host) before it wakes: its lock on
    outbox.wakeup would make every writer's commit notify for as long as it stays stopped.
    The server ends the announcer's session once its transaction has been idle its limit;
    woken, it announces again on a new connection."""
    frozen = Waker(database_url, idle_transaction_limit=0.5)
    try:
        assert frozen.fall_asleep() is True
        assert _sleeping(database_url) == 1
        # ... and the process stops here: no wait, no awake.
        wait_until(lambda: _sleeping(database_url) == 0, timeout=10, what="the lock to go")
        notifications.since_last()
        _commit_enqueue(database_url)
        assert notifications.since_last() == 0
        frozen.awake()  # woken: its connection is gone, and is opened again
        assert frozen.fall_asleep() is True
        assert _sleeping(database_url) == 1
    finally:
        frozen.stop()


def test_a_sleep_stays_announced_through_a_wake_up_until_work_or_its_time_is_up(
    database_url: str, waker: Waker
) -> None:
    """Woken, the publisher stays announced (its claim comes at once, no lock to give up
    first); a claim that found work ends the announcement, and so does a wait that runs
    out, or any wait once the announcement is older than the wait's timeout."""
    assert waker.fall_asleep()
    waker.wake()
    assert waker.wait(5) is True
    assert waker.announced
    assert _sleeping(database_url) == 1
    waker.awake()  # the claim found work
    assert not waker.announced
    assert _sleeping(database_url) == 0

    assert waker.fall_asleep()
    assert waker.wait(0.01) is False
    assert not waker.announced
    assert _sleeping(database_url) == 0

    assert waker.fall_asleep()
    waker.wake()
    assert waker.wait(0) is True  # woken, but the announcement is older than 0 s
    assert not waker.announced
    assert _sleeping(database_url) == 0


def test_a_writer_notifies_a_publisher_that_fell_asleep_after_its_snapshot(
    database_url: str, notifications: Notifications, waker: Waker
) -> None:
    """A REPEATABLE READ writer whose snapshot predates the announcement still notifies:
    the decision is a lock, taken at commit, not a read under the writer's snapshot."""
    with psycopg.connect(database_url) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.execute("SELECT count(*) FROM outbox.messages")  # the snapshot is taken here
        assert waker.fall_asleep()
        outbox.enqueue(conn, "orders", b"late")
    assert notifications.since_last() == 1


def test_a_commit_that_did_not_notify_is_visible_once_the_sleep_is_announced(
    database_url: str, notifications: Notifications, waker: Waker
) -> None:
    """The race: a writer decided no publisher sleeps, and commits only after a publisher
    found nothing. The announcement waits for that commit (past its lock timeout it gives
    up this once, unannounced, and says claim again); once granted, the message is visible."""
    with psycopg.connect(database_url) as writer:
        # The trigger fires now instead of at commit: the decision is taken and held.
        writer.execute("SET CONSTRAINTS outbox.messages_notify_pending IMMEDIATE")
        message_id = outbox.enqueue(writer, "orders", b"decided early")

        started = time.monotonic()
        assert waker.fall_asleep() is True  # claim again: a writer is committing
        assert time.monotonic() - started >= 0.4
        assert not waker.announced

        with ThreadPoolExecutor(1) as pool:
            announcing = pool.submit(waker.fall_asleep)
            wait_until(
                lambda: _announcement_waiting(database_url),
                timeout=5,
                what="the announcement to wait for the writer",
            )
            writer.commit()
            assert announcing.result(timeout=5) is True
    assert waker.announced
    with psycopg.connect(database_url) as conn:
        assert conn.execute(
            "SELECT count(*) FROM outbox.messages WHERE id = %s", (message_id,)
        ).fetchone() == (1,)
    assert notifications.since_last() == 0  # the writer's commit sent nothing


def test_a_writer_without_the_grant_notifies_on_every_commit(
    database_url: str, notifications: Notifications
) -> None:
    """A writer role granted only what enqueues needed before (no INSERT on outbox.wakeup)
    still enqueues, and its commits notify as they always did."""
    role = f"old_writer_{uuid.uuid4().hex[:8]}"
    name = sql.Identifier(role)
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {}").format(name))
        admin.execute(sql.SQL("GRANT USAGE ON SCHEMA outbox TO {}").format(name))
        admin.execute(
            sql.SQL(
                "GRANT INSERT (id, topic, key, value, header_names, header_values, "
                "idempotency_key), SELECT (id, idempotency_key) ON outbox.messages TO {}"
            ).format(name)
        )
    try:
        with psycopg.connect(database_url) as conn:
            conn.execute(sql.SQL("SET ROLE {}").format(name))
            outbox.enqueue(conn, "orders", b"old grants")
        assert notifications.since_last() == 1
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(name))
            admin.execute(sql.SQL("DROP ROLE {}").format(name))


def test_a_schema_without_outbox_wakeup_leaves_the_publisher_to_notifications(
    empty_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Against a schema older than outbox.wakeup (whose trigger notifies on every commit),
    the announcement fails, is logged once, and is not announced."""
    migrate(empty_database_url, target=10)  # the schema before 0011_wakeup
    waker = Waker(empty_database_url)
    try:
        with caplog.at_level(logging.WARNING, logger="publisher.waker"):
            assert waker.fall_asleep() is False
            assert waker.fall_asleep() is False
        assert not waker.announced
        refusals = [r for r in caplog.records if "cannot announce" in r.getMessage()]
        assert len(refusals) == 1
        assert "wakeup" in refusals[0].getMessage()
    finally:
        waker.stop()


@contextmanager
def _publisher_running(
    database_url: str, kafka_bootstrap: str, poll_interval: float = LONG_POLL
) -> Iterator[Publisher]:
    """A real publisher in a thread, listening, stopped afterwards."""
    publisher = build_publisher(
        publisher_config(
            database_url, kafka_bootstrap, exit_when_idle=False, poll_interval=poll_interval
        )
    )
    thread = threading.Thread(target=publisher.run, daemon=True)
    thread.start()
    try:
        wait_until(publisher.waker.listening.is_set, timeout=10, what="the listener")
        yield publisher
    finally:
        publisher.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.fixture
def running_publisher(database_url: str, kafka_bootstrap: str) -> Iterator[Publisher]:
    """A real publisher in a thread, polling only every minute."""
    with _publisher_running(database_url, kafka_bootstrap) as publisher:
        yield publisher


def _wait_delivered(database_url: str, count: int, timeout: float = 10) -> None:
    """Until exactly ``count`` messages are delivered and nothing else is left."""
    wait_until(
        lambda: count_by_state(database_url) == {"delivered": count},
        timeout=timeout,
        interval=0.01,
        what=f"{count} messages delivered",
    )


def _enqueue_and_time_delivery(database_url: str, topic: str) -> float:
    _commit_enqueue(database_url, topic)
    committed = time.monotonic()
    _wait_delivered(database_url, 1)
    return time.monotonic() - committed


def _listener_backends(database_url: str) -> list[int]:
    with psycopg.connect(database_url) as conn:
        return [
            pid
            for (pid,) in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = 'outbox-publisher listener'"
            )
        ]


def test_commit_wakes_the_publisher(
    database_url: str, topic: str, running_publisher: Publisher
) -> None:
    """A commit to a publisher announced asleep is delivered long before the poll interval
    comes round, time after time."""
    for delivered in range(1, 6):
        wait_until(lambda: _sleeping(database_url) == 1, timeout=10, what="an announced sleep")
        _commit_enqueue(database_url, topic)
        committed = time.monotonic()
        _wait_delivered(database_url, delivered)
        assert time.monotonic() - committed < 5.0


def test_listener_reconnects_after_its_connection_is_killed(
    database_url: str, topic: str, running_publisher: Publisher
) -> None:
    """After the LISTEN backend is terminated, the waker reconnects and NOTIFY works again."""
    [backend] = _listener_backends(database_url)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
    wait_until(
        lambda: _listener_backends(database_url) not in ([], [backend]),
        timeout=15,
        what="a new listener connection",
    )
    wait_until(running_publisher.waker.listening.is_set, timeout=10, what="listening again")
    assert _enqueue_and_time_delivery(database_url, topic) < 5.0


def test_a_busy_publisher_is_not_notified(
    database_url: str, kafka_bootstrap: str, topic: str, notifications: Notifications
) -> None:
    """While a publisher works through a backlog, commits send no notification; once it
    has caught up and sleeps, the next commit notifies it and is delivered at once."""
    with psycopg.connect(database_url) as conn:
        outbox.enqueue_many(conn, [outbox.Message(topic, b"backlog") for _ in range(20_000)])
    publisher = build_publisher(
        publisher_config(
            database_url,
            kafka_bootstrap,
            exit_when_idle=False,
            poll_interval=LONG_POLL,
            batch_size=100,
        )
    )
    thread = threading.Thread(target=publisher.run, daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: count_by_state(database_url).get("delivered", 0) > 0,
            timeout=30,
            what="the publisher at work",
        )
        with psycopg.connect(database_url) as conn:
            for i in range(20):
                outbox.enqueue(conn, topic, f"while busy {i}".encode())
                conn.commit()
        sent = notifications.since_last()
        still_pending = count_by_state(database_url).get("pending", 0)
        assert still_pending > 0, "the backlog ran out: the publisher was not busy throughout"
        assert sent == 0

        _wait_delivered(database_url, 20_020, timeout=120)
        wait_until(lambda: _sleeping(database_url) == 1, timeout=10, what="an announced sleep")
        _commit_enqueue(database_url, topic)
        committed = time.monotonic()
        assert notifications.since_last() == 1
        _wait_delivered(database_url, 20_021)
        assert time.monotonic() - committed < 5.0
    finally:
        publisher.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_publisher_that_falls_asleep_during_a_commit_without_notification_delivers_it(
    database_url: str, kafka_bootstrap: str, topic: str, notifications: Notifications
) -> None:
    """The race with the real loop: a writer decides, while no publisher is announced
    asleep, not to notify; the publisher's sleep then runs out, it finds nothing (the writer
    has not committed) and falls asleep again; the writer commits. Its message is delivered
    at once, not a poll interval later, with no notification: the announcement waited for
    that commit and the loop claimed once more after it."""
    poll = 3.0
    with _publisher_running(database_url, kafka_bootstrap, poll_interval=poll):
        wait_until(lambda: _sleeping(database_url) == 1, timeout=10, what="an announced sleep")
        # The announcing session ends (as idle_in_transaction_session_timeout would end
        # it): until this sleep runs out, writers see nobody asleep.
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = %s",
                (ANNOUNCER,),
            )
        wait_until(lambda: _sleeping(database_url) == 0, timeout=10, what="no announcement")
        with psycopg.connect(database_url) as writer:
            writer.execute("SET CONSTRAINTS outbox.messages_notify_pending IMMEDIATE")
            outbox.enqueue(writer, topic, b"decided while nobody slept")
            wait_until(
                lambda: _announcement_waiting(database_url),
                timeout=poll + 10,
                what="the publisher falling asleep again, its announcement held up by the writer",
            )
            writer.commit()
        committed = time.monotonic()
        _wait_delivered(database_url, 1)
        assert time.monotonic() - committed < poll / 2
    assert notifications.since_last() == 0
