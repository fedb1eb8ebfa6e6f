"""High availability: the leader row, the members of the group, and lease request keys.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 16:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("request_id", sa.String(64), nullable=True))
        batch_op.create_index("ix_leases_request_id", ["request_id"], unique=True)
    op.create_table(
        "ha_leader",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("epoch", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("controller", sa.String(512), nullable=True),
        sa.Column("url", sa.String(512), nullable=True),
        sa.Column("since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("changes", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.execute("INSERT INTO ha_leader (id, epoch) VALUES (1, 0)")
    op.create_table(
        "ha_members",
        sa.Column("id", sa.String(512), primary_key=True),
        sa.Column("url", sa.String(512), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("version", sa.String(64), nullable=False, server_default=""),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("ha_members")
    op.drop_table("ha_leader")
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index("ix_leases_request_id")
        batch_op.drop_column("request_id")
