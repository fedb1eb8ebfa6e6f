"""Route of /metrics: the pool in Prometheus' text format."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Response

from gpupool.controller.routers.dashboard import get_watch
from gpupool.controller.services import metrics
from gpupool.controller.services.watch import PoolWatch

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
async def scrape(watch: PoolWatch = Depends(get_watch)) -> Response:
    body = await asyncio.to_thread(metrics.exposition, watch.registry)
    return Response(body, media_type=metrics.CONTENT_TYPE)
