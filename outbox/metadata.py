"""The outbox tables as SQLAlchemy ``Table`` objects, for Alembic autogenerate.

The SQL migrations in ``schema/`` are what create and upgrade the outbox
schema: besides tables they create views, a trigger function, a trigger and
seed rows, which no ``MetaData`` can describe. Run them from an Alembic
revision with ``outbox.migrations.migrate_connection(op.get_bind())``.

This module mirrors, table by table, what those migrations leave behind:
columns with their types, nullability and server defaults, identity and
generated columns, primary keys, unique and check constraints by name, and
indexes with their ``WHERE`` clauses. Put ``metadata`` in Alembic's
``target_metadata`` next to your own and autogenerate finds nothing to
change in the ``outbox`` schema, instead of proposing to drop the tables it
did not know about. ``tests/integration/test_metadata.py`` holds it to the
migrated schema, so a new migration without a matching change here fails.

The tables are also usable for read-only SQLAlchemy Core queries
(``select(messages).where(...)``); write through ``outbox.enqueue`` and the
CLI, which keep the invariants the constraints alone do not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    import sqlalchemy as sa
    from sqlalchemy.dialects import postgresql as pg
except ModuleNotFoundError as missing:  # the library alone does not install it
    raise ModuleNotFoundError(
        "outbox.metadata describes the outbox tables to SQLAlchemy, which is not installed: "
        "pip install 'pg-kafka-outbox[sqlalchemy]'",
        name=missing.name,
    ) from missing

#: The PostgreSQL schema holding every outbox object.
SCHEMA = "outbox"

#: The outbox tables, in their own ``MetaData`` so that it can sit next to an
#: application's own in Alembic's ``target_metadata`` list.
metadata = sa.MetaData(schema=SCHEMA)

_NOW = sa.text("now()")
_FALSE = sa.text("false")
_ZERO = sa.text("0")


def _tstz() -> sa.DateTime:
    return sa.DateTime(timezone=True)


#: Applied migrations (written by ``outbox migrate`` / ``migrate_connection``).
schema_migrations = sa.Table(
    "schema_migrations",
    metadata,
    sa.Column("version", sa.Integer, nullable=False, autoincrement=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("applied_at", _tstz(), nullable=False, server_default=_NOW),
    sa.PrimaryKeyConstraint("version", name="schema_migrations_pkey"),
)

#: One row per publication intent; every migration so far changed it.
messages = sa.Table(
    "messages",
    metadata,
    sa.Column("id", sa.Uuid, nullable=False),
    sa.Column("seq", sa.BigInteger, sa.Identity(always=True), nullable=False),
    sa.Column("topic", sa.Text, nullable=False),
    sa.Column("key", pg.BYTEA),
    sa.Column("value", pg.BYTEA, nullable=False),
    sa.Column("header_names", pg.ARRAY(sa.Text), nullable=False, server_default=sa.text("'{}'")),
    sa.Column("header_values", pg.ARRAY(pg.BYTEA), nullable=False, server_default=sa.text("'{}'")),
    sa.Column("idempotency_key", sa.Text),
    sa.Column("state", sa.Text, nullable=False, server_default=sa.text("'pending'")),
    sa.Column("created_at", _tstz(), nullable=False, server_default=_NOW),
    sa.Column("available_at", _tstz(), nullable=False, server_default=_NOW),
    sa.Column("fence", sa.BigInteger, nullable=False, server_default=_ZERO),
    sa.Column("attempts", sa.Integer, nullable=False, server_default=_ZERO),
    sa.Column("kafka_partition", sa.Integer),
    sa.Column("kafka_offset", sa.BigInteger),
    sa.Column("delivered_at", _tstz()),
    sa.Column("updated_at", _tstz(), nullable=False, server_default=_NOW),
    sa.Column("last_error", sa.Text),
    sa.Column("batch_id", sa.BigInteger),
    sa.Column("escalated_at", _tstz()),
    # The generated columns' SQL is 0003's and 0004's with E'\n' written as a
    # plain literal holding a newline (the same string): Alembic compares this
    # text with PostgreSQL's, quotes and whitespace stripped, and warns that
    # it "cannot be modified" when the two differ.
    sa.Column(
        "key_hash",
        sa.BigInteger,
        sa.Computed(
            "CASE WHEN key IS NULL THEN NULL "
            "ELSE hashtextextended(topic || '\n' || encode(key, 'hex'), 0) END",
            persisted=True,
        ),
    ),
    sa.Column("failures", sa.Integer, nullable=False, server_default=_ZERO),
    sa.Column("send_alone", sa.Boolean, nullable=False, server_default=_FALSE),
    sa.Column(
        "lane",
        sa.SmallInteger,
        sa.Computed(
            "((hashtextextended(CASE WHEN key IS NULL THEN id::text "
            "ELSE topic || '\n' || encode(key, 'hex') END, 0) % 32 + 32) % 32)::smallint",
            persisted=True,
        ),
    ),
    # Pending behind an uncertain or quarantined message of its key (0013): out of the claim's way.
    sa.Column("held", sa.Boolean, nullable=False, server_default=_FALSE),
    sa.PrimaryKeyConstraint("id", name="messages_pkey"),
    sa.UniqueConstraint("idempotency_key", name="messages_idempotency_key_key"),
    sa.CheckConstraint(
        "state IN ('pending', 'in_flight', 'delivered', 'uncertain', 'quarantined', 'discarded')",
        name="messages_state_known",
    ),
    # In flight is derived from the open batches, never stored (0019).
    sa.CheckConstraint("state <> 'in_flight'", name="messages_in_flight_derived"),
    sa.CheckConstraint(
        "cardinality(header_names) = cardinality(header_values)",
        name="messages_headers_paired",
    ),
    sa.Index(
        "messages_pending_by_lane",
        "lane",
        "held",
        "seq",
        postgresql_where=sa.text("state = 'pending'"),
    ),
    sa.Index(
        "messages_batch",
        "batch_id",
        postgresql_where=sa.text("state IN ('in_flight', 'uncertain')"),
    ),
    sa.Index("messages_uncertain", "available_at", postgresql_where=sa.text("state = 'uncertain'")),
    sa.Index("messages_quarantined", "topic", postgresql_where=sa.text("state = 'quarantined'")),
    sa.Index(
        "messages_open_keys",
        "key_hash",
        "seq",
        postgresql_where=sa.text(
            "key IS NOT NULL AND state IN ('pending', 'in_flight', 'uncertain', 'quarantined')"
        ),
    ),
    sa.Index(
        "messages_holding_keys",
        "key_hash",
        "seq",
        postgresql_where=sa.text(
            "key IS NOT NULL AND (state IN ('in_flight', 'uncertain', 'quarantined') "
            "OR (state = 'pending' AND (failures > 0 OR held)))"
        ),
    ),
)

#: One row per publisher process: who it is and whether it is alive.
publishers = sa.Table(
    "publishers",
    metadata,
    sa.Column("id", sa.Uuid, nullable=False),
    sa.Column("host", sa.Text, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("version", sa.Text, nullable=False),
    sa.Column("started_at", _tstz(), nullable=False, server_default=_NOW),
    sa.Column("heartbeat_at", _tstz(), nullable=False, server_default=_NOW),
    sa.Column("stopped_at", _tstz()),
    sa.Column("transactional_id", sa.Text),
    sa.Column("lease_seconds", sa.Double),
    sa.Column("kafka_reached_at", sa.DateTime(timezone=True)),
    sa.CheckConstraint("lease_seconds > 0", name="publishers_lease_seconds_check"),
    sa.PrimaryKeyConstraint("id", name="publishers_pkey"),
)

#: One row per attempt to deliver a message; kept after its message is
#: purged (no foreign key since 0005), until retention deletes it.
attempts = sa.Table(
    "attempts",
    metadata,
    sa.Column("message_id", sa.Uuid, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("publisher_id", sa.Uuid, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
    sa.Column("started_at", _tstz(), nullable=False),
    sa.Column("send_began", sa.Boolean, nullable=False, server_default=_FALSE),
    sa.Column("finished_at", _tstz()),
    sa.Column("outcome", sa.Text),
    sa.Column("error", sa.Text),
    sa.Column("kafka_partition", sa.Integer),
    sa.Column("kafka_offset", sa.BigInteger),
    sa.Column("batch_id", sa.BigInteger),
    sa.PrimaryKeyConstraint("message_id", "attempt", name="attempts_pkey"),
    sa.CheckConstraint(
        "outcome IS NULL "
        "OR outcome IN ('delivered', 'failed', 'uncertain', 'abandoned', 'recovered')",
        name="attempts_outcome_known",
    ),
)

#: The message states with what each means for an operator (seeded by 0001).
states = sa.Table(
    "states",
    metadata,
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("position", sa.Integer, nullable=False),
    sa.Column("healthy", sa.Boolean, nullable=False),
    sa.Column("next_action", sa.Text, nullable=False),
    sa.PrimaryKeyConstraint("state", name="states_pkey"),
    sa.UniqueConstraint("position", name="states_position_key"),
)

#: One row per claim, naming its messages: open (in flight) until settled or
#: recovered, then the evidence reconciliation decides from and the record of
#: a delivery (0007).
batches = sa.Table(
    "batches",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
    sa.Column("publisher_id", sa.Uuid, nullable=False),
    sa.Column("claimed_at", _tstz(), nullable=False, server_default=_NOW),
    sa.Column("send_began_at", _tstz()),
    sa.Column("write_deadline", _tstz()),
    sa.Column("partition_counts", pg.JSONB),
    sa.Column("confirmed_offsets", pg.JSONB),
    sa.Column("settled_at", _tstz()),
    sa.Column("transactional_id", sa.Text),
    sa.Column("message_ids", pg.ARRAY(sa.Uuid), nullable=False, server_default=sa.text("'{}'")),
    sa.Column(
        "key_hashes", pg.ARRAY(sa.BigInteger), nullable=False, server_default=sa.text("'{}'")
    ),
    sa.Column("lease_expires_at", _tstz()),
    sa.PrimaryKeyConstraint("id", name="batches_pkey"),
    sa.Index("batches_publisher", "publisher_id"),
    sa.Index("batches_open", "lease_expires_at", postgresql_where=sa.text("settled_at IS NULL")),
)

#: The highest offset confirmed so far in each topic partition.
partition_offsets = sa.Table(
    "partition_offsets",
    metadata,
    sa.Column("topic", sa.Text, nullable=False),
    sa.Column("kafka_partition", sa.Integer, nullable=False),
    sa.Column("confirmed_offset", sa.BigInteger, nullable=False),
    sa.Column("updated_at", _tstz(), nullable=False, server_default=_NOW),
    sa.PrimaryKeyConstraint("topic", "kafka_partition", name="partition_offsets_pkey"),
)

#: Every decision taken on a message after the fact, by the reconciler or an
#: operator; like attempts, kept after its message is purged.
decisions = sa.Table(
    "decisions",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
    sa.Column("message_id", sa.Uuid, nullable=False),
    sa.Column("decided_at", _tstz(), nullable=False, server_default=_NOW),
    sa.Column("decided_by", sa.Text, nullable=False),
    sa.Column("from_state", sa.Text, nullable=False),
    sa.Column("to_state", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("evidence", pg.JSONB, nullable=False, server_default=sa.text("'{}'")),
    sa.PrimaryKeyConstraint("id", name="decisions_pkey"),
    sa.Index("decisions_message", "message_id"),
    # outbox.status counts discarded messages through their decisions (0009).
    sa.Index(
        "decisions_discarded", "message_id", postgresql_where=sa.text("to_state = 'discarded'")
    ),
)

#: The 32 lanes publishers own under leases (seeded by 0004).
lanes = sa.Table(
    "lanes",
    metadata,
    sa.Column("lane", sa.SmallInteger, nullable=False, autoincrement=False),
    sa.Column("owner", sa.Uuid),
    sa.Column("lease_expires_at", _tstz()),
    sa.Column("fence", sa.BigInteger, nullable=False, server_default=_ZERO),
    sa.Column("acquired_at", _tstz()),
    sa.PrimaryKeyConstraint("lane", name="lanes_pkey"),
    sa.CheckConstraint(
        "(owner IS NULL) = (lease_expires_at IS NULL)", name="lanes_owned_with_lease"
    ),
)


def include_name(name: str | None, type_: str, parent_names: Mapping[Any, str | None]) -> bool:
    """Alembic ``include_name`` hook: compare the default schema and ``outbox`` only.

    With ``include_schemas=True`` Alembic reflects every schema in the
    database and proposes to drop each table no ``target_metadata`` declares;
    this keeps it to your tables (the default schema) and the outbox's.
    Wrap it if you manage more schemas::

        def include_name(name, type_, parent_names):
            if type_ == "schema":
                return name in (None, "outbox", "billing")
            return True
    """
    if type_ == "schema":
        return name is None or name == SCHEMA
    return True
