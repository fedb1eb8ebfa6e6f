"""Elastic slices: idle timeouts (per lease, per tenant) and a remote lease's worker handoff.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("idle_timeout_s", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("elastic", sa.JSON(), nullable=True))
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("idle_timeout_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("idle_timeout_s")
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("elastic")
        batch_op.drop_column("idle_timeout_s")
