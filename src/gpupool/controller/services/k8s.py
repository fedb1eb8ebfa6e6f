"""Kubernetes claims: the pool's placement for the scheduler extender, and leases made for pods.

A claim is a lease whose holder is `k8s-claim:<claim id>`; nothing else is stored, so a
claim lives, persists and ends exactly like any lease. Its state follows the lease's:
`granted` is a claim bound to a node and waiting for the kubelet (`bound`), `active` or
`idle` one whose container got it (`allocated`).

At most one claim per node is `bound` at a time. The kubelet's Allocate call names devices
but not the pod, so the device plugin asks for "the claim waiting on this node"; the gate
makes that answer exact instead of a guess between pods admitted together.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Literal

from sqlalchemy.orm import Session

from gpupool.controller.models import LeaseRow
from gpupool.controller.services import leases
from gpupool.controller.store import Store
from gpupool.controller.views import lease_out
from gpupool.core import (
    Conflict,
    Gpu,
    GpuMode,
    InvalidRequest,
    LeaseRequest,
    LeaseState,
    NotFound,
    Pool,
    PoolError,
)
from gpupool.core.preempt import plan_preemption
from gpupool.protocol.v1.api import LeaseCreate
from gpupool.protocol.v1.k8s import (
    ClaimAllocate,
    ClaimCreate,
    ClaimOut,
    NodeFit,
    NodeVictims,
    PlacementAnswer,
    PlacementQuery,
    PreemptionAnswer,
    PreemptionQuery,
    WaitingPod,
)

HOLDER_PREFIX = "k8s-claim:"
CLAIM_TTL_S = 120.0
"""Default heartbeat timeout of a claim's lease: the extender heartbeats claims of live pods."""
NO_GPUS = "no gpupool GPUs on this node"
BEST_SCORE = 10
OTHER_SCORE = 1


def holder_of(claim_id: str) -> str:
    return HOLDER_PREFIX + claim_id


def placement(store: Store, _session: Session, query: PlacementQuery) -> PlacementAnswer:
    """Where the request fits now on each node asked, and which one the pool would choose.

    One call per pod per scheduling cycle, over every candidate node: each node's answer
    looks at that node's GPUs only, so the call grows with the nodes asked, not with their
    square.
    """
    _direct_only(query.request)
    fits: list[NodeFit] = []
    with store.lock:
        pool = store.pool
        base = _request_for(query.request, node=None)
        try:
            pool.check_quota_ever(base)
        except PoolError as exc:
            nodes = list(dict.fromkeys(query.nodes))
            return PlacementAnswer(
                nodes=[NodeFit(node=n, fits=False, reason=exc.message) for n in nodes], best=None
            )
        admitting = _admitting_nodes(store)
        best_plan = pool.plan(base)
        best_nodes = {_node_of(store, s.gpu_uuid) for s in best_plan.slices} if best_plan else set()
        for node in dict.fromkeys(query.nodes):
            gpus = [pool.gpus[u] for u in pool.node_gpus.get(node, {})]
            never = _never_fits(pool, base, gpus)
            if never is not None:
                fits.append(NodeFit(node=node, fits=False, reason=never, never=True))
            elif node not in pool.nodes_up:
                fits.append(NodeFit(node=node, fits=False, reason="its gpupool agent is down"))
            elif node in admitting:
                # The one-claim rule of create_claim, said before the bind: a node that fits
                # but is admitting another claim would refuse the bind, and a scheduler told
                # it fits (and scores best) picks it again and again while others have room.
                fits.append(
                    NodeFit(
                        node=node,
                        fits=False,
                        reason=f"the node is admitting claim {admitting[node]} (one at a time)",
                    )
                )
            elif pool.plan(replace(base, node=node)) is None:
                fits.append(NodeFit(node=node, fits=False, reason=_short_on(pool, base, gpus)))
            else:
                score = BEST_SCORE if best_nodes == {node} else OTHER_SCORE
                fits.append(NodeFit(node=node, fits=True, score=score))
    ranked = sorted((f for f in fits if f.fits), key=lambda f: -f.score)
    return PlacementAnswer(nodes=fits, best=ranked[0].node if ranked else None)


def preemption(store: Store, _session: Session, query: PreemptionQuery) -> PreemptionAnswer:
    """For each node, the cheapest of the offered claims whose end lets the request fit.

    The pool's own rules choose: only leases of lower priority than the request (capped at
    its tenant's limit, as a claim would be), never below a tenant's guaranteed share.
    Claims offered that are not live on that node are ignored, so the scheduler's word
    cannot make the pool count a lease as freed where it is not.
    """
    _direct_only(query.request)
    out: list[NodeVictims] = []
    with store.lock:
        pool = store.pool
        base = _request_for(query.request, node=None)
        try:
            pool.check_quota_ever(base)
        except PoolError as exc:
            return PreemptionAnswer(
                nodes=[NodeVictims(node=n, helps=False, reason=exc.message) for n in query.nodes]
            )
        by_holder = {
            r.holder: r
            for r in list(store.lease_rows.values())
            if r.holder.startswith(HOLDER_PREFIX)
        }
        for node, offered in query.nodes.items():
            on_node = replace(base, node=node)
            if node not in pool.nodes_up:
                out.append(NodeVictims(node=node, helps=False, reason="its gpupool agent is down"))
                continue
            if pool.plan(on_node) is not None:
                out.append(NodeVictims(node=node, helps=True))
                continue
            leases = {
                row.id: claim
                for claim in dict.fromkeys(offered)
                if (row := by_holder.get(holder_of(claim))) is not None and row.node == node
            }
            found = plan_preemption(pool, "", on_node, among=leases.keys()) if leases else None
            if found is None:
                why = _short_on(pool, base, [pool.gpus[u] for u in pool.node_gpus.get(node, {})])
                reason = f"{why}; ending the lower-priority claims offered would not make room"
                out.append(NodeVictims(node=node, helps=False, reason=reason))
            else:
                claims = sorted(leases[v] for v in found.victims)
                out.append(NodeVictims(node=node, helps=True, claims=claims))
    return PreemptionAnswer(nodes=out)


def _never_fits(pool: Pool, request: LeaseRequest, gpus: list[Gpu]) -> str | None:
    """Why no state of this node could hold the request; None if some state could."""
    if not gpus:
        return NO_GPUS
    cap = pool.ratios.memory
    suitable = [
        g
        for g in gpus
        if g.healthy
        and request.model_allowed(g.model)
        and (request.physical or request.slice_memory_mib(g) <= int(g.memory_mib * cap))
    ]
    if len(suitable) < request.gpus:
        return (
            f"this node has {len(suitable)} suitable GPU(s), the request needs "
            f"{request.gpus}: it can never be granted here"
        )
    return None


def _short_on(pool: Pool, request: LeaseRequest, gpus: list[Gpu]) -> str:
    """Why the request does not fit on this node now, in the queue's words."""
    if request.physical:
        free = [
            g
            for g in gpus
            if g.mode is GpuMode.PHYSICAL and g.healthy and not pool.usage[g.uuid].leases
        ]
        kind = "free physical GPUs"
    else:
        free = []
        for g in gpus:
            if g.mode is not GpuMode.VIRTUAL or not g.healthy:
                continue
            compute, memory = pool.free_on(g)
            if compute >= request.compute_pct and memory >= request.slice_memory_mib(g):
                free.append(g)
        kind = "virtual GPUs with room"
    return f"needs {request.gpus} {kind} on this node, {len(free)} available now"


def _direct_only(request: LeaseCreate) -> None:
    """Placement and preemption answer for claims, which are direct leases."""
    if request.access != "direct":
        raise InvalidRequest("Kubernetes claims are direct leases: the pod runs on the GPU's node")


def _request_for(body: LeaseCreate, node: str | None) -> LeaseRequest:
    """The core request of a pod's lease: on one node, never split across servers."""
    return leases.request_from(body.model_copy(update={"node": node, "span_nodes": False}))


def _node_of(store: Store, gpu_uuid: str) -> str:
    return store.pool.gpus[gpu_uuid].node


def create_claim(store: Store, session: Session, body: ClaimCreate, actor: str) -> ClaimOut:
    """Grant the pod's request on the node the scheduler chose, now or not at all."""
    if body.request.access != "direct":
        raise InvalidRequest("Kubernetes claims are direct leases: the pod runs on the GPU's node")
    existing = _live_claim_row(store, body.claim)
    if existing is not None:
        if existing.node != body.node:
            raise Conflict(
                f"claim {body.claim} is already bound to node {existing.node}, not {body.node}"
            )
        return _claim_out(existing)  # the scheduler retried its bind: same answer
    waiting = _bound_rows(store, body.node)
    if waiting:
        raise Conflict(
            f"node {body.node} is still admitting claim {_claim_id(waiting[0])}; "
            "a node admits one claim at a time, try again shortly"
        )
    request = body.request.model_copy(
        update={
            "node": body.node,
            "span_nodes": False,
            "wait": False,
            "holder": holder_of(body.claim),
            "ttl_s": body.request.ttl_s or CLAIM_TTL_S,
            "prefer_node": None,
        }
    )
    # Never privileged, whoever calls: the priority comes from the pod, which its tenant
    # wrote, so the tenant's cap holds even when the extender runs with an admin token.
    lease = leases.create(store, session, request, actor, privileged=False)
    row = store.lease_row(session, lease.id)
    assert row is not None
    return _claim_out(row)


def allocate(store: Store, session: Session, node: str, body: ClaimAllocate) -> ClaimOut:
    """The claim waiting on `node` for this many devices becomes its container's (active)."""
    physical = body.resource == "gpu"
    candidates = [
        r for r in _bound_rows(store, node) if r.physical == physical and r.gpus == body.devices
    ]
    if not candidates:
        raise NotFound(
            f"no claim is waiting on node {node} for {body.devices} gpupool.io/{body.resource}: "
            "was the pod placed by the gpupool scheduler extender?"
        )
    if len(candidates) > 1:
        ids = ", ".join(_claim_id(r) for r in candidates)
        raise Conflict(f"several claims wait on node {node} ({ids}): refusing to guess")
    row = candidates[0]
    if body.waiting is not None:
        _check_waiting(store, node, body.resource, _claim_id(row), body.waiting)
    leases.heartbeat(store, session, row.id, active=True)
    return _claim_out(row)


def _check_waiting(
    store: Store, node: str, resource: str, claim: str, waiting: list[WaitingPod]
) -> None:
    """Refuse unless the waiting pods leave no doubt that the kubelet is admitting `claim`'s.

    The kubelet's Allocate names no pod. The one-claim rule makes "the claim bound on this
    node" exact among pods the extender placed; a pod that never passed the webhook (a
    namespace it skips, `spec.nodeName` set) has no claim of its own, yet the kubelet may
    be admitting it now. So every waiting pod must hold a live claim of this node that no
    other pod also carries (a copied label proves nothing), and one of them this claim.
    """
    live = {
        _claim_id(r)
        for r in list(store.lease_rows.values())
        if r.holder.startswith(HOLDER_PREFIX) and r.node == node
    }
    carriers = Counter(w.claim for w in waiting if w.claim)
    for pod in waiting:
        if pod.claim is None or pod.claim not in live:
            raise Conflict(
                f"pod {pod.pod} on node {node} asks for gpupool.io/{resource} without a claim "
                "of this node (it was not admitted through gpupool's webhook): the kubelet's "
                "Allocate names no pod and may be for that one, so no claim is given"
            )
        if carriers[pod.claim] > 1:
            raise Conflict(
                f"{carriers[pod.claim]} pods on node {node} carry claim {pod.claim}: the "
                "kubelet's Allocate names no pod, so no claim is given"
            )
    if carriers[claim] != 1:
        raise Conflict(
            f"the pod of claim {claim} is not among the pods waiting on node {node}: "
            "the kubelet is admitting another pod, so no claim is given"
        )


def pending(store: Store, _session: Session, node: str) -> ClaimOut:
    """The claim bound to `node` and not yet allocated (for GetPreferredAllocation)."""
    rows = _bound_rows(store, node)
    if not rows:
        raise NotFound(f"no claim is waiting on node {node}")
    return _claim_out(rows[0])


def get_claim(store: Store, _session: Session, claim_id: str) -> ClaimOut:
    row = _live_claim_row(store, claim_id)
    if row is None:
        raise NotFound(f"no live claim {claim_id!r}")
    return _claim_out(row)


def list_claims(store: Store, _session: Session, node: str | None) -> list[ClaimOut]:
    rows = [
        r
        for r in list(store.lease_rows.values())
        if r.holder.startswith(HOLDER_PREFIX) and (node is None or r.node == node)
    ]
    return [_claim_out(r) for r in sorted(rows, key=lambda r: r.created_at)]


def heartbeat_claim(store: Store, session: Session, claim_id: str) -> ClaimOut:
    row = _live_claim_row(store, claim_id)
    if row is None:
        raise NotFound(f"no live claim {claim_id!r}")
    leases.heartbeat(store, session, row.id, active=None)
    return _claim_out(row)


def release_claim(store: Store, session: Session, claim_id: str, actor: str) -> ClaimOut:
    row = _live_claim_row(store, claim_id)
    if row is None:
        raise NotFound(f"no live claim {claim_id!r}")
    out = _claim_out(row)
    lease = leases.release(store, session, row.id, actor)
    return out.model_copy(update={"lease": lease})


# ---- rows ---------------------------------------------------------------------------------


def _claim_id(row: LeaseRow) -> str:
    return row.holder.removeprefix(HOLDER_PREFIX)


def _live_claim_row(store: Store, claim_id: str) -> LeaseRow | None:
    holder = holder_of(claim_id)
    return next((r for r in list(store.lease_rows.values()) if r.holder == holder), None)


def _admitting_nodes(store: Store) -> dict[str, str]:
    """Nodes with a claim bound and no container yet, and that claim's id."""
    admitting: dict[str, str] = {}
    for row in sorted(store.lease_rows.values(), key=lambda r: r.created_at):
        if (
            row.holder.startswith(HOLDER_PREFIX)
            and row.node
            and row.state == LeaseState.GRANTED.value
        ):
            admitting.setdefault(row.node, _claim_id(row))
    return admitting


def _bound_rows(store: Store, node: str) -> list[LeaseRow]:
    rows = [
        r
        for r in list(store.lease_rows.values())
        if r.holder.startswith(HOLDER_PREFIX)
        and r.node == node
        and r.state == LeaseState.GRANTED.value
    ]
    return sorted(rows, key=lambda r: r.created_at)


def _claim_out(row: LeaseRow) -> ClaimOut:
    state: Literal["bound", "allocated"] = (
        "bound" if row.state == LeaseState.GRANTED.value else "allocated"
    )
    return ClaimOut(
        claim=_claim_id(row),
        node=row.node or "",
        resource="gpu" if row.physical else "vgpu",
        state=state,
        lease=lease_out(row),
    )
