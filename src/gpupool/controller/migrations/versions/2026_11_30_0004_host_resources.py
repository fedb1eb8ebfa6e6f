"""Direct leases' CPU and memory of the server they run on, and what was charged where.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 15:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("cpu_milli", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(
            sa.Column("host_memory_mib", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(sa.Column("host_charge", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("host_charge")
        batch_op.drop_column("host_memory_mib")
        batch_op.drop_column("cpu_milli")
