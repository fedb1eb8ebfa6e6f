"""Routes of /leases and /queue."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, status

from gpupool.controller.routers.common import get_actor, get_store
from gpupool.controller.services import elastic, leases
from gpupool.controller.store import Store
from gpupool.core import ReleaseReason
from gpupool.protocol.v1.api import (
    LeaseCreate,
    LeaseHeartbeat,
    LeaseMigrate,
    LeaseOut,
    LeaseResize,
    QueueEntryOut,
)

router = APIRouter(tags=["leases"])


@router.post("/leases", status_code=status.HTTP_201_CREATED, response_model=LeaseOut)
async def create_lease(
    body: LeaseCreate, store: Store = Depends(get_store), actor: str = Depends(get_actor)
) -> LeaseOut:
    return await store.write(lambda s: leases.create(store, s, body, actor))


@router.get("/leases", response_model=list[LeaseOut])
async def list_leases(
    state: str | None = Query(default=None, description="comma-separated states, or 'all'"),
    tenant: str | None = None,
    gpu: str | None = None,
    node: str | None = None,
    limit: int = Query(default=1000, ge=1, le=10000),
    store: Store = Depends(get_store),
) -> list[LeaseOut]:
    return await store.read(lambda s: leases.list_leases(store, s, state, tenant, gpu, node, limit))


@router.get("/leases/{lease_id}", response_model=LeaseOut)
async def get_lease(lease_id: str, store: Store = Depends(get_store)) -> LeaseOut:
    return await store.read(lambda s: leases.get(store, s, lease_id))


@router.post("/leases/{lease_id}/heartbeat", response_model=LeaseOut)
async def heartbeat(
    lease_id: str, body: LeaseHeartbeat | None = None, store: Store = Depends(get_store)
) -> LeaseOut:
    active = body.active if body is not None else None
    return await store.write(lambda s: leases.heartbeat(store, s, lease_id, active))


@router.delete("/leases/{lease_id}", response_model=LeaseOut)
async def release_lease(
    lease_id: str, store: Store = Depends(get_store), actor: str = Depends(get_actor)
) -> LeaseOut:
    return await store.write(
        lambda s: leases.release(store, s, lease_id, actor, ReleaseReason.HOLDER)
    )


@router.post("/leases/{lease_id}/release", response_model=LeaseOut)
async def release_by_operator(
    lease_id: str, store: Store = Depends(get_store), actor: str = Depends(get_actor)
) -> LeaseOut:
    return await store.write(
        lambda s: leases.release(store, s, lease_id, actor, ReleaseReason.ADMIN)
    )


@router.post("/leases/{lease_id}/migrate", response_model=LeaseOut)
async def migrate_lease(
    lease_id: str,
    body: LeaseMigrate,
    store: Store = Depends(get_store),
    actor: str = Depends(get_actor),
) -> LeaseOut:
    """Move a running remote lease to another GPU or node; its program only pauses."""
    return await store.write(lambda s: elastic.migrate(store, s, lease_id, actor, to=body.to))


@router.post("/leases/{lease_id}/resize", response_model=LeaseOut)
async def resize_lease(
    lease_id: str,
    body: LeaseResize,
    store: Store = Depends(get_store),
    actor: str = Depends(get_actor),
) -> LeaseOut:
    """Change a running remote lease's compute share and memory without restarting it."""
    return await store.write(
        lambda s: elastic.resize(store, s, lease_id, actor, body.compute_pct, body.memory_mib())
    )


@router.get("/queue", response_model=list[QueueEntryOut])
async def get_queue(store: Store = Depends(get_store)) -> list[QueueEntryOut]:
    entries = await store.read(lambda s: leases.queue(store, s))
    return [QueueEntryOut(position=p, lease=lease) for p, lease in entries]
