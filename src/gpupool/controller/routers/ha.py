"""Route of /ha: which controller leads the pool and the state of the others."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from gpupool.controller import ha
from gpupool.controller.routers.common import ANYONE, get_store
from gpupool.controller.store import Store
from gpupool.protocol.v1.api import HaOut

router = APIRouter(tags=["ha"], dependencies=[Depends(ANYONE)])


@router.get("/ha", response_model=HaOut)
async def get_ha(request: Request, store: Store = Depends(get_store)) -> HaOut:
    group: ha.Group | None = request.app.state.ha
    if group is None:
        return ha.single_status(store.settings)
    return await store.read(group.status)
