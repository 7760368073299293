"""``outbox migrate``: applies every migration once, also when run concurrently."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import outbox
from outbox.errors import MigrationError
from outbox.migrations import current_version, load_migrations, migrate
from tests.support import run_outbox_cli, start_publisher, wait_until, waiting_on_lock

pytestmark = pytest.mark.integration


def _recorded(url: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        return conn.execute(
            "SELECT version, name FROM outbox.schema_migrations ORDER BY version"
        ).fetchall()


def test_migrate_applies_once_and_records_the_version(empty_database_url: str) -> None:
    """The first run applies everything; a second run applies nothing."""
    shipped = load_migrations()
    assert [m.version for m in migrate(empty_database_url)] == [m.version for m in shipped]
    assert migrate(empty_database_url) == []
    assert _recorded(empty_database_url) == [(m.version, m.name) for m in shipped]
    with psycopg.connect(empty_database_url) as conn:
        assert current_version(conn) == shipped[-1].version
        assert conn.execute("SELECT count(*) FROM outbox.status").fetchone() == (6,)


def test_concurrent_migrations_apply_each_file_once(empty_database_url: str) -> None:
    """Four processes migrating at once: every migration applied by exactly one of them."""
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: migrate(empty_database_url), range(4)))
    applied = [m.version for result in results for m in result]
    assert sorted(applied) == [m.version for m in load_migrations()]
    assert len(_recorded(empty_database_url)) == len(load_migrations())


def test_concurrent_migrations_see_each_other_whatever_the_default_isolation(
    empty_database_url: str,
) -> None:
    """At a REPEATABLE READ default, a run that waited for another's lock took its snapshot
    before that one committed: migrate runs at READ COMMITTED, so it sees what was applied."""
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        database = conn.execute("SELECT current_database()").fetchone()
        assert database is not None
        conn.execute(
            psycopg.sql.SQL(
                "ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'"
            ).format(psycopg.sql.Identifier(database[0]))
        )
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: migrate(empty_database_url), range(4)))
    applied = [m.version for result in results for m in result]
    assert sorted(applied) == [m.version for m in load_migrations()]


def test_migrating_to_an_older_version_than_the_database_applies_nothing(
    empty_database_url: str,
) -> None:
    """A target below the database's version is not a database newer than the library."""
    migrate(empty_database_url)
    assert migrate(empty_database_url, target=6) == []


def test_0007_carries_messages_in_flight_into_their_batches(empty_database_url: str) -> None:
    """In flight under the old model: in its open batch, pending in its row, the attempt
    not counted yet; in flight with no batch record: uncertain, with an abandoned attempt."""
    url = empty_database_url
    assert [m.version for m in migrate(url, target=6)] == [1, 2, 3, 4, 5, 6]
    owner = uuid.uuid4()
    with psycopg.connect(url) as conn:
        [(open_batch,)] = conn.execute(
            "INSERT INTO outbox.batches (publisher_id) VALUES (%s) RETURNING id", (owner,)
        )
        [(settled_batch,)] = conn.execute(
            "INSERT INTO outbox.batches (publisher_id, settled_at) VALUES (%s, now()) RETURNING id",
            (owner,),
        )
        [(recovered_batch,)] = conn.execute(
            "INSERT INTO outbox.batches (publisher_id) VALUES (%s) RETURNING id", (owner,)
        )
        ids = [uuid.uuid4() for _ in range(3)]
        rows = [
            # (id, key, batch, state): claimed by the open batch; legacy without a
            # batch; and one that recovery already moved out of its batch.
            (ids[0], b"k", open_batch, "in_flight"),
            (ids[1], None, None, "in_flight"),
            (ids[2], None, recovered_batch, "pending"),
        ]
        for message_id, key, batch, state in rows:
            conn.execute(
                "INSERT INTO outbox.messages (id, topic, key, value, state, batch_id, fence, "
                "attempts, lease_owner, lease_expires_at) "
                "VALUES (%s, 't', %s, 'v', %s, %s, 1, 1, "
                "CASE WHEN %s = 'in_flight' THEN %s::uuid END, "
                "CASE WHEN %s = 'in_flight' THEN now() + interval '1 minute' END)",
                (message_id, key, state, batch, state, owner, state),
            )

    migrate(url)

    with psycopg.connect(url) as conn:
        batches = {
            r[0]: r[1:]
            for r in conn.execute(
                "SELECT id, message_ids, cardinality(key_hashes), settled_at IS NULL, "
                "lease_expires_at > now() FROM outbox.batches"
            )
        }
        status = conn.execute(
            "SELECT id, state, lease_owner, attempts, fence FROM outbox.message_status ORDER BY seq"
        ).fetchall()
        legacy_attempts = conn.execute(
            "SELECT message_id, outcome, send_began FROM outbox.attempts"
        ).fetchall()
        in_row = conn.execute("SELECT count(*) FROM outbox.messages WHERE state = 'in_flight'")
        assert in_row.fetchone() == (0,)
    assert batches[open_batch] == ([ids[0]], 1, True, True)
    assert batches[settled_batch][2] is False
    assert batches[recovered_batch][2] is False  # closed: recovery moved its message already
    assert status == [
        (ids[0], "in_flight", owner, 0, 1),
        (ids[1], "uncertain", None, 1, 1),
        (ids[2], "pending", None, 1, 1),
    ]
    assert legacy_attempts == [(ids[1], "abandoned", True)]


def test_0019_makes_a_row_set_in_flight_by_hand_uncertain_and_refuses_the_value(
    empty_database_url: str,
) -> None:
    """A row whose own state says in_flight is named by no batch, so recovery never moves
    it: 0019 makes it uncertain, counting the attempt as recovery does and clearing its
    old batch (not this attempt's evidence); from then on the value is refused."""
    url = empty_database_url
    migrate(url, target=18)
    with psycopg.connect(url) as conn:
        set_by_hand, untouched = outbox.enqueue_many(
            conn, [outbox.Message("t", b"1", key="k"), outbox.Message("t", b"2", key="k")]
        )
        [(batch,)] = conn.execute(
            "INSERT INTO outbox.batches (publisher_id, settled_at) "
            "VALUES (gen_random_uuid(), now()) RETURNING id"
        )
        conn.execute(
            "UPDATE outbox.messages SET state = 'in_flight', batch_id = %s, fence = 2, "
            "attempts = 2 WHERE id = %s",
            (batch, set_by_hand),
        )

    assert [m.version for m in migrate(url, target=20)] == [19, 20]

    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT id, state, fence, attempts, batch_id, available_at <= now(), last_error "
            "FROM outbox.message_status ORDER BY seq"
        ).fetchall()
        attempts = conn.execute(
            "SELECT message_id, attempt, fence, outcome, send_began, error FROM outbox.attempts"
        ).fetchall()
        with pytest.raises(psycopg.errors.CheckViolation, match="messages_in_flight_derived"):
            conn.execute(
                "UPDATE outbox.messages SET state = 'in_flight' WHERE id = %s", (untouched,)
            )
    note = rows[0][6]
    assert "no batch named it" in note
    assert rows == [
        (set_by_hand, "uncertain", 3, 3, None, True, note),
        (untouched, "pending", 0, 0, None, True, None),
    ]
    assert attempts == [(set_by_hand, 3, 3, "recovered", True, note)]


def test_a_migration_blocked_by_a_long_transaction_gives_up_and_lets_enqueues_through(
    empty_database_url: str,
) -> None:
    """Behind a transaction holding outbox.messages, a migration waits at most its lock timeout
    per attempt, then fails saying so with nothing of it applied; an insert issued while the
    migration's lock request is queued goes through within that timeout."""
    url = empty_database_url
    migrate(url, target=6)  # 0007 drops columns of outbox.messages: ACCESS EXCLUSIVE
    migrating = make_conninfo(url, application_name="test-migrate")
    lock_timeout, attempts = 1.0, 2
    insert = "INSERT INTO outbox.messages (id, topic, value) VALUES (%s, 'orders', 'v')"
    # The holder is closed first, whatever happens, so that no thread of the pool waits on it.
    with ThreadPoolExecutor(2) as pool, psycopg.connect(url) as holder:
        holder.execute(insert, (uuid.uuid4(),))  # an enqueue, not committed yet
        started = time.monotonic()
        migration = pool.submit(
            migrate, migrating, lock_timeout=lock_timeout, lock_attempts=attempts
        )
        wait_until(
            lambda: waiting_on_lock(url, "test-migrate"),
            timeout=10,
            what="the migration to queue its lock",
        )

        def enqueue_meanwhile() -> float:
            with psycopg.connect(url) as conn:
                begun = time.monotonic()
                conn.execute(insert, (uuid.uuid4(),))
                return time.monotonic() - begun

        waited = pool.submit(enqueue_meanwhile).result(timeout=lock_timeout + 5)
        assert waited < lock_timeout + 1
        with pytest.raises(MigrationError) as failed:
            migration.result(timeout=attempts * lock_timeout + 10)
        elapsed = time.monotonic() - started
        holder.rollback()
    # Two attempts of about a second each, one second of backoff between them.
    assert elapsed < attempts * lock_timeout + 1 + 3
    says = str(failed.value)
    assert "0007_batch_claims" in says
    assert "1s lock timeout, 2 times" in says
    assert "Nothing of it was applied (the database is at version 6)" in says
    with psycopg.connect(url) as conn:
        assert current_version(conn) == 6
        columns = {
            c
            for (c,) in conn.execute(
                "SELECT column_name FROM information_schema.columns "
                "WHERE table_schema = 'outbox' AND table_name = 'messages'"
            )
        }
    assert "lease_owner" in columns  # 0007 drops it: nothing of 0007 remains
    applied = [m.version for m in migrate(url)]
    assert applied[0] == 7  # applied once nothing holds the lock


def test_migrate_refuses_a_lock_timeout_or_attempts_that_cannot_work(
    empty_database_url: str,
) -> None:
    """A zero lock timeout or zero attempts is refused before anything is applied."""
    for kwargs in ({"lock_timeout": 0.0}, {"lock_attempts": 0}):
        with pytest.raises(MigrationError, match="must be"):
            migrate(empty_database_url, **kwargs)
    with psycopg.connect(empty_database_url) as conn:
        assert current_version(conn) == 0


def test_a_publisher_refuses_to_start_on_a_schema_missing_a_migration(
    empty_database_url: str, kafka_bootstrap: str
) -> None:
    """It says which version it needs and which the database has, and exits 2, instead of
    failing at its first claim on a column the schema lacks; on a database with no outbox
    schema at all, the one line says so, with no warning before it."""
    latest = load_migrations()[-1].version
    process = start_publisher(empty_database_url, kafka_bootstrap, "--exit-when-idle")
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2, stderr
    assert "run `outbox migrate`" in stderr
    assert "WARNING" not in stderr, stderr
    migrate(empty_database_url, target=latest - 1)
    process = start_publisher(empty_database_url, kafka_bootstrap, "--exit-when-idle")
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2, stderr
    assert (
        f"needs the outbox schema at version {latest} and the database is at version "
        f"{latest - 1}: run `outbox migrate` first" in stderr
    )
    # outbox-publisher reconcile runs the publisher's statements: it checks the same.
    reconcile = start_publisher(empty_database_url, kafka_bootstrap, "reconcile")
    _, stderr = reconcile.communicate(timeout=60)
    assert reconcile.returncode == 2, stderr
    assert stderr.strip() == (
        f"outbox-publisher reconcile: outbox-publisher reconcile needs the outbox schema at "
        f"version {latest} and the database is at version {latest - 1}: run `outbox migrate` "
        "first (docs/operations.md, Upgrading)"
    )
    with psycopg.connect(empty_database_url) as conn:
        assert conn.execute("SELECT count(*) FROM outbox.publishers").fetchone() == (0,)
    migrate(empty_database_url)
    process = start_publisher(empty_database_url, kafka_bootstrap, "--exit-when-idle")
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr


@pytest.mark.parametrize(
    "decision",
    [["discard", "ID"], ["retry", "ID"], ["retry", "--quarantined"]],
    ids=["discard", "retry", "retry-quarantined"],
)
def test_an_operator_decision_refuses_a_schema_missing_a_migration(
    empty_database_url: str, decision: list[str]
) -> None:
    """It names both versions and exits 2 before deciding anything, instead of failing
    half-way on a column the schema lacks; once migrated, the same decision goes."""
    latest = load_migrations()[-1].version
    migrate(empty_database_url, target=latest - 1)
    with psycopg.connect(empty_database_url) as conn:
        message = outbox.enqueue(conn, "orders", b"v", key="k")
        conn.execute("UPDATE outbox.messages SET state = 'quarantined' WHERE id = %s", (message,))
    command = decision[0]
    args = [str(message) if arg == "ID" else arg for arg in decision] + ["--reason", "checked"]
    refused = run_outbox_cli(empty_database_url, *args)
    assert refused.returncode == 2, refused.stderr
    assert (
        f"`outbox {command}` needs the outbox schema at version {latest} and the database is "
        f"at version {latest - 1}: run `outbox migrate` first" in refused.stderr
    )
    with psycopg.connect(empty_database_url) as conn:
        assert conn.execute(
            "SELECT state FROM outbox.messages WHERE id = %s", (message,)
        ).fetchone() == ("quarantined",)
    migrate(empty_database_url)
    decided = run_outbox_cli(empty_database_url, *args)
    assert decided.returncode == 0, decided.stderr


def test_a_migration_that_fails_is_named_with_the_version_left(empty_database_url: str) -> None:
    """A migration failing for another reason than a lock (here: its column exists already,
    as after a hand-edited schema_migrations) names itself and the version the database
    stays at; nothing of it is applied."""
    migrate(empty_database_url)
    with psycopg.connect(empty_database_url) as conn:
        conn.execute("DELETE FROM outbox.schema_migrations WHERE version >= 15")
    with pytest.raises(MigrationError) as failed:
        migrate(empty_database_url)
    said = str(failed.value)
    assert said.startswith("migration 0015_publisher_leases failed: column ")
    assert "already exists. Nothing of it was applied (the database is at version 14)" in said
    assert [v for v, _ in _recorded(empty_database_url)][-1] == 14
    result = run_outbox_cli(empty_database_url, "migrate")
    assert result.returncode == 2
    assert result.stderr.startswith("outbox: migration 0015_publisher_leases failed: ")


def test_0013_refuses_an_index_built_beforehand_that_is_invalid(empty_database_url: str) -> None:
    """An index built beforehand (operations.md: CREATE INDEX CONCURRENTLY) whose build
    failed is left INVALID under its name: 0013 names it and applies nothing, rather than
    take it and drop the index claims read."""
    migrate(empty_database_url, target=12)
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute(
            "ALTER TABLE outbox.messages ADD COLUMN IF NOT EXISTS held boolean NOT NULL "
            "DEFAULT false"
        )
        conn.execute(
            "CREATE INDEX messages_pending_by_lane ON outbox.messages (lane, held, seq) "
            "WHERE state = 'pending'"
        )
        # What a CREATE INDEX CONCURRENTLY that failed leaves behind.
        conn.execute(
            "UPDATE pg_index SET indisvalid = false "
            "WHERE indexrelid = 'outbox.messages_pending_by_lane'::regclass"
        )
    with pytest.raises(MigrationError) as refused:
        migrate(empty_database_url, lock_attempts=1)
    assert "index messages_pending_by_lane of outbox.messages is INVALID" in str(refused.value)
    assert [v for v, _ in _recorded(empty_database_url)][-1] == 12
    with psycopg.connect(empty_database_url) as conn:
        assert conn.execute(
            "SELECT to_regclass('outbox.messages_claimable_by_lane')"
        ).fetchone() == ("outbox.messages_claimable_by_lane",)
        conn.execute("DROP INDEX outbox.messages_pending_by_lane")
        conn.commit()
    migrate(empty_database_url)  # built by the migration this time
    assert [v for v, _ in _recorded(empty_database_url)][-1] == load_migrations()[-1].version
