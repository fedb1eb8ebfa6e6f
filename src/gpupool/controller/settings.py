"""The controller's settings, from the CLI or the environment."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

NODE_LOST_POLICIES = ("keep", "release")
DEFAULT_MAX_PRIORITY = 0
MAX_PRIORITY = 1000
"""Priorities run 0..1000 (LeaseCreate.priority)."""
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""The largest request a controller takes by default. The largest legitimate ones are an
agent's register (at most 1024 GPUs of about 300 bytes each: 0.3 MiB) and its heartbeat
(telemetry and one report per worker: tens of kB on a busy node); 4 MiB leaves a margin of
more than ten times and parses in tens of milliseconds."""


@dataclass(slots=True)
class ControllerSettings:
    host: str = "127.0.0.1"
    port: int = 8900
    data_dir: Path = field(default_factory=lambda: Path(".gpupool"))
    db_url: str | None = None
    """None: SQLite in `data_dir`; `postgresql://...` for the production store."""
    lease_ttl_s: float = 30.0
    """A lease whose holder sends no heartbeat for this long is released."""
    node_timeout_s: float = 15.0
    """A node whose agent sends no heartbeat for this long is marked down."""
    reconcile_interval_s: float = 0.5
    compute_ratio: float = 1.0
    memory_ratio: float = 1.0
    restart_grace_s: float | None = None
    """After a restart, holders get this long to heartbeat again (default: their ttl)."""
    webhook_url: str | None = None
    """Where alerts are POSTed (Alertmanager's webhook format) when they fire and end."""
    placement_policy: str = "default"
    """How requests are placed (core/placement): default, fgd, best-fit, packing, spread..."""
    fair_share: bool = True
    """Order equal-priority requests by their tenant's weighted dominant share."""
    max_queue_wait_s: float | None = None
    """A request still queued after this long fails with the reason it waited."""
    preemption: bool = True
    """Blocked higher-priority requests preempt lower-priority leases."""
    preempt_grace_s: float = 30.0
    """A preempted lease's holder has this long to stop before the lease is released."""
    default_max_priority: int | None = DEFAULT_MAX_PRIORITY
    """The highest priority a tenant token may ask for when its tenant has no max_priority
    of its own. 0 by default: no tenant outranks (and so preempts) another unless an
    operator allows it. Admin tokens may ask any priority. None: unlimited (not advised)."""
    physical_ready: int | None = None
    """Dual pool: move idle GPUs between the pools to follow demand, keeping this many idle
    physical GPUs while physical requests queue (None: only operators switch modes)."""

    admin_token: str | None = field(
        default_factory=lambda: os.environ.get("GPUPOOL_ADMIN_TOKEN", "").strip() or None
    )
    """An admin token to install at start ($GPUPOOL_ADMIN_TOKEN); None: on the first start the
    controller makes one and writes it to `data_dir/admin.token`."""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    """With both, the API and the dashboard are served over HTTPS only."""
    node_lost_policy: str = "keep"
    """What happens to the leases of a node that stays down: `keep` them while their holders
    heartbeat (a partition between agent and controller need not stop a job), or `release`
    them `node_lost_grace_s` after the node went down, so that the pool gets the GPUs back."""
    node_lost_grace_s: float = 60.0

    def __post_init__(self) -> None:
        if self.node_lost_policy not in NODE_LOST_POLICIES:
            raise ValueError(
                f"node_lost_policy must be one of {', '.join(NODE_LOST_POLICIES)}, "
                f"got {self.node_lost_policy!r}"
            )
        if self.default_max_priority is not None and not (
            0 <= self.default_max_priority <= MAX_PRIORITY
        ):
            raise ValueError(
                f"default_max_priority must be 0..{MAX_PRIORITY}, got {self.default_max_priority}"
            )
        if self.node_lost_grace_s < 0:
            raise ValueError(
                f"node_lost_grace_s must not be negative, got {self.node_lost_grace_s}"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(
                f"max_body_bytes must be at least 1024 (1 KiB), got {self.max_body_bytes}"
            )
    ha: bool = False
    """High availability: controllers sharing one PostgreSQL elect one leader (controller/ha)."""
    advertise_url: str | None = None
    """The URL other controllers forward writes to (default: http://host:port)."""
    ha_tick_s: float = 0.5
    """How often an HA controller tries for the lead, checks it still leads, and reports."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Request bodies over this many bytes are refused with 413 before they are read."""

    def own_url(self) -> str:
        """Where this controller is reached, as other controllers and the HA status show it."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def database_url(self) -> str:
        if self.db_url:
            url = self.db_url
            if url.startswith("postgresql://"):
                url = "postgresql+psycopg://" + url[len("postgresql://") :]
            elif url.startswith("postgres://"):
                url = "postgresql+psycopg://" + url[len("postgres://") :]
            return url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        database = self.data_dir / "gpupool.db"
        # The database holds every remote lease's tokens and peer secrets: the controller's
        # user alone may enter the directory (a worker user on the same host may not).
        try:
            os.chmod(self.data_dir, 0o700)
        except PermissionError:
            # A directory of another owner: a container's volume (root's, 0777, the pod's
            # fsGroup) for a controller of an unprivileged user. The database file is then
            # made owner-only before SQLite opens it; its journal and WAL take its mode.
            fd = os.open(database, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
        return f"sqlite:///{database.resolve()}"
