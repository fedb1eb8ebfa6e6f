"""Filters: which servers and which of their GPUs can take a request at all."""

from __future__ import annotations

from typing import NamedTuple

from gpupool.core.model import Access, LeaseRequest
from gpupool.core.placement.index import NodeShape, Slot


class Demand(NamedTuple):
    """What placement needs of a request: its size and constraints, hashable for memos."""

    gpus: int
    compute_pct: int
    memory_mib: int | None
    physical: bool
    models: tuple[str, ...]
    cpu_milli: int
    host_memory_mib: int
    memory_cap_mib: int | None = None
    """Most memory one slice may take: what the tenant's memory quota leaves per GPU."""
    remote: bool = False
    """Remote slices may take oversubscribed memory (their sessions can be swapped out to
    host memory when the GPU runs short); a direct lease's process cannot be swapped, so it
    only gets memory the GPU physically has free."""

    def slice_memory_mib(self, gpu_memory_mib: int) -> int:
        if self.physical:
            return gpu_memory_mib
        if self.memory_mib is not None:
            return self.memory_mib
        return max(1, -(-gpu_memory_mib * self.compute_pct // 100))

    def gpu_units(self) -> float:
        """GPUs' worth asked for: 2 whole GPUs are 2.0, a 25 % slice 0.25."""
        return self.gpus * (1.0 if self.physical else self.compute_pct / 100)


def demand_of(request: LeaseRequest) -> Demand:
    return Demand(
        request.gpus,
        100 if request.physical else request.compute_pct,
        None if request.physical else request.memory_mib,
        request.physical,
        tuple(m.lower() for m in request.gpu_models),
        request.cpu_milli,
        request.host_memory_mib,
        remote=request.access is Access.REMOTE,
    )


_MODEL_MATCH: dict[tuple[tuple[str, ...], str], bool] = {}


def model_allowed(models: tuple[str, ...], model: str) -> bool:
    """GPU model constraint: any of `models` (lower case) is part of the GPU's model name."""
    if not models:
        return True
    key = (models, model)
    hit = _MODEL_MATCH.get(key)
    if hit is None:
        low = model.lower()
        hit = any(want in low for want in models)
        if len(_MODEL_MATCH) < 4096:
            _MODEL_MATCH[key] = hit
    return hit


def slot_fits(slot: Slot, demand: Demand) -> bool:
    """Mode, model and free room of one GPU: whole GPUs need an idle physical one."""
    if demand.physical:
        if not slot.physical or slot.free_compute < slot.capacity_compute:
            return False
    else:
        need = demand.slice_memory_mib(slot.memory_mib)
        free = slot.free_memory if demand.remote else physically_free_mib(slot)
        if slot.physical or slot.free_compute < demand.compute_pct or free < need:
            return False
    cap = demand.memory_cap_mib
    if cap is not None and demand.slice_memory_mib(slot.memory_mib) > cap:
        return False
    return model_allowed(demand.models, slot.model)


def physically_free_mib(slot: Slot) -> int:
    """Memory of a virtual GPU not granted to anyone, without the oversubscribed part."""
    return slot.free_memory - (slot.capacity_memory - slot.memory_mib)


def host_fits(shape: NodeShape, cpu_milli: int, memory_mib: int) -> bool:
    """CPU and memory of the server itself, where it is accounted."""
    if cpu_milli and shape.cpu_free is not None and shape.cpu_free < cpu_milli:
        return False
    return not (memory_mib and shape.memory_free is not None and shape.memory_free < memory_mib)


def fitting_slots(shape: NodeShape, demand: Demand) -> list[int]:
    return [i for i, slot in enumerate(shape.slots) if slot_fits(slot, demand)]


def statically_fits(slot: Slot, demand: Demand) -> bool:
    """Could this GPU take the request if it were empty? (for reservations and preemption)"""
    empty = slot._replace(free_compute=slot.capacity_compute, free_memory=slot.capacity_memory)
    return slot_fits(empty, demand)
