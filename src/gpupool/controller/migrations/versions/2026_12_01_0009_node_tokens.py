"""Node-bound agent tokens, join tokens, and the cause of each preemption.

An agent token now names the one node it acts for (`tokens.node`); a join token may make
node-bound agent tokens for at most `tokens.joins_left` new nodes. Agent tokens of older
databases name no node: they are kept, but refused with a message saying how to make a node
token (services/auth.py), since no row says which node each one served. A preempted lease
remembers the request it makes room for (`leases.preempted_by`), so that the preemption is
withdrawn when that request goes away, also across a controller restart.

Revision ID: 0009
Revises: 0007
Create Date: 2026-12-01 20:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("node", sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column("joins_left", sa.Integer(), nullable=True))
        batch_op.create_index("ix_tokens_node", ["node"], unique=False)
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preempted_by", sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("preempted_by")
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.drop_index("ix_tokens_node")
        batch_op.drop_column("joins_left")
        batch_op.drop_column("node")
