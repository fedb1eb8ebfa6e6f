"""Routes of /health, /pool and /events."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query

from gpupool import __version__
from gpupool.controller.routers.common import Filter, get_store
from gpupool.controller.services import events, pool
from gpupool.controller.store import Store
from gpupool.protocol.v1.api import EventOut, PoolSummary

router = APIRouter(tags=["pool"])


@router.get("/health")
async def health(store: Store = Depends(get_store)) -> dict[str, Any]:
    return {
        "status": "ok",
        "version": __version__,
        "db": store.engine.dialect.name,
        "simulated": any(g.simulated for g in store.pool.gpus.values()),
    }


@router.get("/pool", response_model=PoolSummary)
async def get_pool(store: Store = Depends(get_store)) -> PoolSummary:
    return await store.read(lambda s: pool.summary(store, s))


@router.get("/events", response_model=list[EventOut])
async def list_events(
    since_id: int | None = Query(default=None, ge=0),
    limit: int = Query(default=100, ge=1, le=10000),
    kind: Filter = None,
    subject: Filter = None,
    store: Store = Depends(get_store),
) -> list[EventOut]:
    return await store.read(lambda s: events.list_events(s, since_id, limit, kind, subject))
