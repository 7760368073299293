"""No statement of the outbox runs a function another role planted on the search path.

PostgreSQL resolves an unqualified function among every schema on the
search_path and prefers the closest type match: a ``format(text, text,
name)`` created in ``public`` (where, before PostgreSQL 15, every login may
create objects, and where a deployment may let its services) beats
pg_catalog's variadic ``format``, and runs with the privileges of whoever
calls it. An operator's decision, the publisher's recovery and a migration
(run as the schema owner) each called such a function: a writer that may
read no payload could have one copy them all. Each now resolves names in
pg_catalog only. Here the planted functions record that they ran.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

import outbox
from outbox.errors import MigrationError
from outbox.migrations import migrate, migrate_connection
from outbox.operator import retry
from outbox.states import State
from publisher.outcomes import AttemptOutcome
from publisher.store import Settlement
from tests.support import claiming_store, fetch_rows, run_outbox_cli

pytestmark = pytest.mark.integration

# Closer matches than pg_catalog's for the calls the outbox's statements make:
# a decision's decided_by, recovery's reason, and a migration's grant loop.
PLANTED = """
CREATE TABLE public.planted_calls (called text);
GRANT INSERT ON public.planted_calls TO PUBLIC;
CREATE FUNCTION public.format(text, text, name) RETURNS text LANGUAGE sql AS $$
    INSERT INTO public.planted_calls VALUES ('format(text, text, name)');
    SELECT pg_catalog.format($1, $2, $3)
$$;
CREATE FUNCTION public.format(text, uuid, timestamptz, text, text) RETURNS text
LANGUAGE sql AS $$
    INSERT INTO public.planted_calls VALUES ('format(text, uuid, timestamptz, text, text)');
    SELECT pg_catalog.format($1, $2, $3, $4, $5)
$$;
CREATE FUNCTION public.quote_ident(name) RETURNS text LANGUAGE sql AS $$
    INSERT INTO public.planted_calls VALUES ('quote_ident(name)');
    SELECT pg_catalog.quote_ident($1::text)
$$;
-- And for the writer's own statement (the key locks of an enqueue), which runs on
-- a service's connection: one service's planted function would run as another.
CREATE FUNCTION public.hashtextextended(text, integer) RETURNS bigint LANGUAGE sql AS $$
    INSERT INTO public.planted_calls VALUES ('hashtextextended(text, integer)');
    SELECT pg_catalog.hashtextextended($1, $2)
$$;
CREATE FUNCTION public.unnest(bigint[]) RETURNS SETOF bigint LANGUAGE sql AS $$
    INSERT INTO public.planted_calls VALUES ('unnest(bigint[])');
    SELECT pg_catalog.unnest($1)
$$;
CREATE FUNCTION public.cardinality(bigint[]) RETURNS integer LANGUAGE sql AS $$
    INSERT INTO public.planted_calls VALUES ('cardinality(bigint[])');
    SELECT pg_catalog.cardinality($1)
$$;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO PUBLIC;
"""


def _plant(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(PLANTED)


def _planted_calls(database_url: str) -> list[Any]:
    return [row[0] for row in fetch_rows(database_url, "SELECT called FROM public.planted_calls")]


def _quarantined(database_url: str) -> uuid.UUID:
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, "t", b"v", key=uuid.uuid4().hex)
    store = claiming_store(database_url)
    try:
        batch = store.claim(10, lease_seconds=30)
        assert batch is not None
        [m] = batch.messages
        refused = Settlement(
            m.id, m.fence, State.QUARANTINED, AttemptOutcome.FAILED, error="refused",
            send_began=False,
        )  # fmt: skip
        assert store.settle(batch, [refused]) == {message_id}
    finally:
        store.close()
    return message_id


def test_the_planted_functions_run_when_the_path_reaches_them(database_url: str) -> None:
    """What the other tests rely on: calls the outbox makes, on the default search_path,
    run the planted functions."""
    _plant(database_url)
    with psycopg.connect(database_url) as conn:
        conn.execute("SELECT format('%s (database user %s)', 'x'::text, session_user)")
        conn.execute("SELECT hashtextextended('k', 0), unnest(ARRAY[1]::bigint[])")
    assert set(_planted_calls(database_url)) == {
        "format(text, text, name)",
        "hashtextextended(text, integer)",
        "unnest(bigint[])",
    }


def test_an_operators_decision_runs_no_planted_function(database_url: str) -> None:
    """By the command, and by the library on a connection of the caller's own, in the
    caller's transaction: whose search_path is its own again after the decision."""
    first, second = _quarantined(database_url), _quarantined(database_url)
    _plant(database_url)

    result = run_outbox_cli(database_url, "retry", str(first), "--reason", "fixed")
    assert result.returncode == 0, result.stderr
    with psycopg.connect(database_url) as conn:
        path = conn.execute("SHOW search_path").fetchone()
        retry(conn, second, "fixed")
        assert conn.execute("SHOW search_path").fetchone() == path
        conn.execute("SELECT count(*) FROM planted_calls")  # the caller's names still resolve

    assert _planted_calls(database_url) == []
    assert fetch_rows(database_url, "SELECT count(*) FROM outbox.decisions") == [(2,)]


def test_an_enqueue_runs_no_planted_function(database_url: str) -> None:
    """The key locks of an enqueue run on the service's connection and path: every function
    they call is named in pg_catalog."""
    _plant(database_url)
    with psycopg.connect(database_url) as conn:
        outbox.enqueue(conn, "t", b"v", key="k")
        outbox.enqueue_many(conn, [outbox.Message("t", b"v", key=f"k{i}") for i in range(3)])
    assert _planted_calls(database_url) == []


def test_the_publishers_recovery_runs_no_planted_function(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        message_id = outbox.enqueue(conn, "t", b"v")
    store = claiming_store(database_url)
    try:
        batch = store.claim(10, lease_seconds=30)
        assert batch is not None
        fetch_rows(
            database_url,
            "UPDATE outbox.batches SET lease_expires_at = now() - interval '1 second' RETURNING id",
        )
        _plant(database_url)
        assert [r.message_id for r in store.recover_expired_leases()] == [message_id]
    finally:
        store.close()
    assert _planted_calls(database_url) == []


def test_a_migration_refused_in_the_callers_transaction_gives_its_path_back(
    database_url: str,
) -> None:
    """A database newer than this library: migrate_connection refuses, and the caller's
    transaction, still usable, resolves names on its own path again."""
    with psycopg.connect(database_url) as conn:
        conn.execute("INSERT INTO outbox.schema_migrations (version, name) VALUES (999, 'x')")
        path = conn.execute("SHOW search_path").fetchone()
        with pytest.raises(MigrationError, match="newer than this library"):
            migrate_connection(conn)
        assert conn.execute("SHOW search_path").fetchone() == path


def test_a_migration_runs_no_planted_function(empty_database_url: str) -> None:
    """Migration 0024's grant loop names each role with quote_ident, as the schema owner."""
    migrate(empty_database_url, target=23)
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute("CREATE ROLE outbox_planted_test NOLOGIN")
    try:
        with psycopg.connect(empty_database_url, autocommit=True) as conn:
            conn.execute("GRANT UPDATE (heartbeat_at) ON outbox.publishers TO outbox_planted_test")
        _plant(empty_database_url)
        migrate(empty_database_url)
        assert _planted_calls(empty_database_url) == []
    finally:
        with psycopg.connect(empty_database_url, autocommit=True) as conn:
            conn.execute("DROP OWNED BY outbox_planted_test")
            conn.execute("DROP ROLE outbox_planted_test")
