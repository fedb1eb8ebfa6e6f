"""The names gpupool uses inside Kubernetes: extended resources, annotations, labels, env."""

from __future__ import annotations

from typing import Literal

DOMAIN = "gpupool.io"
VGPU = f"{DOMAIN}/vgpu"
"""Slices of virtual-mode GPUs: one unit per GPU the slice spans."""
GPU = f"{DOMAIN}/gpu"
"""Whole physical-mode GPUs, exclusive."""
VGPU_COMPUTE = f"{DOMAIN}/vgpu-compute"
"""Compute share of each slice, in percent (1..100); only the scheduler extender reads it."""
VGPU_MEMORY = f"{DOMAIN}/vgpu-memory"
"""Memory of each slice, in MiB; only the scheduler extender reads it."""

ResourceKind = Literal["vgpu", "gpu"]
RESOURCE_OF: dict[ResourceKind, str] = {"vgpu": VGPU, "gpu": GPU}

CLAIM_LABEL = f"{DOMAIN}/claim"
"""The claim id the webhook gives a GPU pod (a label, so the extender can select by it)."""
PRIORITY_ANNOTATION = f"{DOMAIN}/priority"
TENANT_ANNOTATION = f"{DOMAIN}/tenant"
ACCESS_ANNOTATION = f"{DOMAIN}/access"
"""`direct` (default: the pod runs on the GPU's node) or `remote` (any node, through a worker)."""

CLAIM_ENV = "GPUPOOL_CLAIM"
"""Set by the webhook in the pod spec: the claim the pod was admitted with."""
ALLOCATED_CLAIM_ENV = "GPUPOOL_ALLOCATED_CLAIM"
"""Set by the device plugin's Allocate: the claim whose lease the container got."""
LEASE_ENV = "GPUPOOL_LEASE"

CLAIM_HOLDER_PREFIX = "k8s-claim:"
"""Leases made for a pod's claim have the holder `k8s-claim:<claim id>`."""


def claim_holder(claim_id: str) -> str:
    return CLAIM_HOLDER_PREFIX + claim_id
