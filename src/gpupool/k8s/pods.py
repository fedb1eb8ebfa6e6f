"""What a pod asks of the pool, read from its spec: one clear error for anything unsound.

Shared by the admission webhook (which refuses bad pods) and the scheduler extender (which
turns a good one into a lease request), so both read a pod the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from gpupool.k8s.quantities import NotAQuantity, parse_quantity
from gpupool.k8s.resources import (
    ACCESS_ANNOTATION,
    CLAIM_LABEL,
    DOMAIN,
    GPU,
    PRIORITY_ANNOTATION,
    TENANT_ANNOTATION,
    VGPU,
    VGPU_COMPUTE,
    VGPU_MEMORY,
    ResourceKind,
)
from gpupool.protocol.v1.api import LeaseCreate

MAX_PRIORITY = 1000
OUR_RESOURCES = (VGPU, GPU, VGPU_COMPUTE, VGPU_MEMORY)
_PLAIN_INT = re.compile(r"^[0-9]+$")

Pod = dict[str, Any]


class PodRefused(Exception):
    """The pod's GPU request is contradictory or unsafe; the message says what to change."""


@dataclass(frozen=True, slots=True)
class GpuAsk:
    """A pod's GPU request: `gpus` slices (compute %, memory MiB) or `gpus` whole GPUs."""

    kind: ResourceKind
    container: int
    """Index in spec.containers of the one container that asks."""
    gpus: int
    compute_pct: int | None
    memory_mib: int | None
    priority: int
    tenant: str
    access: Literal["direct", "remote"]

    def lease_request(self) -> LeaseCreate:
        return LeaseCreate(
            tenant=self.tenant,
            gpus=self.gpus,
            compute_pct=self.compute_pct,
            memory=f"{self.memory_mib}MiB" if self.memory_mib is not None else None,
            physical=self.kind == "gpu",
            priority=self.priority,
            access=self.access,
            span_nodes=self.access == "remote",
        )


def containers(pod: Pod) -> list[dict[str, Any]]:
    return list((pod.get("spec") or {}).get("containers") or [])


def _resources(container: dict[str, Any]) -> dict[str, str]:
    """Our resources of one container; requests, where given, must equal limits."""
    resources = container.get("resources") or {}
    limits = {k: str(v) for k, v in (resources.get("limits") or {}).items() if k in OUR_RESOURCES}
    requests = {
        k: str(v) for k, v in (resources.get("requests") or {}).items() if k in OUR_RESOURCES
    }
    name = container.get("name", "?")
    for key, value in requests.items():
        if key not in limits:
            raise PodRefused(
                f"container {name}: {key} must be set in resources.limits "
                "(extended resources are limits; requests may repeat them)"
            )
        if not _same_quantity(limits[key], value):
            raise PodRefused(f"container {name}: {key} request {value} differs from limit")
    return limits


def _same_quantity(a: str, b: str) -> bool:
    """Equal as quantities (`8k` and `8000` are one value); unreadable ones as text."""
    try:
        return parse_quantity(a).value == parse_quantity(b).value
    except NotAQuantity:
        return a == b


def _int(container: str, key: str, value: str, low: int, high: int, unit: str = "") -> int:
    """A whole number in any form the API server stores it (`8000` arrives as `8k`)."""
    hint = " (a plain number of MiB: 8192, not 8Gi)" if key == VGPU_MEMORY else ""
    try:
        quantity = parse_quantity(value)
    except NotAQuantity:
        raise PodRefused(
            f"container {container}: {key} must be a whole number{hint}, got {value!r}"
        ) from None
    number = quantity.whole()
    if quantity.binary or number is None:
        raise PodRefused(
            f"container {container}: {key} must be a whole number{hint}, got {value!r}"
        )
    if not low <= number <= high:
        raise PodRefused(f"container {container}: {key} must be {low}..{high}{unit}, got {number}")
    return number


def asks_for_gpus(pod: Pod) -> bool:
    """Whether the pod is gpupool's business: our resources, or one of our annotations."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if any(k.startswith(DOMAIN + "/") for k in annotations):
        return True
    return asks_for_resources(pod)


def asks_for_resources(pod: Pod) -> bool:
    """Whether a container or init container sets one of our resources."""
    spec = pod.get("spec") or {}
    every = list(spec.get("containers") or []) + list(spec.get("initContainers") or [])
    return any(_resources(c) for c in every)


def gpu_ask(pod: Pod) -> GpuAsk:
    """Read the pod's GPU request, or raise PodRefused saying what is wrong with it."""
    spec = pod.get("spec") or {}
    for init in spec.get("initContainers") or []:
        if _resources(init):
            raise PodRefused(
                f"init container {init.get('name', '?')} asks for GPUs: only one regular "
                "container per pod gets gpupool GPUs"
            )
    asking = [(i, c, r) for i, c in enumerate(containers(pod)) if (r := _resources(c))]
    if not asking:
        raise PodRefused(
            f"the pod has {DOMAIN} annotations but no container asks for {VGPU} or {GPU}"
        )
    if len(asking) > 1:
        names = ", ".join(c.get("name", "?") for _, c, _ in asking)
        raise PodRefused(f"only one container per pod may ask for GPUs; {names} do")
    index, container, res = asking[0]
    name = str(container.get("name", "?"))
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    access = annotations.get(ACCESS_ANNOTATION, "direct")
    if access not in ("direct", "remote"):
        raise PodRefused(f"{ACCESS_ANNOTATION} must be direct or remote, got {access!r}")
    if VGPU in res and GPU in res:
        raise PodRefused(
            f"container {name} asks for both {VGPU} (slices) and {GPU} (whole GPUs): choose one"
        )
    if VGPU not in res and GPU not in res:
        raise PodRefused(
            f"container {name} sets {VGPU_COMPUTE} or {VGPU_MEMORY} without {VGPU}: add {VGPU}: 1"
        )
    priority = _priority(pod, annotations)
    tenant = str(annotations.get(TENANT_ANNOTATION, "default"))
    if GPU in res:
        extra = [k for k in (VGPU_COMPUTE, VGPU_MEMORY) if k in res]
        if extra:
            raise PodRefused(
                f"container {name}: {GPU} takes whole GPUs; {', '.join(extra)} are for {VGPU}"
            )
        if access == "remote":
            raise PodRefused(f"{GPU} (whole physical GPUs) are always direct, not remote")
        gpus = _int(name, GPU, res[GPU], 1, 64)
        return GpuAsk("gpu", index, gpus, None, None, priority, tenant, "direct")
    gpus = _int(name, VGPU, res[VGPU], 1, 64)
    if gpus > 1 and access == "direct":
        raise PodRefused(
            f"container {name}: a direct slice spans one GPU ({VGPU}: 1, one MPS daemon per "
            f"GPU); ask {GPU}: {gpus} for whole GPUs, or annotate {ACCESS_ANNOTATION}: remote"
        )
    if VGPU_COMPUTE not in res:
        raise PodRefused(f"container {name}: {VGPU} needs {VGPU_COMPUTE} (percent, 1..100)")
    compute = _int(name, VGPU_COMPUTE, res[VGPU_COMPUTE], 1, 100, " %")
    memory = (
        _int(name, VGPU_MEMORY, res[VGPU_MEMORY], 1, 16 * 1024 * 1024, " MiB")
        if VGPU_MEMORY in res
        else None
    )
    return GpuAsk("vgpu", index, gpus, compute, memory, priority, tenant, access)


def _priority(pod: Pod, annotations: dict[str, Any]) -> int:
    """The annotation, else the pod's priority (from its priorityClass) capped at 0..1000."""
    given = annotations.get(PRIORITY_ANNOTATION)
    if given is not None:
        text = str(given)
        if not _PLAIN_INT.match(text) or int(text) > MAX_PRIORITY:
            raise PodRefused(f"{PRIORITY_ANNOTATION} must be 0..{MAX_PRIORITY}, got {text!r}")
        return int(text)
    from_class = (pod.get("spec") or {}).get("priority")
    if isinstance(from_class, int):
        return max(0, min(from_class, MAX_PRIORITY))
    return 0


def claim_of(pod: Pod) -> str | None:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    value = labels.get(CLAIM_LABEL)
    return str(value) if value else None


def pod_name(pod: Pod) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', 'default')}/{meta.get('name') or meta.get('generateName', '?')}"
