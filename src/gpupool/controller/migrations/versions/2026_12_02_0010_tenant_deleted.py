"""Tenants deleted with their history kept.

A tenant that ever held a lease could not be deleted: its leases' rows (the history that
`gpupool lease ls --all` and the events show) point to it. Such a tenant is now marked
deleted (`tenants.deleted_at`): it takes no leases, is not listed, and its name may be
created again; its history stays readable.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 00:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("deleted_at")
