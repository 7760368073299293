"""The database roles of the outbox and ``outbox migrate --create-roles``.

Three roles, NOLOGIN: a deployment grants them to its login users (or gives
them a password itself), so that no component connects as the owner of the
tables:

* the *writer* (``outbox_writer``) may only enqueue;
* the *publisher* (``outbox_publisher``) runs every statement the publisher
  sends, retention included, with no DDL and no ownership;
* the *operator* (``outbox_operator``) reads everything and takes the
  decisions (resolve, retry, discard).

Migrations stay with the owner of the outbox schema (the role that ran the
first ``outbox migrate``). The grants are in ``roles.sql`` beside this
module; ``create_roles`` creates the missing roles and makes the grants
exactly those, in one transaction. A migration that adds a table or
replaces a view leaves it without these grants, so ``create_roles`` runs
again after every migration: ``outbox migrate --create-roles`` does both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import psycopg
import psycopg.errors
from psycopg import sql

from outbox.errors import OutboxError
from outbox.migrations import MIGRATION_LOCK_KEY
from outbox.queries import parse_queries, query

#: What each role may do, as ``create_roles`` reports it.
PURPOSES = {
    "writer": "enqueue only: INSERT into outbox.messages, SELECT of its id and idempotency_key",
    "publisher": "claim, send, settle, recover, reconcile, heartbeat, lanes, metrics, retention",
    "operator": "read every outbox table and view; resolve, retry, discard",
}


@dataclass(frozen=True, slots=True)
class RoleNames:
    """The names of the three roles."""

    writer: str = "outbox_writer"
    publisher: str = "outbox_publisher"
    operator: str = "outbox_operator"

    def by_purpose(self) -> dict[str, str]:
        """``{"writer": name, "publisher": name, "operator": name}``."""
        return {"writer": self.writer, "publisher": self.publisher, "operator": self.operator}

    def problem(self) -> str | None:
        """What makes these names unfit to be the three roles (empty, or not three
        different names), or ``None``."""
        given = list(self.by_purpose().values())
        if not all(name.strip() for name in given):
            return f"a role name is empty, got {given}"
        if len(set(given)) != len(given):
            return f"the writer, publisher and operator roles must differ, got {given}"
        return None


@dataclass(frozen=True, slots=True)
class RolesReport:
    """What ``create_roles`` did."""

    names: RoleNames
    #: Roles this call created (NOLOGIN).
    created: list[str] = field(default_factory=list)
    #: Roles that existed already, left as they were (their grants renewed).
    existing: list[str] = field(default_factory=list)
    #: The owner of the outbox tables, who granted.
    owner: str = ""

    def lines(self) -> list[str]:
        """What was done, one line each, for a person."""
        out = []
        for purpose, name in self.names.by_purpose().items():
            how = "created (NOLOGIN)" if name in self.created else "exists, left as it was"
            out.append(f"role {name} ({purpose}): {how}; granted: {PURPOSES[purpose]}")
        out.append(
            f"granted by {self.owner}, the owner of the outbox tables; grant each role to a "
            "login role (GRANT " + self.names.writer + " TO <service user>), and run this again "
            "after every migration"
        )
        return out


@cache
def _grants() -> dict[str, str]:
    text = resources.files("outbox").joinpath("roles.sql").read_text(encoding="utf-8")
    return parse_queries(text)


def grant_statements(names: RoleNames) -> list[sql.Composed]:
    """The blocks of ``roles.sql`` (revoke, then each role's grants) with the names quoted."""
    idents = {purpose: sql.Identifier(name) for purpose, name in names.by_purpose().items()}
    return [
        sql.SQL(_grants()[block]).format(**idents)
        for block in ("revoke", "writer", "publisher", "operator")
    ]


def _check_names(conn: psycopg.Connection[Any], names: RoleNames) -> str:
    """The owner of the outbox tables, if the current user may grant on them and the
    names are fit to be these roles; ``OutboxError`` saying why not otherwise."""
    problem = names.problem()
    if problem:
        raise OutboxError(problem)
    given = list(names.by_purpose().values())
    row = conn.execute(query("outbox_tables_owner")).fetchone()
    if row is None:
        raise OutboxError("the outbox tables are missing: run `outbox migrate` first")
    owner, may_grant, user = row
    if not may_grant:
        raise OutboxError(
            f"only the owner of the outbox tables ({owner}) can grant on them, and {user} is "
            f"not: run this as {owner} (the role that runs `outbox migrate`)"
        )
    for name in given:
        if name == owner:
            raise OutboxError(
                f"role {name} owns the outbox tables: it cannot be the writer, publisher or "
                "operator (their grants would be revoked from the owner)"
            )
    for name, superuser in conn.execute(query("roles_named"), (given,)):
        if superuser:
            raise OutboxError(
                f"role {name} is a superuser: grants cannot limit it; choose another name"
            )
    return str(owner)


def create_roles(conn: psycopg.Connection[Any], names: RoleNames | None = None) -> RolesReport:
    """Create the missing roles (NOLOGIN) and grant each exactly its privileges.

    All in ``conn.transaction()``: one transaction, committed on return (a
    savepoint, if the caller has a transaction open).

    Idempotent: run it again at any time, and after every migration (a new
    table or a replaced view has no grants until then). Runs as the owner of
    the outbox tables; creating a role also needs CREATEROLE (roles that
    exist already do not). Holds the migration lock, so it waits for a
    migration in progress and never grants on a schema half migrated.
    """
    names = names or RoleNames()
    with conn.transaction():
        conn.execute(query("migration_lock"), (MIGRATION_LOCK_KEY,))
        owner = _check_names(conn, names)
        existing = {
            name
            for (name, _) in conn.execute(
                query("roles_named"), (list(names.by_purpose().values()),)
            )
        }
        created = []
        for name in names.by_purpose().values():
            if name in existing:
                continue
            try:
                conn.execute(sql.SQL(query("create_role")).format(role=sql.Identifier(name)))
            except psycopg.errors.InsufficientPrivilege as exc:
                raise OutboxError(
                    f"cannot create role {name}: {exc.diag.message_primary}. Create it as an "
                    f"administrator (CREATE ROLE {name} NOLOGIN) or give {owner} CREATEROLE, "
                    "then run this again"
                ) from None
            except psycopg.errors.DuplicateObject:
                raise OutboxError(
                    f"role {name} was created meanwhile by another run: run this again"
                ) from None
            created.append(name)
        for statement in grant_statements(names):
            try:
                conn.execute(statement)
            except (psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedTable) as exc:
                # The grants name what the latest migration made (a column since 0024).
                raise OutboxError(
                    f"the grants name what this version's migrations make, and the database "
                    f"lacks some of it ({exc.diag.message_primary}): run `outbox migrate` "
                    "first"
                ) from None
    return RolesReport(
        names=names,
        created=created,
        existing=[n for n in names.by_purpose().values() if n in existing],
        owner=owner,
    )


def granted_roles(conn: psycopg.Connection[Any]) -> list[str]:
    """Roles holding a grant on the outbox schema itself (other than its owner)."""
    return [name for (name,) in conn.execute(query("schema_grantees"))]
