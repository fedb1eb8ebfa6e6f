"""Routes of /tenants."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response, status

from gpupool.controller.routers.common import ADMIN, READERS, Key, get_store
from gpupool.controller.services import tenants
from gpupool.controller.services.auth import Principal
from gpupool.controller.store import Store
from gpupool.core import NotFound
from gpupool.protocol.v1.api import TenantCreate, TenantOut, TenantUpdate

router = APIRouter(tags=["tenants"])


@router.get("/tenants", response_model=list[TenantOut])
async def list_tenants(
    store: Store = Depends(get_store), who: Principal = Depends(READERS)
) -> list[TenantOut]:
    """A tenant's token sees its own tenant only."""
    rows = await store.read(lambda s: tenants.list_tenants(store, s))
    return [t for t in rows if who.owns(t.name)]


@router.post(
    "/tenants",
    status_code=status.HTTP_201_CREATED,
    response_model=TenantOut,
    responses={
        status.HTTP_200_OK: {
            "model": TenantOut,
            "description": "The tenant existed already with exactly these settings (a resent "
            "create); other settings answer 409 with the differences.",
        }
    },
)
async def create_tenant(
    body: TenantCreate,
    response: Response,
    store: Store = Depends(get_store),
    who: Principal = Depends(ADMIN),
) -> TenantOut:
    tenant, created = await store.write(lambda s: tenants.create(store, s, body, who.actor))
    if not created:
        response.status_code = status.HTTP_200_OK
    return tenant


@router.get("/tenants/{name}", response_model=TenantOut)
async def get_tenant(
    name: Key, store: Store = Depends(get_store), who: Principal = Depends(READERS)
) -> TenantOut:
    if not who.owns(name):
        raise NotFound(f"no tenant {name!r}")
    return await store.read(lambda s: tenants.get(store, s, name))


@router.patch("/tenants/{name}", response_model=TenantOut)
async def update_tenant(
    name: Key,
    body: TenantUpdate,
    store: Store = Depends(get_store),
    who: Principal = Depends(ADMIN),
) -> TenantOut:
    return await store.write(lambda s: tenants.update(store, s, name, body, who.actor))


@router.delete("/tenants/{name}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_tenant(
    name: Key, store: Store = Depends(get_store), who: Principal = Depends(ADMIN)
) -> Response:
    await store.write(lambda s: tenants.delete(store, s, name, who.actor))
    return Response(status_code=status.HTTP_204_NO_CONTENT)
