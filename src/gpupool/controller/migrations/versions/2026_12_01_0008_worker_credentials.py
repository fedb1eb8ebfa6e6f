"""Worker credentials: a remote lease's peer secret, which its workers know each other by.

The lease's client token opened every role of its workers (control, successor, peer); the
peer secret separates the workers' roles from the tenant's. Remote leases held across the
upgrade get one now: their running workers were started without it, so their peer copies
and handoffs work again only with workers started after the upgrade.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 21:00:00
"""

import secrets
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("peer_secret", sa.String(length=64), nullable=True))
    leases = sa.table(
        "leases",
        sa.column("id", sa.String(32)),
        sa.column("worker_token", sa.String(64)),
        sa.column("peer_secret", sa.String(64)),
    )
    connection = op.get_bind()
    remote = connection.execute(
        sa.select(leases.c.id).where(leases.c.worker_token.is_not(None))
    ).scalars()
    for lease_id in list(remote):
        connection.execute(
            leases.update()
            .where(leases.c.id == lease_id)
            .values(peer_secret=secrets.token_urlsafe(32))
        )


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("peer_secret")
