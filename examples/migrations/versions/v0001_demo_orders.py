"""The demo service's orders.

Revision ID: 0001
Revises:
Create Date: 2025-11-30 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Create demo_orders (examples/demo_service.py's Order)."""
    op.create_table(
        "demo_orders",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("customer", sa.String(), nullable=False),
        sa.Column("total", sa.Numeric(), nullable=False),
        sa.Column("placed_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    """Drop demo_orders."""
    op.drop_table("demo_orders")
