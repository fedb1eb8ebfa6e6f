"""Routes of /metrics (the pool in Prometheus' text format) and of the agents' scrape targets."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Response

from gpupool.controller.routers.common import get_store
from gpupool.controller.routers.dashboard import get_watch
from gpupool.controller.services import metrics
from gpupool.controller.services.watch import PoolWatch
from gpupool.controller.store import Store
from gpupool.protocol.v1 import API_PREFIX

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
async def scrape(watch: PoolWatch = Depends(get_watch)) -> Response:
    body = await asyncio.to_thread(metrics.exposition, watch.registry)
    return Response(body, media_type=metrics.CONTENT_TYPE)


@router.get(f"{API_PREFIX}/prometheus/targets")
async def agent_targets(store: Store = Depends(get_store)) -> list[dict[str, Any]]:
    """Every agent's /metrics, in the format of Prometheus' `http_sd_configs`."""
    return metrics.agent_targets(store)
