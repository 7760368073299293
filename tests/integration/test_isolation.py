"""The publisher's connections run at READ COMMITTED whatever the database's default."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

import outbox
from publisher.connector import connect
from publisher.metrics import StatusReader
from tests.support import assert_each_delivered_once, claiming_store, publish_until_idle

pytestmark = pytest.mark.integration

SHOW = "SHOW transaction_isolation"


def _show(conn: psycopg.Connection[Any]) -> object:
    row = conn.execute(SHOW).fetchone()
    assert row is not None
    return row[0]


@pytest.fixture
def serializable_url(database_url: str) -> str:
    """The test's database, where every new session defaults to SERIALIZABLE."""
    name = urlsplit(database_url).path.lstrip("/")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = 'serializable'").format(
                sql.Identifier(name)
            )
        )
    with psycopg.connect(database_url) as conn:
        # The premise: a connection that does not pin its level gets the default.
        assert _show(conn) == "serializable"
    return database_url


def test_the_store_connection_runs_at_read_committed(serializable_url: str) -> None:
    """The store's statements, on their own or in a transaction block, run at READ COMMITTED."""
    store = claiming_store(serializable_url)
    try:
        assert _show(store.conn) == "read committed"
        with store.conn.transaction():
            assert _show(store.conn) == "read committed"
    finally:
        store.close()


def test_the_status_reader_connection_runs_at_read_committed(serializable_url: str) -> None:
    """The metrics' status reader reads at READ COMMITTED, with JIT off (with a large
    backlog, compiling its counts could take longer than running them)."""
    seen: list[object] = []

    def read(conn: psycopg.Connection[Any]) -> list[Any]:
        seen.append(_show(conn))
        seen.append(conn.execute("SHOW jit").fetchone())
        return []

    reader = StatusReader(serializable_url, read=read)
    try:
        assert reader() == []
    finally:
        reader.close()
    assert seen == ["read committed", ("off",)]


def test_a_connection_in_transactions_keeps_read_committed_after_a_rollback(
    serializable_url: str,
) -> None:
    """A connection that is not in autocommit mode (retention's) stays at READ COMMITTED
    after a transaction of it is rolled back."""
    with connect(serializable_url) as conn:
        assert _show(conn) == "read committed"
        conn.rollback()
        assert _show(conn) == "read committed"


def test_a_publisher_delivers_where_the_database_defaults_to_serializable(
    serializable_url: str, kafka_bootstrap: str, topic: str
) -> None:
    """Claim, mark, settle, heartbeat and claim-ahead work as ever: every message is
    delivered once, where its row says."""
    with psycopg.connect(serializable_url) as conn:
        ids = outbox.enqueue_many(
            conn, [outbox.Message(topic, f"{i}", key=f"k{i % 5}") for i in range(50)]
        )
    totals = publish_until_idle(serializable_url, kafka_bootstrap, batch_size=10)
    assert totals.delivered == 50
    assert_each_delivered_once(serializable_url, kafka_bootstrap, topic, ids)


def _dead_peer_settings(conn: psycopg.Connection[Any]) -> dict[str, str]:
    return {
        k: v
        for k, v in conn.info.get_parameters().items()
        if k.startswith(("keepalives", "tcp_user_timeout", "connect_timeout"))
    }


def test_every_connection_notices_a_silent_database_unless_the_url_says_otherwise(
    database_url: str,
) -> None:
    """The publisher's connections (the store's, the heartbeat's, the listener's...) get
    keepalives and a limit on unacknowledged data, so a database that went silent is
    noticed within about a minute; a setting the URL gives is kept."""
    store = claiming_store(database_url)
    try:
        assert _dead_peer_settings(store.conn) == {
            "connect_timeout": "10",
            "keepalives": "1",
            "keepalives_idle": "30",
            "keepalives_interval": "10",
            "keepalives_count": "3",
            "tcp_user_timeout": "60000",
        }
    finally:
        store.close()
    own = database_url + ("&" if "?" in database_url else "?") + "keepalives_idle=5"
    with connect(own) as conn:
        assert _dead_peer_settings(conn)["keepalives_idle"] == "5"
