"""The outbox schema, at the version the installed outbox package ships.

Revision ID: 0002
Revises: 0001
Create Date: 2025-11-30 09:05:00
"""

from __future__ import annotations

from alembic import op

from outbox.migrations import migrate_connection

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply the outbox's SQL migrations the database lacks, in this transaction."""
    migrate_connection(op.get_bind())


def downgrade() -> None:
    """Keep the outbox schema: dropping it would lose messages not yet delivered."""
