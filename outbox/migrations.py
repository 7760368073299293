"""Numbered SQL migrations and ``outbox migrate``.

Migrations are the files ``schema/NNNN_name.sql`` (shipped in the wheel as
``outbox/schema``). ``migrate`` applies the missing ones in order, each in
its own transaction together with its row in ``outbox.schema_migrations``.
A transaction-scoped advisory lock serialises concurrent runs, so running
it repeatedly or from several processes at once is safe.

``migrate`` waits at most ``lock_timeout`` for each lock a migration needs
on the outbox tables (PostgreSQL's ``lock_timeout``, set for the migration's
transaction once the advisory lock is held). A lock request waiting behind a
long transaction would otherwise queue every enqueue behind it; past the
timeout the migration's transaction rolls back (nothing of it is applied),
the waiting enqueues go on, and it is tried again after a backoff, up to
``lock_attempts`` times before ``MigrationError`` says so. The timeout
bounds the wait for a lock, not the time it is held: see docs/operations.md
for the migrations that rewrite ``outbox.messages``.

``migrate_connection`` applies them on a connection the caller already holds,
inside the caller's transaction: that is how a schema managed by Alembic (or
any other migration tool) gets the outbox tables, views and triggers.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import psycopg

from outbox.connection import MIGRATE, Executor, executor_for, search_path_pinned, unscoped
from outbox.errors import MigrationError, said
from outbox.queries import query
from outbox.redaction import connect_errors_redacted

_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
#: Key of the advisory lock held while migrating (the text 'outbox.migrate' hashed by hand).
MIGRATION_LOCK_KEY = 0x6F7574626F78

#: How long ``migrate`` waits for a lock before giving the attempt up.
DEFAULT_LOCK_TIMEOUT = 5.0
#: PostgreSQL's largest ``lock_timeout``, in seconds (2**31 - 1 milliseconds).
MAX_LOCK_TIMEOUT = 2_147_483.647
#: Attempts per migration before ``migrate`` fails, waiting 1 s, 2 s, ... in between.
DEFAULT_LOCK_ATTEMPTS = 4
_BACKOFF_SECONDS = 1.0

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection as SAConnection


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered SQL file."""

    version: int
    name: str
    sql: str


def schema_dir() -> Traversable:
    """Where the migrations are: inside the installed package, else the source tree."""
    packaged = resources.files("outbox").joinpath("schema")
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "schema"


def load_migrations(directory: Traversable | None = None) -> list[Migration]:
    """Read every migration file, ordered by version; reject gaps and stray names."""
    directory = directory or schema_dir()
    migrations = []
    for entry in directory.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = _FILE_RE.match(entry.name)
        if not match:
            raise MigrationError(f"migration file {entry.name!r} is not named NNNN_name.sql")
        migrations.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    migrations.sort(key=lambda m: m.version)
    for expected, m in enumerate(migrations, start=1):
        if m.version != expected:
            raise MigrationError(f"migration {expected:04d} is missing (found {m.version:04d})")
    if not migrations:
        raise MigrationError(f"no migrations found in {directory}")
    return migrations


def applied_versions(conn: psycopg.Connection[Any]) -> set[int]:
    """Versions recorded in ``outbox.schema_migrations`` (empty before the first run)."""
    row = conn.execute(query("migrations_recorded")).fetchone()
    if row is None or row[0] is None:
        return set()
    return {v for (v,) in conn.execute(query("migrations_applied"))}


def migrate(
    conninfo: str,
    *,
    target: int | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    lock_attempts: int = DEFAULT_LOCK_ATTEMPTS,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Migration]:
    """Apply the migrations not yet applied (up to version ``target``, if given).

    Each waits at most ``lock_timeout`` seconds for a lock, and is tried
    ``lock_attempts`` times (with a backoff of 1 s, 2 s, ... in between)
    before ``MigrationError`` is raised; the migrations applied before it
    stay applied, and nothing of the one that failed is. Returns those this
    call applied.
    """
    if not 0 < lock_timeout <= MAX_LOCK_TIMEOUT:
        raise MigrationError(
            f"lock timeout must be more than 0 and at most {int(MAX_LOCK_TIMEOUT)} seconds "
            f"(PostgreSQL's largest lock_timeout, about 24 days), got {lock_timeout}"
        )
    if lock_attempts < 1:
        raise MigrationError(f"lock attempts must be at least 1, got {lock_attempts}")
    migrations = load_migrations()
    if target is not None and target not in {m.version for m in migrations}:
        raise MigrationError(f"no migration has version {target}")
    wanted = [m for m in migrations if target is None or m.version <= target]
    applied: list[Migration] = []
    with connect_errors_redacted(conninfo):
        conn = psycopg.connect(conninfo, autocommit=True)
    # READ COMMITTED whatever the database's default: a run that waited for
    # another's advisory lock must then see what that one applied, which a
    # snapshot taken before the wait (REPEATABLE READ) would not.
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    with conn:
        for migration in wanted:
            for attempt in range(1, lock_attempts + 1):
                try:
                    with conn.transaction():
                        applied.extend(
                            _apply(
                                _Target(conn),
                                migrations,
                                only=migration.version,
                                lock_timeout=lock_timeout,
                            )
                        )
                    break
                except psycopg.errors.LockNotAvailable as exc:
                    if attempt == lock_attempts:
                        raise MigrationError(
                            f"migration {migration.version:04d}_{migration.name} could not take "
                            f"its locks within the {lock_timeout:g}s lock timeout, {lock_attempts} "
                            f"times: another transaction holds a lock on an outbox table "
                            f"({exc.diag.message_primary or exc}). Nothing of it was applied "
                            f"(the database is at version {_version_now(conn)}). Run it again "
                            "when long transactions on the outbox tables are done (off-peak), "
                            "or with a longer --lock-timeout"
                        ) from exc
                    sleep(_BACKOFF_SECONDS * 2 ** (attempt - 1))
                except psycopg.errors.InsufficientPrivilege:
                    raise  # the command says which role may migrate
                except psycopg.Error as exc:
                    if conn.broken:
                        raise
                    raise MigrationError(
                        f"migration {migration.version:04d}_{migration.name} failed: "
                        f"{said(exc)}. Nothing of it was applied (the database is at version "
                        f"{_version_now(conn)})"
                    ) from exc
    return applied


def _version_now(conn: psycopg.Connection[Any]) -> int:
    with conn.transaction():
        return current_version(conn)


def migrate_connection(conn: object) -> list[Migration]:
    """Apply the missing migrations in ``conn``'s open transaction; return those applied.

    For schemas managed by another tool: Alembic calls it from a revision
    (``migrate_connection(op.get_bind())``) and so creates the views,
    functions, triggers and seed rows that no ``MetaData`` can describe.
    ``conn`` is a psycopg 3 ``Connection`` or a SQLAlchemy ``Connection`` or
    ``Session`` on psycopg 3, as for ``enqueue``. Nothing is committed here:
    every migration and its bookkeeping row commit or roll back with the
    caller's transaction, and the advisory lock is held until it ends, so
    concurrent runs (this and ``outbox migrate``) still apply each file once.
    """
    return _apply(_Target(conn), load_migrations())


class _Target:
    """Statements for migrating on a caller's connection, plain or through SQLAlchemy."""

    def __init__(self, conn: object) -> None:
        # Checks the driver (psycopg 3) and that a usable transaction is open.
        self.executor: Executor = executor_for(conn, MIGRATE)
        if not isinstance(conn, psycopg.Connection):
            conn = unscoped(conn)  # the session a scoped_session holds now
        self._conn: psycopg.Connection[Any] | SAConnection
        if isinstance(conn, psycopg.Connection):
            self._conn = conn
        else:
            # executor_for accepted it, so it is SQLAlchemy's and SQLAlchemy is
            # installed; imported only here, so that `outbox migrate` and a
            # service on plain psycopg never load it.
            from sqlalchemy.orm import Session  # noqa: PLC0415

            self._conn = (
                conn.connection() if isinstance(conn, Session) else cast("SAConnection", conn)
            )

    def script(self, sql: str) -> None:
        """Run SQL holding several statements and literal ``%`` signs, without parameters."""
        if isinstance(self._conn, psycopg.Connection):
            # A cursor of our own (not the connection's cursor_factory), never
            # prepared: a script of several statements cannot be.
            with psycopg.Cursor(self._conn) as cur:
                cur.execute(sql.encode(), prepare=False)
        else:
            # no_parameters: the DBAPI gets the text alone, so psycopg neither
            # reads ``%`` as a placeholder nor rejects several statements.
            self._conn.exec_driver_sql(sql, execution_options={"no_parameters": True})


def _apply(
    target: _Target,
    migrations: list[Migration],
    only: int | None = None,
    lock_timeout: float | None = None,
) -> list[Migration]:
    """In the current transaction: lock, check the version, apply what is missing.

    ``only`` limits this call to one version (``migrate`` gives each file its
    own transaction); the version check always covers every shipped file.
    ``lock_timeout`` (seconds) is set for the rest of the transaction once the
    advisory lock is held: another run waits for that one as long as it takes,
    since it queues no lock on an outbox table meanwhile.
    """
    target.executor.fetchall(query("migration_lock"), (MIGRATION_LOCK_KEY,))
    # Run as the schema owner: nothing of another role's may resolve a name
    # (the caller's path comes back after, for what its transaction runs next).
    with search_path_pinned(target.executor.fetchall):
        return _apply_pinned(target, migrations, only, lock_timeout)


def _apply_pinned(
    target: _Target,
    migrations: list[Migration],
    only: int | None,
    lock_timeout: float | None,
) -> list[Migration]:
    if lock_timeout is not None:
        target.executor.fetchall(
            query("migration_lock_timeout"),
            (f"{max(1, round(lock_timeout * 1000))}ms",),
        )
    target.script(query("migration_bookkeeping"))
    done = {v for (v,) in target.executor.fetchall(query("migrations_applied"), ())}
    newest_known = migrations[-1].version
    if done and max(done) > newest_known:
        raise MigrationError(
            f"the database is at schema version {max(done)}, newer than this "
            f"library's {newest_known}; upgrade the library"
        )
    applied = []
    for migration in migrations:
        if migration.version in done or (only is not None and migration.version != only):
            continue
        target.script(migration.sql)
        target.executor.fetchall(
            query("record_migration"),
            (migration.version, migration.name),
        )
        applied.append(migration)
    return applied


def current_version(conn: psycopg.Connection[Any]) -> int:
    """The highest applied schema version, 0 for a database never migrated."""
    return max(applied_versions(conn), default=0)


class SchemaBehind(MigrationError):
    """The database lacks a migration this version ships (run ``outbox migrate``)."""


def require_current_schema(conn: psycopg.Connection[Any], program: str) -> None:
    """Raise ``SchemaBehind`` unless every migration this version ships is applied.

    The publisher's statements read columns and indexes of the latest schema
    (``held``, since 0013), so it checks at start instead of failing at its
    first claim.
    """
    latest = load_migrations()[-1].version
    version = current_version(conn)
    if version < latest:
        raise SchemaBehind(
            f"{program} needs the outbox schema at version {latest} and the database is at "
            f"version {version}: run `outbox migrate` first (docs/operations.md, Upgrading)"
        )
