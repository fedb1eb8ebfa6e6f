"""Routes of /k8s: placement and claims for gpupool's scheduler extender and device plugin.

The extender (`gpupool k8s serve`) runs with a scheduler token and places pods on any node;
the device plugin runs inside each node's agent, with that node's agent token, and may ask
for and allocate the claims of its own node only. An admin token may do both. Claims are
read on the store's writer thread too: they are found among the live lease rows that only
that thread may touch.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, status

from gpupool.controller.routers.common import AGENTS, SCHEDULERS, allow, get_store
from gpupool.controller.services import k8s
from gpupool.controller.services.auth import Principal
from gpupool.controller.store import Store
from gpupool.protocol.v1.k8s import (
    ClaimAllocate,
    ClaimCreate,
    ClaimOut,
    NodeName,
    PlacementAnswer,
    PlacementQuery,
    PreemptionAnswer,
    PreemptionQuery,
)

router = APIRouter(
    prefix="/k8s",
    tags=["kubernetes"],
    dependencies=[Depends(allow("admin", "scheduler", "agent"))],
)


@router.post("/placement", response_model=PlacementAnswer, dependencies=[Depends(SCHEDULERS)])
async def placement(body: PlacementQuery, store: Store = Depends(get_store)) -> PlacementAnswer:
    return await store.write(lambda s: k8s.placement(store, s, body))


@router.post("/preemption", response_model=PreemptionAnswer, dependencies=[Depends(SCHEDULERS)])
async def preemption(body: PreemptionQuery, store: Store = Depends(get_store)) -> PreemptionAnswer:
    """Read only: the scheduler evicts the pods; their claims end when the pods do."""
    return await store.write(lambda s: k8s.preemption(store, s, body))


@router.post("/claims", status_code=status.HTTP_201_CREATED, response_model=ClaimOut)
async def create_claim(
    body: ClaimCreate, store: Store = Depends(get_store), who: Principal = Depends(SCHEDULERS)
) -> ClaimOut:
    return await store.write(lambda s: k8s.create_claim(store, s, body, who.actor))


@router.get("/claims", response_model=list[ClaimOut], dependencies=[Depends(SCHEDULERS)])
async def list_claims(node: str | None = None, store: Store = Depends(get_store)) -> list[ClaimOut]:
    return await store.write(lambda s: k8s.list_claims(store, s, node))


@router.get("/claims/{claim_id}", response_model=ClaimOut, dependencies=[Depends(SCHEDULERS)])
async def get_claim(claim_id: str, store: Store = Depends(get_store)) -> ClaimOut:
    return await store.write(lambda s: k8s.get_claim(store, s, claim_id))


@router.post(
    "/claims/{claim_id}/heartbeat", response_model=ClaimOut, dependencies=[Depends(SCHEDULERS)]
)
async def heartbeat_claim(claim_id: str, store: Store = Depends(get_store)) -> ClaimOut:
    """The claim's pod still lives: its lease lives on for another ttl."""
    return await store.write(lambda s: k8s.heartbeat_claim(store, s, claim_id))


@router.delete("/claims/{claim_id}", response_model=ClaimOut)
async def release_claim(
    claim_id: str, store: Store = Depends(get_store), who: Principal = Depends(SCHEDULERS)
) -> ClaimOut:
    return await store.write(lambda s: k8s.release_claim(store, s, claim_id, who.actor))


@router.get("/nodes/{node}/pending", response_model=ClaimOut)
async def pending(
    node: NodeName, store: Store = Depends(get_store), who: Principal = Depends(AGENTS)
) -> ClaimOut:
    who.check_node(node, "read the claims waiting on a node")
    return await store.write(lambda s: k8s.pending(store, s, node))


@router.post("/nodes/{node}/allocate", response_model=ClaimOut)
async def allocate(
    node: NodeName,
    body: ClaimAllocate,
    store: Store = Depends(get_store),
    who: Principal = Depends(AGENTS),
) -> ClaimOut:
    who.check_node(node, "allocate the claims of a node")
    return await store.write(lambda s: k8s.allocate(store, s, node, body))
