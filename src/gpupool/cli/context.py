"""Who the CLI is and which controller it talks to, shared by every command."""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass

import typer

from gpupool.client.sdk import PoolClient, resolve_url


def default_actor() -> str:
    """$USER, else the login name, else 'cli': recorded by the controller in its events."""
    user = os.environ.get("USER")
    if user:
        return user
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "cli"


@dataclass(frozen=True, slots=True)
class CliContext:
    url: str
    actor: str
    token: str | None = None

    def client(self, timeout: float = 10) -> PoolClient:
        return PoolClient(self.url, actor=self.actor, timeout=timeout, token=self.token)


def cli_context(ctx: typer.Context) -> CliContext:
    """The context set by the root callback (or a default one, for commands run alone)."""
    root = ctx.find_root()
    obj = root.obj
    if isinstance(obj, CliContext):
        return obj
    made = CliContext(url=resolve_url(None), actor=default_actor())
    root.obj = made
    return made
