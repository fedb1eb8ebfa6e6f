"""The controller's settings, from the CLI or the environment."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


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

    def database_url(self) -> str:
        if self.db_url:
            url = self.db_url
            if url.startswith("postgresql://"):
                url = "postgresql+psycopg://" + url[len("postgresql://") :]
            elif url.startswith("postgres://"):
                url = "postgresql+psycopg://" + url[len("postgres://") :]
            return url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(self.data_dir / 'gpupool.db').resolve()}"
