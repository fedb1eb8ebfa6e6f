"""Alembic environment: runs on the connection the controller hands over (no alembic.ini)."""

from __future__ import annotations

from alembic import context

from gpupool.controller.models import Base

config = context.config
connection = config.attributes.get("connection")


def run() -> None:
    if connection is None:
        url = config.get_main_option("sqlalchemy.url")
        context.configure(url=url, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


run()
