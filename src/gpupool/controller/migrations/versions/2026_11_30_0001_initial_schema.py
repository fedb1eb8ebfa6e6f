"""Initial schema: nodes, GPUs, tenants, leases with their slices, and the event log.

Revision ID: 0001
Revises:
Create Date: 2026-11-30 13:13:26.281343
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("subject", sa.String(length=128), nullable=False),
        sa.Column("message", sa.String(length=1024), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_events_at"), ["at"], unique=False)
        batch_op.create_index(batch_op.f("ix_events_kind"), ["kind"], unique=False)
        batch_op.create_index(batch_op.f("ix_events_subject"), ["subject"], unique=False)

    op.create_table(
        "nodes",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("address", sa.String(length=256), nullable=True),
        sa.Column("agent_url", sa.String(length=512), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("backend", sa.String(length=32), nullable=False),
        sa.Column("cpu_count", sa.Integer(), nullable=True),
        sa.Column("memory_mib", sa.Integer(), nullable=True),
        sa.Column("driver_version", sa.String(length=64), nullable=True),
        sa.Column("cuda_version", sa.String(length=64), nullable=True),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("host", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "tenants",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("max_gpus", sa.Integer(), nullable=True),
        sa.Column("max_memory_mib", sa.Integer(), nullable=True),
        sa.Column("max_compute_pct", sa.Integer(), nullable=True),
        sa.Column("max_leases", sa.Integer(), nullable=True),
        sa.Column("max_priority", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "gpus",
        sa.Column("uuid", sa.String(length=128), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("memory_mib", sa.Integer(), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("target_mode", sa.String(length=16), nullable=True),
        sa.Column("healthy", sa.Boolean(), nullable=False),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.Column("pci_bus_id", sa.String(length=32), nullable=True),
        sa.Column("isolation_reason", sa.String(length=512), nullable=True),
        sa.Column("telemetry", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["node"], ["nodes.name"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("uuid"),
    )
    with op.batch_alter_table("gpus", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_gpus_node"), ["node"], unique=False)

    op.create_table(
        "leases",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("compute_pct", sa.Integer(), nullable=True),
        sa.Column("memory_mib", sa.Integer(), nullable=True),
        sa.Column("physical", sa.Boolean(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("access", sa.String(length=16), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=True),
        sa.Column("gpu_models", sa.JSON(), nullable=False),
        sa.Column("span_nodes", sa.Boolean(), nullable=False),
        sa.Column("holder", sa.String(length=256), nullable=False),
        sa.Column("ttl_s", sa.Float(), nullable=False),
        sa.Column("queue_seq", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("granted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("released_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("release_reason", sa.String(length=256), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant"],
            ["tenants.name"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.create_index("ix_leases_state", ["state"], unique=False)
        batch_op.create_index("ix_leases_tenant_state", ["tenant", "state"], unique=False)

    op.create_table(
        "lease_slices",
        sa.Column("lease_id", sa.String(length=32), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=128), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("compute_pct", sa.Integer(), nullable=False),
        sa.Column("memory_mib", sa.Integer(), nullable=False),
        sa.Column("whole", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["lease_id"], ["leases.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("lease_id", "position"),
    )
    with op.batch_alter_table("lease_slices", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_lease_slices_gpu_uuid"), ["gpu_uuid"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("lease_slices", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_lease_slices_gpu_uuid"))

    op.drop_table("lease_slices")
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index("ix_leases_tenant_state")
        batch_op.drop_index("ix_leases_state")

    op.drop_table("leases")
    with op.batch_alter_table("gpus", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_gpus_node"))

    op.drop_table("gpus")
    op.drop_table("tenants")
    op.drop_table("nodes")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_events_subject"))
        batch_op.drop_index(batch_op.f("ix_events_kind"))
        batch_op.drop_index(batch_op.f("ix_events_at"))

    op.drop_table("events")
