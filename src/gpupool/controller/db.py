"""Engines for SQLite (WAL) and PostgreSQL, and schema migrations with alembic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event

MIGRATIONS = Path(__file__).with_name("migrations")


def make_engine(url: str, connect_args: dict[str, Any] | None = None) -> Engine:
    """An engine for `url`; `connect_args` go to the PostgreSQL driver (HA sets keepalives)."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=8,
            max_overflow=8,
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(
        url, pool_size=8, max_overflow=8, pool_pre_ping=True, connect_args=connect_args or {}
    )


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers run beside the one writer; NORMAL is durable across a process kill
    # (only an OS crash can lose the last commits), which is the failure we promise to survive.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    # No checkpoint inside a commit: it would stall the writer for an fsync. The reconcile
    # loop checkpoints in the background instead (see `checkpoint`).
    cursor.execute("PRAGMA wal_autocheckpoint=0")
    cursor.close()


def checkpoint(engine: Engine) -> None:
    """Fold SQLite's write-ahead log into the database without blocking the writer."""
    if engine.dialect.name != "sqlite":
        return
    with engine.connect() as connection:
        connection.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest revision; safe to run on every start."""
    config = alembic_config(str(engine.url))
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            # Two controllers starting together must not both create the tables.
            connection.exec_driver_sql("SELECT pg_advisory_xact_lock(7210001)")
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
