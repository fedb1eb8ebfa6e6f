"""Migration 0008 gives every remote lease held across the upgrade a peer secret of its own, on
SQLite and PostgreSQL; direct leases get none, and the downgrade drops the column."""

from __future__ import annotations

from datetime import UTC
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from gpupool.controller.db import alembic_config, make_engine


def _upgrade_with_leases(url: str) -> dict[str, str | None]:
    engine = make_engine(url)
    config = alembic_config(str(engine.url))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0007")
        _insert(connection, "tenants", name="t")
        for lease_id, token in (("remote-1", "tok-1"), ("remote-2", "tok-2"), ("direct", None)):
            access = "remote" if token else "direct"
            _insert(connection, "leases", id=lease_id, tenant="t", state="granted", gpus=1,
                    access=access, worker_token=token)  # fmt: skip
        command.upgrade(config, "0008")
        rows = connection.execute(sa.text("SELECT id, peer_secret FROM leases")).all()
        command.downgrade(config, "0007")
        columns = [c["name"] for c in sa.inspect(connection).get_columns("leases")]
    engine.dispose()
    assert "peer_secret" not in columns
    return {row[0]: row[1] for row in rows}


def _insert(connection: sa.Connection, table: str, **given: object) -> None:
    """A row with `given` and a plain value for every other column that needs one (the
    schema at 0007, whatever its other migrations made required)."""
    from datetime import datetime

    values = dict(given)
    for column in sa.inspect(connection).get_columns(table):
        name, kind = column["name"], column["type"]
        if name in values or column["nullable"] or column.get("default") is not None:
            continue
        if column.get("autoincrement") is True:
            continue
        if isinstance(kind, sa.Boolean):
            values[name] = False
        elif isinstance(kind, sa.Integer | sa.Float | sa.Numeric):
            values[name] = 0
        elif isinstance(kind, sa.DateTime):
            values[name] = datetime.now(UTC)
        elif isinstance(kind, sa.JSON):
            values[name] = "[]"
        else:
            values[name] = ""
    names = ", ".join(values)
    marks = ", ".join(f":{n}" for n in values)
    connection.execute(sa.text(f"INSERT INTO {table} ({names}) VALUES ({marks})"), values)


def _check(secrets: dict[str, str | None]) -> None:
    assert secrets["direct"] is None
    assert secrets["remote-1"] and secrets["remote-2"]
    assert secrets["remote-1"] != secrets["remote-2"]
    assert len(secrets["remote-1"] or "") >= 40


def test_remote_leases_get_distinct_peer_secrets_on_sqlite(tmp_path: Path) -> None:
    _check(_upgrade_with_leases(f"sqlite:///{tmp_path / 'pool.db'}"))


def test_remote_leases_get_distinct_peer_secrets_on_postgresql(pg_url: str) -> None:
    _check(_upgrade_with_leases(pg_url.replace("postgresql://", "postgresql+psycopg://", 1)))


@pytest.fixture(autouse=True)
def _quiet_alembic(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="alembic")
