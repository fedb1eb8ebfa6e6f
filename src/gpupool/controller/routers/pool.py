"""Routes of /health, /pool and /events."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from gpupool import __version__
from gpupool.controller import ha
from gpupool.controller.routers.common import ANYONE, OPERATORS, Filter, get_store
from gpupool.controller.services import events, pool
from gpupool.controller.store import Store
from gpupool.protocol.v1.api import INT32_MAX, EventOut, PoolSummary

router = APIRouter(tags=["pool"])


@router.get("/health")
async def health(store: Store = Depends(get_store)) -> dict[str, Any]:
    """Open to all, for load balancers and probes: it tells nothing about leases."""
    return {
        "status": "ok",
        "version": __version__,
        "db": store.engine.dialect.name,
        "simulated": any(g.simulated for g in store.pool.gpus.values()),
    }


@router.get("/pool", response_model=PoolSummary)
async def get_pool(
    request: Request, store: Store = Depends(get_store), _who: object = Depends(ANYONE)
) -> PoolSummary:
    summary = await store.read(lambda s: pool.summary(store, s))
    group: ha.Group | None = request.app.state.ha
    status = ha.single_status(store.settings) if group is None else await store.read(group.status)
    return summary.model_copy(update={"ha": status})


@router.get("/events", response_model=list[EventOut])
async def list_events(
    since_id: int | None = Query(default=None, ge=0, le=INT32_MAX),
    limit: int = Query(default=100, ge=1, le=10000),
    kind: Filter = None,
    subject: Filter = None,
    store: Store = Depends(get_store),
    _who: object = Depends(OPERATORS),
) -> list[EventOut]:
    return await store.read(lambda s: events.list_events(s, since_id, limit, kind, subject))
