"""Bodies of the controller's `/api/v1/k8s` endpoints, used by gpupool's Kubernetes pieces.

The scheduler extender asks where a pod's request would fit (the pool's own placement)
and turns the scheduler's choice into a claim: a lease made for one pod, named by the claim
id the admission webhook gave that pod. The device plugin then allocates the claim waiting
on its node, so the container gets exactly that lease.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from gpupool.protocol.v1.api import LeaseCreate, LeaseOut, Strict

DNS_LABEL = r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$"
ClaimId = Annotated[str, Field(min_length=8, max_length=63, pattern=DNS_LABEL)]
"""A DNS-label-like id: it is also the value of the pod's `gpupool.io/claim` label."""
NodeName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]


class PlacementQuery(Strict):
    """Where could `request` be granted now, among these nodes?"""

    request: LeaseCreate
    nodes: Annotated[list[NodeName], Field(max_length=5000)]


class NodeFit(BaseModel):
    node: str
    fits: bool
    reason: str | None = None
    """Why the request does not fit on the node now."""
    never: bool = False
    """No change of the pool (a lease ending, preemption) would make it fit on this node."""
    score: int = 0
    """0..10 (the kube-scheduler extender's range): 10 where the pool itself would place it."""


class PlacementAnswer(BaseModel):
    nodes: list[NodeFit]
    best: str | None
    """The node the pool would choose among those asked, or None when none fits."""


class PreemptionQuery(Strict):
    """Which of these claims, on each node, must end for `request` to fit there?

    The scheduler extender's preempt verb: for each node the pods it could evict (of lower
    priority than the pod waiting), named by their claims.
    """

    request: LeaseCreate
    nodes: Annotated[
        dict[NodeName, Annotated[list[ClaimId], Field(max_length=1024)]], Field(max_length=5000)
    ]


class NodeVictims(BaseModel):
    node: str
    helps: bool
    """Whether ending `claims` (possibly none) makes the request fit on the node."""
    claims: list[str] = []
    """The claims to end: the cheapest set the pool's preemption rules allow."""
    reason: str | None = None
    """Why no set of the claims offered would make room."""


class PreemptionAnswer(BaseModel):
    nodes: list[NodeVictims]


class ClaimCreate(Strict):
    """Grant `request` on `node` for the pod that holds claim `claim` (the extender's bind)."""

    claim: ClaimId
    node: NodeName
    pod: Annotated[str, Field(min_length=3, max_length=253)]
    """`namespace/name` of the pod, for people reading the event log."""
    request: LeaseCreate


class WaitingPod(Strict):
    """A pod on the node that asks for the resource and has not started: the kubelet may be
    admitting it now. `claim` is its `gpupool.io/claim` label (None: it has none)."""

    pod: Annotated[str, Field(min_length=3, max_length=317)]
    """`namespace/name`."""
    claim: Annotated[str, Field(max_length=63)] | None = None


class ClaimAllocate(Strict):
    """The kubelet admits a container with `devices` units of `resource` on the node."""

    resource: Literal["vgpu", "gpu"]
    devices: Annotated[int, Field(ge=1, le=256)]
    waiting: Annotated[list[WaitingPod], Field(max_length=1000)] | None = None
    """The node's pods that ask for `resource` and have not started, as the API server
    lists them. Allocate names no pod, so the claim is given only when every one of them
    holds a claim of this node of its own: a pod that got past the webhook (a namespace it
    skips) could otherwise be given another pod's claim. None: not checked (a device plugin
    without access to the API server, which said so at its start)."""


ClaimState = Literal["bound", "allocated"]


class ClaimOut(BaseModel):
    claim: str
    node: str
    resource: Literal["vgpu", "gpu"]
    state: ClaimState
    """`bound`: granted, waiting for the kubelet; `allocated`: its container got the lease."""
    lease: LeaseOut
