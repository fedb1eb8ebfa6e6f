"""Routes of the dashboard: its page and files at `/`, and its read API under /api/v1."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Query, Request, Response

from gpupool.controller.dashboard import Asset, asset, index
from gpupool.controller.routers.common import OPERATORS, Key, get_store
from gpupool.controller.services import dashboard
from gpupool.controller.services.watch import PoolWatch
from gpupool.controller.store import Store
from gpupool.core import NotFound
from gpupool.protocol.v1.dashboard import (
    AlertsOut,
    GpuDetailOut,
    HistoryOut,
    OverviewOut,
    ServerOut,
)

router = APIRouter(tags=["dashboard"], dependencies=[Depends(OPERATORS)])
pages = APIRouter(include_in_schema=False)


async def get_watch(request: Request) -> PoolWatch:
    watch: PoolWatch = request.app.state.watch
    return watch


@router.get("/dashboard/overview", response_model=OverviewOut)
async def overview(
    store: Store = Depends(get_store), watch: PoolWatch = Depends(get_watch)
) -> OverviewOut:
    return await asyncio.to_thread(dashboard.overview, store, watch)


@router.get("/dashboard/servers", response_model=list[ServerOut])
async def servers(
    store: Store = Depends(get_store), watch: PoolWatch = Depends(get_watch)
) -> list[ServerOut]:
    return await asyncio.to_thread(dashboard.servers, store, watch)


@router.get("/dashboard/gpus/{uuid}", response_model=GpuDetailOut)
async def gpu_detail(uuid: Key, store: Store = Depends(get_store)) -> GpuDetailOut:
    return await asyncio.to_thread(dashboard.gpu_detail, store, uuid)


@router.get("/history", response_model=HistoryOut)
async def history(
    keys: str = Query(description="comma-separated series, e.g. pool.utilization_pct"),
    range_s: float = Query(default=3600.0, description="how far back, in seconds"),
    points: int = Query(default=400, ge=2, le=2000),
    watch: PoolWatch = Depends(get_watch),
) -> HistoryOut:
    return dashboard.history(watch, keys.split(","), range_s, points)


@router.get("/alerts", response_model=AlertsOut)
async def alerts(watch: PoolWatch = Depends(get_watch)) -> AlertsOut:
    return dashboard.alerts(watch)


def _serve(item: Asset, request: Request) -> Response:
    if request.headers.get("if-none-match") == item.etag:
        return Response(status_code=304, headers=item.headers)
    return Response(item.body, media_type=item.media_type, headers=item.headers)


@pages.get("/")
async def page(request: Request) -> Response:
    return _serve(index(), request)


@pages.get("/dashboard/{name}")
async def static_file(name: str, request: Request) -> Response:
    item = asset(name)
    if item is None:
        raise NotFound(f"no dashboard file {name!r}")
    return _serve(item, request)
