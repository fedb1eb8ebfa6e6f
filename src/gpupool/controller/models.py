"""All tables of the controller's store, in one place (SQLAlchemy 2 declarative)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    TypeDecorator,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


class UtcDateTime(TypeDecorator[datetime]):
    """Stores UTC and always returns aware datetimes, also on SQLite which drops the zone."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UtcDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class NodeRow(Base):
    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    address: Mapped[str | None] = mapped_column(String(256))
    agent_url: Mapped[str | None] = mapped_column(String(512))
    state: Mapped[str] = mapped_column(String(16), default="up")
    backend: Mapped[str] = mapped_column(String(32), default="fake")
    cpu_count: Mapped[int | None] = mapped_column(Integer)
    memory_mib: Mapped[int | None] = mapped_column(Integer)
    driver_version: Mapped[str | None] = mapped_column(String(64))
    cuda_version: Mapped[str | None] = mapped_column(String(64))
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(default=utcnow)
    host: Mapped[dict[str, Any]] = mapped_column(default=dict)


class GpuRow(Base):
    __tablename__ = "gpus"

    uuid: Mapped[str] = mapped_column(String(128), primary_key=True)
    node: Mapped[str] = mapped_column(ForeignKey("nodes.name", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer, default=0)
    model: Mapped[str] = mapped_column(String(128))
    memory_mib: Mapped[int] = mapped_column(Integer)
    mode: Mapped[str] = mapped_column(String(16), default="virtual")
    target_mode: Mapped[str | None] = mapped_column(String(16))
    healthy: Mapped[bool] = mapped_column(Boolean, default=True)
    simulated: Mapped[bool] = mapped_column(Boolean, default=False)
    pci_bus_id: Mapped[str | None] = mapped_column(String(32))
    isolation_reason: Mapped[str | None] = mapped_column(String(512))
    telemetry: Mapped[dict[str, Any]] = mapped_column(default=dict)


class TenantRow(Base):
    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    max_gpus: Mapped[int | None] = mapped_column(Integer)
    max_memory_mib: Mapped[int | None] = mapped_column(Integer)
    max_compute_pct: Mapped[int | None] = mapped_column(Integer)
    max_leases: Mapped[int | None] = mapped_column(Integer)
    max_priority: Mapped[int | None] = mapped_column(Integer)
    guaranteed_gpus: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    idle_timeout_s: Mapped[float | None] = mapped_column(Float)
    """Remote leases of the tenant are swapped out after this long without GPU work."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column()
    """Set when a tenant with lease history is deleted: the rows of its leases (the history)
    point to it, so it stays, unlisted and taking no leases, until its name is created again."""


class TokenRow(Base):
    """An API token. Only a hash of its secret is kept: a leaked database grants nothing."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    tenant: Mapped[str | None] = mapped_column(ForeignKey("tenants.name"))
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime | None] = mapped_column()
    revoked_at: Mapped[datetime | None] = mapped_column()
    node: Mapped[str | None] = mapped_column(String(128), index=True)
    """The one node an agent token acts for; None for the other roles (and for agent tokens
    of databases older than node-bound tokens, which are refused)."""
    joins_left: Mapped[int | None] = mapped_column(Integer)
    """How many more new nodes a join token may make node-bound agent tokens for."""


class LeaseRow(Base):
    __tablename__ = "leases"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"))
    state: Mapped[str] = mapped_column(String(16))
    gpus: Mapped[int] = mapped_column(Integer)
    compute_pct: Mapped[int | None] = mapped_column(Integer)
    memory_mib: Mapped[int | None] = mapped_column(Integer)
    physical: Mapped[bool] = mapped_column(Boolean, default=False)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    access: Mapped[str] = mapped_column(String(16), default="direct")
    node: Mapped[str | None] = mapped_column(String(128))
    gpu_models: Mapped[list[Any]] = mapped_column(default=list)
    span_nodes: Mapped[bool] = mapped_column(Boolean, default=True)
    holder: Mapped[str] = mapped_column(String(256), default="")
    ttl_s: Mapped[float] = mapped_column(Float)
    queue_seq: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    granted_at: Mapped[datetime | None] = mapped_column()
    released_at: Mapped[datetime | None] = mapped_column()
    last_heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    release_reason: Mapped[str | None] = mapped_column(String(256))
    prefer_node: Mapped[str | None] = mapped_column(String(128))
    max_wait_s: Mapped[float | None] = mapped_column(Float)
    preempt_deadline_at: Mapped[datetime | None] = mapped_column()
    preempted_by: Mapped[str | None] = mapped_column(String(32))
    """The queued request a preempted lease makes room for: if it goes away (released,
    expired, granted elsewhere) before this lease is gone, the preemption is withdrawn."""
    worker_token: Mapped[str | None] = mapped_column(String(64))
    peer_secret: Mapped[str | None] = mapped_column(String(64))
    """A remote lease's worker secret: its workers (devices, successors) know each other by it.
    Only the agents that host the lease get it, never its holder."""
    cpu_milli: Mapped[int] = mapped_column(Integer, default=0)
    host_memory_mib: Mapped[int] = mapped_column(Integer, default=0)
    host_charge: Mapped[list[Any] | None] = mapped_column()
    """(node, CPU milli, memory MiB) charged to each server of a granted direct lease."""
    request_id: Mapped[str | None] = mapped_column(String(64))
    """The client's key for this request: a request sent again (after a controller failed
    over mid-answer) finds the lease it already made instead of making a second one."""
    """The data-plane token of a remote lease: its holder and its workers share it."""
    idle_timeout_s: Mapped[float | None] = mapped_column(Float)
    """A remote lease is swapped out after this long without GPU work (None: the tenant's)."""
    elastic: Mapped[dict[str, Any] | None] = mapped_column()
    """A remote lease's worker generation and, while its state moves, the handoff
    (services/elastic.py): which workers to keep until their successors took over."""

    slices: Mapped[list[LeaseSliceRow]] = relationship(
        back_populates="lease",
        order_by="LeaseSliceRow.position",
        cascade="all, delete-orphan",
        lazy="selectin",
    )

    __table_args__ = (
        Index("ix_leases_state", "state"),
        Index("ix_leases_tenant_state", "tenant", "state"),
        Index("ix_leases_request_id", "request_id", unique=True),
    )


class LeaseSliceRow(Base):
    __tablename__ = "lease_slices"

    lease_id: Mapped[str] = mapped_column(
        ForeignKey("leases.id", ondelete="CASCADE"), primary_key=True
    )
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpu_uuid: Mapped[str] = mapped_column(String(128), index=True)
    node: Mapped[str] = mapped_column(String(128))
    gpu_index: Mapped[int] = mapped_column(Integer)
    compute_pct: Mapped[int] = mapped_column(Integer)
    memory_mib: Mapped[int] = mapped_column(Integer)
    whole: Mapped[bool] = mapped_column(Boolean, default=False)
    endpoint: Mapped[str | None] = mapped_column(String(256))
    """Where the worker of a remote slice listens, once its agent has started it."""

    lease: Mapped[LeaseRow] = relationship(back_populates="slices")


class EventRow(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(64), index=True)
    subject: Mapped[str] = mapped_column(String(128), index=True)
    message: Mapped[str] = mapped_column(String(1024))
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)


class HaLeaderRow(Base):
    """The one row saying which controller leads; `epoch` grows with every takeover and
    fences the writes of a leader that lost its place without knowing it yet."""

    __tablename__ = "ha_leader"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    controller: Mapped[str | None] = mapped_column(String(512))
    url: Mapped[str | None] = mapped_column(String(512))
    since: Mapped[datetime | None] = mapped_column()
    changes: Mapped[int] = mapped_column(BigInteger, default=0)
    """Counts the leader's write transactions: a standby whose copy of the pool was loaded
    at a lower count reloads it before it answers a read."""


class HaMemberRow(Base):
    """Each controller of an HA group, as it last reported itself."""

    __tablename__ = "ha_members"

    id: Mapped[str] = mapped_column(String(512), primary_key=True)
    url: Mapped[str] = mapped_column(String(512))
    role: Mapped[str] = mapped_column(String(16))
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[str] = mapped_column(String(64), default="")
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(default=utcnow)
