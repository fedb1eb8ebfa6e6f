"""Scorers: how good one placement on one server is. Lower is better; each scorer has one idea."""

from __future__ import annotations

from typing import NamedTuple

from gpupool.core.placement.filters import Demand
from gpupool.core.placement.index import NodeShape, Slot
from gpupool.core.placement.workload import Workload


class Candidate(NamedTuple):
    """A request placed on the chosen GPUs (indices into `before.slots`) of one server."""

    before: NodeShape
    after: NodeShape
    chosen: tuple[int, ...]
    demand: Demand


def take(slot: Slot, demand: Demand) -> Slot:
    if demand.physical:
        return slot._replace(free_compute=0, free_memory=0)
    return slot._replace(
        free_compute=slot.free_compute - demand.compute_pct,
        free_memory=slot.free_memory - demand.slice_memory_mib(slot.memory_mib),
    )


def shape_after(
    shape: NodeShape, demand: Demand, chosen: tuple[int, ...], cpu_milli: int, memory_mib: int
) -> NodeShape:
    """The server's shape once the request holds the chosen GPUs and its share of the host."""
    slots = list(shape.slots)
    for i in chosen:
        slots[i] = take(slots[i], demand)
    return shape._replace(
        slots=tuple(sorted(slots)),
        cpu_free=None if shape.cpu_free is None else shape.cpu_free - cpu_milli,
        memory_free=None if shape.memory_free is None else shape.memory_free - memory_mib,
    )


def left_over(shape: NodeShape) -> float:
    """Free share of the server after placing: GPU, CPU and memory, each 0..1."""
    total = sum(s.share_free() for s in shape.slots) / max(shape.gpu_count, 1)
    if shape.cpu_capacity and shape.cpu_free is not None:
        total += shape.cpu_free / shape.cpu_capacity
    if shape.memory_capacity and shape.memory_free is not None:
        total += shape.memory_free / shape.memory_capacity
    return total


def chosen_left(c: Candidate) -> float:
    """Free share left on the chosen GPUs themselves (best fit at GPU level)."""
    return sum(take(c.before.slots[i], c.demand).share_free() for i in c.chosen)


def best_fit(c: Candidate, _w: Workload) -> float:
    """The server (then the GPU) left with the least free room: keeps big holes whole."""
    return left_over(c.after) + 1e-3 * chosen_left(c)


def spread(c: Candidate, _w: Workload) -> float:
    """The emptiest server and GPU: spreads load, for performance isolation."""
    return -left_over(c.after) - 1e-3 * chosen_left(c)


def packing_tier(c: Candidate) -> int:
    """0: onto GPUs already in use; 1: idle GPUs of a busy server; 2: an idle server."""
    slots = c.before.slots
    if c.chosen and all(not slots[i].is_idle() for i in c.chosen):
        return 0
    if any(not s.is_idle() for s in slots) or len(slots) < c.before.gpu_count:
        return 1
    return 2


def packing(c: Candidate, w: Workload) -> float:
    """Used GPUs first, then busy servers, then idle ones; best fit among equals."""
    return 10.0 * packing_tier(c) + best_fit(c, w)


def dot_product(c: Candidate, w: Workload) -> float:
    """Tetris: the server whose free resources align best with the request's vector."""
    shape, d = c.before, c.demand
    gpu_free = sum(s.share_free() for s in shape.slots) / max(shape.gpu_count, 1)
    score = d.gpu_units() / max(shape.gpu_count, 1) * gpu_free
    if shape.cpu_capacity and shape.cpu_free is not None:
        score += d.cpu_milli / shape.cpu_capacity * shape.cpu_free / shape.cpu_capacity
    if shape.memory_capacity and shape.memory_free is not None:
        score += (
            d.host_memory_mib / shape.memory_capacity * shape.memory_free / shape.memory_capacity
        )
    return -score + 1e-3 * chosen_left(c)


def clustering(c: Candidate, w: Workload) -> float:
    """Requests of one size together: GPUs already holding that size first (Gandiva-like)."""
    d = c.demand
    slots = c.before.slots
    alike = 0
    for i in c.chosen:
        used = slots[i].capacity_compute - slots[i].free_compute
        if used > 0 and not d.physical and used % d.compute_pct == 0:
            alike += 1
    tier = 0 if alike == len(c.chosen) and c.chosen else 1 + (packing_tier(c) == 2)
    return 10.0 * tier + best_fit(c, w)


def fragmentation_growth(c: Candidate, w: Workload) -> float:
    """FGD: how much idle GPU the typical requests can no longer use after this placement."""
    return w.fragmentation(c.after) - w.fragmentation(c.before)


def frag_aware(c: Candidate, w: Workload) -> float:
    """gpupool's default: the least of the pool's room for typical requests used up.

    For each request size the pool usually sees (with its GPU model constraints and
    server CPU and memory), the room is how much of that size the pool can still hand
    out; a placement costs the room it removes, each size weighed by how often it comes
    and by how scarce its room already is. Unlike FGD, which only counts idle GPU that
    typical requests cannot use, this sees supply: it keeps the last GPUs of a model
    that constrained requests need, and the last empty servers that 8-GPU gangs need.
    Best fit breaks ties.
    """
    return room_loss(c, w) + 1e-3 * best_fit(c, w)


def room_loss(c: Candidate, w: Workload) -> float:
    """How much of the room left for typical requests this placement uses, scarce room first."""
    return w.room_lost(c.before, c.after)
