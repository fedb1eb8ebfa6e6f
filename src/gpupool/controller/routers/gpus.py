"""Routes of /gpus."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from gpupool.controller.routers.common import ADMIN, AGENTS, ANYONE, Filter, Key, get_store
from gpupool.controller.services import gpus
from gpupool.controller.services.auth import Principal
from gpupool.controller.store import Store
from gpupool.protocol.v1.api import GpuIsolate, GpuModeSet, GpuOut, Mode

router = APIRouter(tags=["gpus"], dependencies=[Depends(ANYONE)])


@router.get("/gpus", response_model=list[GpuOut])
async def list_gpus(
    node: Filter = None, mode: Mode | None = None, store: Store = Depends(get_store)
) -> list[GpuOut]:
    return await store.read(lambda s: gpus.list_gpus(store, s, node, mode))


@router.get("/gpus/{uuid}", response_model=GpuOut)
async def get_gpu(uuid: Key, store: Store = Depends(get_store)) -> GpuOut:
    return await store.read(lambda s: gpus.get(store, s, uuid))


@router.post("/gpus/{uuid}/mode", response_model=GpuOut)
async def set_mode(
    uuid: Key, body: GpuModeSet, store: Store = Depends(get_store), who: Principal = Depends(ADMIN)
) -> GpuOut:
    return await store.write(lambda s: gpus.set_mode(store, s, uuid, body.mode, who.actor))


@router.post("/gpus/{uuid}/drain", response_model=GpuOut)
async def drain(
    uuid: Key, store: Store = Depends(get_store), who: Principal = Depends(ADMIN)
) -> GpuOut:
    return await store.write(lambda s: gpus.drain(store, s, uuid, who.actor))


@router.post("/gpus/{uuid}/isolate", response_model=GpuOut)
async def isolate(
    uuid: Key,
    body: GpuIsolate,
    store: Store = Depends(get_store),
    who: Principal = Depends(AGENTS),
) -> GpuOut:
    """Agents report their own node's faults here; an agent token of another node is refused."""
    return await store.write(
        lambda s: gpus.isolate(store, s, uuid, body.reason, who.actor, body.fault, caller=who)
    )


@router.post("/gpus/{uuid}/clear", response_model=GpuOut)
async def clear(
    uuid: Key, store: Store = Depends(get_store), who: Principal = Depends(ADMIN)
) -> GpuOut:
    return await store.write(lambda s: gpus.clear(store, s, uuid, who.actor))
