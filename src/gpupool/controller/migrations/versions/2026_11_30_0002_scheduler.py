"""Scheduler: tenants' guaranteed share; leases' preferred server, maximum wait and the end of
their preemption grace period.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 14:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("guaranteed_gpus", sa.Float(), nullable=False, server_default="0")
        )
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("prefer_node", sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column("max_wait_s", sa.Float(), nullable=True))
        batch_op.add_column(
            sa.Column("preempt_deadline_at", sa.DateTime(timezone=True), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("preempt_deadline_at")
        batch_op.drop_column("max_wait_s")
        batch_op.drop_column("prefer_node")
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("guaranteed_gpus")
