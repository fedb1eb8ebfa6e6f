"""What every router needs: the store and who is acting."""

from __future__ import annotations

from typing import Annotated

from fastapi import Header, Path, Query, Request

from gpupool.controller.store import Store

NO_NUL = r"^[^\x00]*$"
"""Names in paths and filters are looked up in the database, which cannot hold NUL."""

Key = Annotated[str, Path(min_length=1, max_length=128, pattern=NO_NUL)]
"""A lease id, GPU UUID, node or tenant name in a path: as long as the columns they live in."""

Filter = Annotated[str | None, Query(max_length=128, pattern=NO_NUL)]
"""An optional filter on a listing, compared with a column of at most 128 characters."""


async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def get_actor(x_gpupool_actor: str | None = Header(default=None, max_length=128)) -> str:
    return x_gpupool_actor or "anonymous"
