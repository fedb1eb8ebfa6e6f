"""What every router needs: the store and who is acting."""

from __future__ import annotations

from fastapi import Header, Request

from gpupool.controller.store import Store


async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def get_actor(x_gpupool_actor: str | None = Header(default=None, max_length=128)) -> str:
    return x_gpupool_actor or "anonymous"
