"""Remote leases: the data-plane token of a lease and the worker endpoint of each slice.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 15:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("worker_token", sa.String(length=64), nullable=True))
    with op.batch_alter_table("lease_slices", schema=None) as batch_op:
        batch_op.add_column(sa.Column("endpoint", sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("lease_slices", schema=None) as batch_op:
        batch_op.drop_column("endpoint")
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("worker_token")
