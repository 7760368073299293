"""The role matrix: each outbox role can do its work and is refused the rest (42501).

Roles are cluster-wide, so each test creates its own (names with a random
suffix) and drops them afterwards. The login roles hold no password: the
test server trusts local connections, and what is checked is the grants.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import psycopg
import psycopg.errors
import pytest
from psycopg import sql

import outbox
import outbox.roles as roles_module
from outbox.errors import OutboxError
from outbox.migrations import migrate, migrate_connection
from outbox.roles import RoleNames, create_roles, granted_roles
from outbox.status import read_open_status
from publisher.store import PublisherStore
from publisher.testing import publish_until_idle
from tests.support import (
    fetch_rows,
    make_uncertain,
    read_topic,
    run_outbox_cli,
    start_publisher,
)

pytestmark = pytest.mark.integration

INSUFFICIENT_PRIVILEGE = "42501"


def _as_user(database_url: str, user: str) -> str:
    """The same database, logged in as ``user``."""
    parts = urlsplit(database_url)
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}@{host}").geturl()


@dataclass(frozen=True)
class Logins:
    """The three roles of one test and a login role in each, as URLs."""

    names: RoleNames
    writer_url: str
    publisher_url: str
    operator_url: str


def _drop_roles(database_url: str, roles: list[str]) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        existing = [
            r
            for (r,) in conn.execute(
                "SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)", [roles]
            )
        ]
        for role in existing:
            # A role that owns something (a database) hands it to the test's superuser first.
            conn.execute(
                sql.SQL("REASSIGN OWNED BY {} TO current_user").format(sql.Identifier(role))
            )
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        for role in existing:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def logins(database_url: str) -> Iterator[Logins]:
    """Roles created by ``create_roles`` as the owner, and a login role granted each."""
    suffix = uuid.uuid4().hex[:8]
    names = RoleNames(f"w_{suffix}", f"p_{suffix}", f"o_{suffix}")
    users = {purpose: f"{purpose}_login_{suffix}" for purpose in names.by_purpose()}
    everyone = [*names.by_purpose().values(), *users.values()]
    try:
        with psycopg.connect(database_url) as conn:
            create_roles(conn, names)
            for purpose, role in names.by_purpose().items():
                conn.execute(
                    sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                        sql.Identifier(users[purpose]), sql.Identifier(role)
                    )
                )
        yield Logins(
            names,
            _as_user(database_url, users["writer"]),
            _as_user(database_url, users["publisher"]),
            _as_user(database_url, users["operator"]),
        )
    finally:
        _drop_roles(database_url, everyone)


def _refused(url: str, statement: str, *params: object) -> None:
    """``statement`` run on ``url`` fails with permission denied (SQLSTATE 42501)."""
    with (
        psycopg.connect(url) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege) as refused,
    ):
        conn.execute(statement, params or None)
    assert refused.value.sqlstate == INSUFFICIENT_PRIVILEGE, statement


def _state(database_url: str, message_id: uuid.UUID) -> str:
    [(state,)] = fetch_rows(
        database_url, "SELECT state FROM outbox.message_status WHERE id = %s", message_id
    )
    return str(state)


def test_the_writer_enqueues_but_reads_no_payload_and_changes_no_state(
    database_url: str, logins: Logins
) -> None:
    """A writer login enqueues (idempotency keys included) and is refused payloads,
    the views, state changes and deletes."""
    with psycopg.connect(logins.writer_url) as conn:
        first = outbox.enqueue(conn, "orders", b"card 4111", key="k", idempotency_key="order:1")
        # The key is taken: the insert skips it, and the lookup returns the stored id.
        again = outbox.enqueue(conn, "orders", b"card 4111", key="k", idempotency_key="order:1")
        [second, third] = outbox.enqueue_many(
            conn,
            [
                outbox.Message("orders", b"a", idempotency_key="order:1"),
                outbox.Message("orders", b"b", idempotency_key="order:2"),
            ],
        )
    assert again == first == second
    assert _state(database_url, third) == "pending"
    assert _state(database_url, first) == "pending"

    for statement in (
        "SELECT value FROM outbox.messages",
        "SELECT header_names, header_values FROM outbox.messages",
        "SELECT state FROM outbox.messages",
        "SELECT * FROM outbox.message_status",
        "SELECT * FROM outbox.status",
        "SELECT * FROM outbox.attempts",
        "UPDATE outbox.messages SET state = 'discarded'",
        "UPDATE outbox.messages SET value = 'forged'",
        "DELETE FROM outbox.messages",
        "INSERT INTO outbox.decisions (message_id, decided_by, from_state, to_state, reason)"
        " VALUES (gen_random_uuid(), 'x', 'pending', 'discarded', 'x')",
    ):
        _refused(logins.writer_url, statement)


def test_the_publisher_delivers_and_reconciles_but_creates_and_drops_nothing(
    database_url: str, logins: Logins, kafka_bootstrap: str, topic: str
) -> None:
    """A publisher login runs the real publisher (claim, settle, recovery, reconciliation,
    heartbeat, lanes, LISTEN) to Kafka, purges, reads the metrics' status, and is refused DDL."""
    with psycopg.connect(logins.writer_url) as conn:
        uncertain = outbox.enqueue(conn, topic, b"first", key="k")
    # Sent and never confirmed: the publisher must reconcile it from Kafka.
    assert set(make_uncertain(database_url)) == {uncertain}
    with psycopg.connect(logins.writer_url) as conn:
        fresh = outbox.enqueue(conn, topic, b"second", key="k")
    # The reconciler's note on a message it must leave waiting (a session it cannot fence).
    store = PublisherStore(logins.publisher_url, uuid.uuid4())
    try:
        assert store.note_waiting(store.uncertain_due(), "reconciliation waits: a test") == 1
    finally:
        store.close()

    totals = publish_until_idle(logins.publisher_url, kafka_bootstrap)

    assert totals.delivered == 2
    assert _state(database_url, uncertain) == "delivered"
    assert _state(database_url, fresh) == "delivered"
    assert sorted(r.value for r in read_topic(kafka_bootstrap, topic)) == [b"first", b"second"]
    with psycopg.connect(logins.publisher_url) as conn:
        assert read_open_status(conn) == []
    purged = run_outbox_cli(logins.publisher_url, "purge", "--delivered-older-than", "1d")
    assert purged.returncode == 0, purged.stderr

    for statement in (
        "CREATE TABLE outbox.stolen (x int)",
        "CREATE SCHEMA stolen",
        "CREATE TABLE public.stolen (x int)",
        "CREATE FUNCTION outbox.f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
        "DROP TABLE outbox.messages",
        "DROP VIEW outbox.status",
        "ALTER TABLE outbox.messages ADD COLUMN x int",
        "TRUNCATE outbox.messages",
        "UPDATE outbox.messages SET value = 'forged'",
        "UPDATE outbox.messages SET topic = 'elsewhere'",
    ):
        _refused(logins.publisher_url, statement)


def _set_state(database_url: str, message_id: uuid.UUID, state: str, **extra: str) -> None:
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE outbox.messages SET state = %s, last_error = 'refused by the broker',"
            " escalated_at = CASE WHEN %s THEN now() END WHERE id = %s",
            (state, bool(extra.get("escalated")), message_id),
        )


def test_the_operator_reads_and_decides_but_enqueues_deletes_and_purges_nothing(
    database_url: str, logins: Logins
) -> None:
    """An operator login runs status, list, inspect, resolve, retry and discard through the
    CLI, and is refused enqueues, deletes, payload rewrites and purge."""
    with psycopg.connect(logins.writer_url) as conn:
        quarantined, uncertain, dropped = (
            outbox.enqueue(conn, "orders", f"m{i}".encode()) for i in range(3)
        )
    _set_state(database_url, quarantined, "quarantined")
    _set_state(database_url, uncertain, "uncertain", escalated="yes")
    _set_state(database_url, dropped, "quarantined")

    def cli(*args: str) -> str:
        result = run_outbox_cli(logins.operator_url, *args)
        assert result.returncode in (0, 1), result.stderr
        return result.stdout

    assert json.loads(cli("status", "--json"))["counts"]["quarantined"] == 2
    listed = json.loads(cli("list", "--state", "quarantined", "--json"))["messages"]
    assert {m["id"] for m in listed} == {str(quarantined), str(dropped)}
    story = json.loads(cli("inspect", str(uncertain), "--json"))
    assert story["needs_action"] is True
    fence = str(story["message"]["fence"])
    cli(
        "resolve",
        str(uncertain),
        "--delivered",
        "--fence",
        fence,
        "--reason",
        "found it in the topic",
    )
    cli("retry", str(quarantined))
    cli("discard", str(dropped), "--reason", "obsolete")

    assert _state(database_url, uncertain) == "delivered"
    assert _state(database_url, quarantined) == "pending"
    assert _state(database_url, dropped) == "discarded"
    decided = fetch_rows(database_url, "SELECT to_state FROM outbox.decisions ORDER BY id")
    assert [d for (d,) in decided] == ["delivered", "pending", "discarded"]

    purge = run_outbox_cli(logins.operator_url, "purge", "--delivered-older-than", "1d")
    assert purge.returncode == 2
    assert "permission denied" in purge.stderr
    assert "needs the publisher role" in purge.stderr
    with psycopg.connect(logins.operator_url) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as refused:
            outbox.enqueue(conn, "orders", b"forged")
        assert refused.value.sqlstate == INSUFFICIENT_PRIVILEGE
    for statement in (
        "DELETE FROM outbox.messages",
        "DELETE FROM outbox.decisions",
        "UPDATE outbox.decisions SET reason = 'rewritten'",
        "UPDATE outbox.messages SET value = 'forged'",
        "UPDATE outbox.lanes SET owner = gen_random_uuid()",
        # Held open, that lock would stall every claim (they read the lanes FOR SHARE).
        "SELECT lane FROM outbox.lanes FOR UPDATE",
        "INSERT INTO outbox.batches (publisher_id) VALUES (gen_random_uuid())",
        "DROP TABLE outbox.decisions",
        "CREATE TABLE outbox.stolen (x int)",
    ):
        _refused(logins.operator_url, statement)


@pytest.mark.parametrize(
    "args", [["--exit-when-idle"], ["reconcile"]], ids=["publisher", "reconcile"]
)
def test_the_publisher_commands_refuse_a_login_without_the_publisher_role_naming_it(
    logins: Logins, kafka_bootstrap: str, args: list[str]
) -> None:
    """As an operator login, outbox-publisher and its reconcile command exit 2 with one
    line that names the role they need, not a traceback, and no warning before it about
    a stop it never had to record."""
    process = start_publisher(logins.operator_url, kafka_bootstrap, *args)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2, stderr
    assert "permission denied for table" in stderr
    name = "outbox-publisher reconcile" if args == ["reconcile"] else "outbox-publisher"
    assert f"`{name}` needs the publisher role (see docs/security.md)" in stderr
    assert "Traceback" not in stderr
    assert "WARNING" not in stderr, stderr


def _privilege(database_url: str, role: str, table: str, privilege: str) -> bool:
    """Whether ``role`` holds ``privilege`` on ``table`` or on one of its columns."""
    check = (
        "has_any_column_privilege"
        if privilege in ("SELECT", "INSERT", "UPDATE")
        else ("has_table_privilege")
    )
    [(has,)] = fetch_rows(database_url, f"SELECT {check}(%s, %s, %s)", role, table, privilege)
    return bool(has)


def test_create_roles_is_idempotent_exact_and_covers_new_tables(
    database_url: str, logins: Logins
) -> None:
    """Run again, the grants are exactly the file's: an extra privilege is revoked, a table
    a migration added is granted, and the roles that exist are left as they are."""
    names = logins.names
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("GRANT DELETE ON outbox.messages TO {}").format(sql.Identifier(names.writer))
        )
        conn.execute("CREATE TABLE outbox.added_later (x int)")
    assert _privilege(database_url, names.writer, "outbox.messages", "DELETE")
    assert not _privilege(database_url, names.operator, "outbox.added_later", "SELECT")

    with psycopg.connect(database_url) as conn:
        report = create_roles(conn, names)
        assert sorted(granted_roles(conn)) == sorted(names.by_purpose().values())

    assert report.created == []
    assert report.existing == list(names.by_purpose().values())
    assert not _privilege(database_url, names.writer, "outbox.messages", "DELETE")
    assert _privilege(database_url, names.writer, "outbox.messages", "INSERT")
    assert _privilege(database_url, names.operator, "outbox.added_later", "SELECT")
    assert _privilege(database_url, names.operator, "outbox.status", "SELECT")


def test_create_roles_in_an_alembic_style_transaction_commits_with_it(
    empty_database_url: str,
) -> None:
    """As a revision run by Alembic does: migrate_connection on SQLAlchemy's connection,
    then create_roles on the psycopg connection beneath it (a savepoint in that
    transaction): nothing is granted until the transaction commits, everything after."""
    sa = pytest.importorskip("sqlalchemy")
    suffix = uuid.uuid4().hex[:8]
    names = RoleNames(f"w_{suffix}", f"p_{suffix}", f"o_{suffix}")
    engine = sa.create_engine(empty_database_url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            migrate_connection(conn)
            report = create_roles(conn.connection.driver_connection, names)
            assert report.created == list(names.by_purpose().values())
            roles = list(names.by_purpose().values())
            assert fetch_rows(
                empty_database_url, "SELECT count(*) FROM pg_roles WHERE rolname = ANY(%s)", roles
            ) == [(0,)]
            conn.commit()
        assert _privilege(empty_database_url, names.writer, "outbox.messages", "INSERT")
        assert _privilege(empty_database_url, names.operator, "outbox.status", "SELECT")
    finally:
        engine.dispose()
        _drop_roles(empty_database_url, list(names.by_purpose().values()))


@pytest.fixture
def grants_before_0024(monkeypatch: pytest.MonkeyPatch) -> None:
    """create_roles grants as before 0024, whose column an earlier schema lacks."""
    blocks = {
        name: text.replace(", kafka_reached_at", "")
        for name, text in roles_module._grants().items()
    }
    monkeypatch.setattr(roles_module, "_grants", lambda: blocks)


@pytest.mark.usefixtures("grants_before_0024")
def test_0021_lets_the_roles_that_mark_batches_rewrite_what_they_name(
    empty_database_url: str,
) -> None:
    """Roles granted before 0021 may mark a batch but not rewrite its message_ids, which a
    mark of this version does: the migration grants that to each of them, so a publisher
    of this version (which starts only on a schema with 0021) is never refused its mark."""
    url = empty_database_url
    migrate(url, target=20)
    suffix = uuid.uuid4().hex[:8]
    names = RoleNames(f"w_{suffix}", f"p_{suffix}", f"o_{suffix}")
    try:
        with psycopg.connect(url) as conn:
            create_roles(conn, names)
            conn.execute(  # as the grants were before this version
                sql.SQL("REVOKE UPDATE (message_ids) ON outbox.batches FROM {}").format(
                    sql.Identifier(names.publisher)
                )
            )
        column = "SELECT has_column_privilege(%s, 'outbox.batches', 'message_ids', 'UPDATE')"
        assert fetch_rows(url, column, names.publisher) == [(False,)]
        assert [m.version for m in migrate(url, target=21)] == [21]
        assert fetch_rows(url, column, names.publisher) == [(True,)]
        assert fetch_rows(url, column, names.operator) == [(False,)]  # it marks nothing
    finally:
        _drop_roles(url, list(names.by_purpose().values()))


def test_0024_lets_the_roles_that_beat_say_they_reach_kafka(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Roles granted before 0024 may beat but have no kafka_reached_at, which a heartbeat
    of this version writes: the migration grants it to each role that may beat."""
    url = empty_database_url
    migrate(url, target=23)
    blocks = {
        name: text.replace(", kafka_reached_at", "")
        for name, text in roles_module._grants().items()
    }
    suffix = uuid.uuid4().hex[:8]
    names = RoleNames(f"w_{suffix}", f"p_{suffix}", f"o_{suffix}")
    try:
        with monkeypatch.context() as patched, psycopg.connect(url) as conn:
            patched.setattr(roles_module, "_grants", lambda: blocks)
            create_roles(conn, names)
        assert [m.version for m in migrate(url, target=24)] == [24]
        column = (
            "SELECT has_column_privilege(%s, 'outbox.publishers', 'kafka_reached_at', 'UPDATE')"
        )
        assert fetch_rows(url, column, names.publisher) == [(True,)]
        assert fetch_rows(url, column, names.operator) == [(False,)]  # it beats nothing
        assert fetch_rows(url, column, names.writer) == [(False,)]
    finally:
        _drop_roles(url, list(names.by_purpose().values()))


@pytest.fixture
def owner_login(empty_database_url: str) -> Iterator[Callable[[], str]]:
    """A non-superuser login with CREATEROLE that owns the (empty) database; its URL.

    Dropped afterwards with every role whose name starts with its own.
    """
    owner = f"owner_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEROLE").format(sql.Identifier(owner)))
        conn.execute(
            sql.SQL("ALTER DATABASE {} OWNER TO {}").format(
                sql.Identifier(urlsplit(empty_database_url).path.lstrip("/")),
                sql.Identifier(owner),
            )
        )
    try:
        yield lambda: owner
    finally:
        with psycopg.connect(empty_database_url, autocommit=True) as conn:
            roles = [
                r
                for (r,) in conn.execute(
                    "SELECT rolname FROM pg_roles WHERE rolname LIKE %s", (owner + "%",)
                )
            ]
        _drop_roles(empty_database_url, [r for r in roles if r != owner] + [owner])


def test_migrate_and_create_roles_as_a_non_superuser_owner(
    empty_database_url: str, owner_login: Callable[[], str]
) -> None:
    """`outbox migrate --create-roles` run by the schema owner (CREATEROLE, no superuser)
    creates the tables and the roles; another login may not grant on them."""
    owner = owner_login()
    url = _as_user(empty_database_url, owner)
    flags = [f"--{p}-role={owner}_{p}" for p in ("writer", "publisher", "operator")]

    result = run_outbox_cli(url, "migrate", "--create-roles", *flags)

    assert result.returncode == 0, result.stderr
    assert f"role {owner}_writer (writer): created (NOLOGIN)" in result.stdout
    again = run_outbox_cli(url, "migrate", "--create-roles", *flags)
    assert again.returncode == 0, again.stderr
    assert f"role {owner}_writer (writer): exists" in again.stdout
    other = f"{owner}_other"
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(other)))
    with (
        psycopg.connect(_as_user(empty_database_url, other)) as conn,
        pytest.raises(OutboxError) as refused,
    ):
        create_roles(conn, RoleNames(f"{owner}_w2", f"{owner}_p2", f"{owner}_o2"))
    assert f"only the owner of the outbox tables ({owner}) can grant" in str(refused.value)
    migrate_as_other = run_outbox_cli(_as_user(empty_database_url, other), "migrate")
    assert migrate_as_other.returncode == 2
    assert "`outbox migrate` runs as the owner of the outbox schema" in migrate_as_other.stderr


def test_the_owner_of_a_schema_made_for_it_migrates_without_create_on_the_database(
    empty_database_url: str,
) -> None:
    """A DBA made the outbox schema for a login (CREATE SCHEMA ... AUTHORIZATION) that may
    not create schemas in the database: it migrates, and migrates again, as that login."""
    migrator = f"migrator_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(migrator)))
        conn.execute(
            sql.SQL("CREATE SCHEMA outbox AUTHORIZATION {}").format(sql.Identifier(migrator))
        )
    url = _as_user(empty_database_url, migrator)
    try:
        with psycopg.connect(url) as conn:
            database = conn.execute("SELECT current_database()").fetchone()
            assert database is not None
            assert conn.execute(
                "SELECT has_database_privilege(%s, 'CREATE')", (database[0],)
            ).fetchone() == (False,)
        first = run_outbox_cli(url, "migrate")
        again = run_outbox_cli(url, "migrate")
        assert (first.returncode, first.stderr) == (0, "")
        assert (again.returncode, again.stderr) == (0, "")
        with psycopg.connect(url) as conn:
            outbox.enqueue(conn, "orders", b"v")
    finally:
        _drop_roles(empty_database_url, [migrator])


def test_a_role_name_without_create_roles_is_refused(empty_database_url: str) -> None:
    """A role's name given without --create-roles would be ignored: refused before any
    migration, naming the flag."""
    result = run_outbox_cli(empty_database_url, "migrate", "--writer-role", "orders_writer")
    assert result.returncode == 2
    assert "--writer-role goes only with --create-roles" in result.stderr
    assert result.stderr.startswith("usage: outbox migrate "), result.stderr  # the command's
    with psycopg.connect(empty_database_url) as conn:
        assert conn.execute("SELECT to_regnamespace('outbox')").fetchone() == (None,)


def test_create_roles_on_a_schema_behind_this_version_says_to_migrate(
    empty_database_url: str,
) -> None:
    """The grants name what the latest migration made (0024's column): on a database
    behind, create_roles says to run outbox migrate, and grants nothing."""
    url = empty_database_url
    migrate(url, target=23)
    suffix = uuid.uuid4().hex[:8]
    names = RoleNames(f"w_{suffix}", f"p_{suffix}", f"o_{suffix}")
    try:
        with psycopg.connect(url) as conn, pytest.raises(OutboxError) as refused:
            create_roles(conn, names)
        assert "lacks some of it" in str(refused.value)
        assert str(refused.value).endswith("run `outbox migrate` first")
        assert fetch_rows(
            url, "SELECT count(*) FROM pg_roles WHERE rolname = %s", names.writer
        ) == [(0,)]
    finally:
        _drop_roles(url, list(names.by_purpose().values()))
