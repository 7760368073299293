"""Alembic environment of the demo service: its own tables and the outbox schema.

The outbox schema is created and upgraded by the outbox package's own SQL
migrations, run from a revision (versions/v0002_outbox.py). Here its tables
join the service's in ``target_metadata``, so that autogenerate knows them and
proposes nothing for them.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

import sqlalchemy as sa
from alembic import context
from demo_service import Base

import outbox.metadata

config = context.config
# Programs that run these migrations themselves (tests, a service at start-up)
# keep their own logging by setting config.attributes["configure_logger"] = False.
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = [Base.metadata, outbox.metadata.metadata]


def database_url() -> str:
    """sqlalchemy.url if set, else OUTBOX_DATABASE_URL, on the psycopg 3 driver."""
    url = config.get_main_option("sqlalchemy.url") or os.environ["OUTBOX_DATABASE_URL"]
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


def run_migrations_online() -> None:
    """Run the revisions on one connection, in one transaction."""
    engine = sa.create_engine(database_url(), poolclass=sa.pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            # Compare the outbox schema too, and no schema but it and the default one.
            include_schemas=True,
            include_name=outbox.metadata.include_name,
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    # The outbox revision reads outbox.schema_migrations before it writes.
    raise SystemExit("these migrations need a database connection: run them without --sql")
run_migrations_online()
