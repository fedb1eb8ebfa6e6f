"""Routes of /nodes: agents register and heartbeat here."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response, status

from gpupool.controller.routers.common import ADMIN, AGENTS, ANYONE, Key, get_store
from gpupool.controller.services import nodes
from gpupool.controller.services.auth import Principal
from gpupool.controller.store import Store
from gpupool.protocol.v1.api import (
    DirectEvents,
    NodeHeartbeat,
    NodeHeartbeatReply,
    NodeOut,
    NodeRegister,
)

router = APIRouter(tags=["nodes"], dependencies=[Depends(ANYONE)])


@router.post("/nodes", status_code=status.HTTP_201_CREATED, response_model=NodeOut)
async def register(
    body: NodeRegister, store: Store = Depends(get_store), who: Principal = Depends(AGENTS)
) -> NodeOut:
    who.check_node(body.name, "register a node")
    return await store.write(lambda s: nodes.register(store, s, body, who.actor))


@router.post("/nodes/{name}/heartbeat", response_model=NodeHeartbeatReply)
async def heartbeat(
    name: Key,
    body: NodeHeartbeat,
    store: Store = Depends(get_store),
    who: Principal = Depends(AGENTS),
) -> NodeHeartbeatReply:
    """The answer holds the data-plane tokens of the node's remote leases, and only its own."""
    who.check_node(name, "send a heartbeat")
    return await store.write(lambda s: nodes.heartbeat(store, s, name, body))


@router.post("/nodes/{name}/direct-events", response_model=dict[str, int])
async def direct_events(
    name: Key,
    body: DirectEvents,
    store: Store = Depends(get_store),
    who: Principal = Depends(AGENTS),
) -> dict[str, int]:
    """What the node's watch of direct slices stopped or saw, into the event log."""
    who.check_node(name, "report direct-slice events")
    recorded = await store.write(
        lambda s: nodes.record_direct_events(store, s, name, body, who.actor)
    )
    return {"recorded": recorded}


@router.get("/nodes", response_model=list[NodeOut])
async def list_nodes(store: Store = Depends(get_store)) -> list[NodeOut]:
    return await store.read(lambda s: nodes.list_nodes(store, s))


@router.get("/nodes/{name}", response_model=NodeOut)
async def get_node(name: Key, store: Store = Depends(get_store)) -> NodeOut:
    return await store.read(lambda s: nodes.get(store, s, name))


@router.post("/nodes/{name}/drain", response_model=list[str])
async def drain_node(
    name: Key, store: Store = Depends(get_store), who: Principal = Depends(ADMIN)
) -> list[str]:
    """No new leases on the node; its remote leases migrate away. Returns those leases."""
    return await store.write(lambda s: nodes.drain(store, s, name, who.actor))


@router.post("/nodes/{name}/undrain", status_code=status.HTTP_204_NO_CONTENT)
async def undrain_node(
    name: Key, store: Store = Depends(get_store), who: Principal = Depends(ADMIN)
) -> Response:
    await store.write(lambda s: nodes.undrain(store, s, name, who.actor))
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.delete("/nodes/{name}", status_code=status.HTTP_204_NO_CONTENT)
async def remove_node(
    name: Key, store: Store = Depends(get_store), who: Principal = Depends(ADMIN)
) -> Response:
    await store.write(lambda s: nodes.remove(store, s, name, who.actor))
    return Response(status_code=status.HTTP_204_NO_CONTENT)
