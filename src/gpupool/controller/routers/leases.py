"""Routes of /leases and /queue. A tenant's token sees and acts on its tenant's leases only;
other tenants' leases answer 404, as if they did not exist."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, status

from gpupool.controller.routers.common import ADMIN, HOLDERS, READERS, Filter, Key, get_store
from gpupool.controller.services import elastic, leases
from gpupool.controller.services.auth import Principal
from gpupool.controller.services.wake import wake_agents
from gpupool.controller.store import Store
from gpupool.core import Forbidden, LeaseState, ReleaseReason
from gpupool.protocol.v1.api import (
    LeaseCreate,
    LeaseHeartbeat,
    LeaseMigrate,
    LeaseOut,
    LeaseResize,
    QueueEntryOut,
)

router = APIRouter(tags=["leases"])

_STATE = "|".join(s.value for s in LeaseState)
STATES = rf"^\s*(all|({_STATE})\s*(,\s*({_STATE})\s*)*)$"
"""`all`, or lease states separated by commas."""


def _scope(who: Principal) -> str | None:
    """The one tenant whose leases this caller may touch; None for every tenant."""
    return who.tenant if who.role == "tenant" else None


@router.post("/leases", status_code=status.HTTP_201_CREATED, response_model=LeaseOut)
async def create_lease(
    body: LeaseCreate, store: Store = Depends(get_store), who: Principal = Depends(HOLDERS)
) -> LeaseOut:
    mine = _scope(who)
    if mine is not None:
        if "tenant" not in body.model_fields_set:
            body = body.model_copy(update={"tenant": mine})
        elif body.tenant != mine:
            raise Forbidden(
                f"this token acts for tenant {mine!r}: it cannot ask for tenant {body.tenant!r}"
            )
    lease = await store.write(
        lambda s: leases.create(store, s, body, who.actor, privileged=who.is_admin)
    )
    if lease.access == "remote" and lease.state == LeaseState.GRANTED.value:
        wake_agents(store, (piece.node for piece in lease.slices))
    return lease


@router.get("/leases", response_model=list[LeaseOut])
async def list_leases(
    state: str | None = Query(
        default=None, description="comma-separated states, or 'all'", pattern=STATES
    ),
    tenant: Filter = None,
    gpu: Filter = None,
    node: Filter = None,
    limit: int = Query(default=1000, ge=1, le=10000),
    store: Store = Depends(get_store),
    who: Principal = Depends(READERS),
) -> list[LeaseOut]:
    mine = _scope(who)
    if mine is not None:
        if tenant is not None and tenant != mine:
            raise Forbidden(f"this token acts for tenant {mine!r}: it cannot list {tenant!r}")
        tenant = mine
    return await store.read(lambda s: leases.list_leases(store, s, state, tenant, gpu, node, limit))


@router.get("/leases/{lease_id}", response_model=LeaseOut)
async def get_lease(
    lease_id: Key, store: Store = Depends(get_store), who: Principal = Depends(READERS)
) -> LeaseOut:
    return await store.read(lambda s: leases.get(store, s, lease_id, _scope(who)))


@router.post("/leases/{lease_id}/heartbeat", response_model=LeaseOut)
async def heartbeat(
    lease_id: Key,
    body: LeaseHeartbeat | None = None,
    store: Store = Depends(get_store),
    who: Principal = Depends(HOLDERS),
) -> LeaseOut:
    active = body.active if body is not None else None
    mine = _scope(who)
    return await store.write(lambda s: leases.heartbeat(store, s, lease_id, active, mine))


@router.delete("/leases/{lease_id}", response_model=LeaseOut)
async def release_lease(
    lease_id: Key, store: Store = Depends(get_store), who: Principal = Depends(HOLDERS)
) -> LeaseOut:
    mine = _scope(who)
    return await store.write(
        lambda s: leases.release(
            store, s, lease_id, who.actor, ReleaseReason.HOLDER, only_tenant=mine
        )
    )


@router.post("/leases/{lease_id}/release", response_model=LeaseOut)
async def release_by_operator(
    lease_id: Key, store: Store = Depends(get_store), who: Principal = Depends(ADMIN)
) -> LeaseOut:
    return await store.write(
        lambda s: leases.release(store, s, lease_id, who.actor, ReleaseReason.ADMIN)
    )


@router.post("/leases/{lease_id}/migrate", response_model=LeaseOut)
async def migrate_lease(
    lease_id: Key,
    body: LeaseMigrate,
    store: Store = Depends(get_store),
    who: Principal = Depends(ADMIN),
) -> LeaseOut:
    """Move a running remote lease to another GPU or node; its program only pauses."""
    return await store.write(lambda s: elastic.migrate(store, s, lease_id, who.actor, to=body.to))


@router.post("/leases/{lease_id}/resize", response_model=LeaseOut)
async def resize_lease(
    lease_id: Key,
    body: LeaseResize,
    store: Store = Depends(get_store),
    who: Principal = Depends(HOLDERS),
) -> LeaseOut:
    """Change a running remote lease's compute share and memory without restarting it; a
    tenant may resize its own leases (its quota still applies)."""
    mine = _scope(who)
    if mine is not None:
        await store.read(lambda s: leases.get(store, s, lease_id, mine))  # 404 if not its own
    return await store.write(
        lambda s: elastic.resize(store, s, lease_id, who.actor, body.compute_pct, body.memory_mib())
    )


@router.get("/queue", response_model=list[QueueEntryOut])
async def get_queue(
    store: Store = Depends(get_store), who: Principal = Depends(READERS)
) -> list[QueueEntryOut]:
    """The whole queue in order; a tenant sees its own entries, with their real positions."""
    entries = await store.read(lambda s: leases.queue(store, s))
    return [
        QueueEntryOut(position=p, lease=lease) for p, lease in entries if who.owns(lease.tenant)
    ]
