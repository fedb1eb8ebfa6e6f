"""Free capacity indexed by node shape, so a decision scores each distinct server state once.

A node's *shape* is what placement can see of it: the free room of each GPU that takes new
leases, and the server's free CPU and memory. Servers with the same shape are
interchangeable for every filter and scorer, so the index groups them: with 10,000 GPUs
a decision visits a few hundred groups instead of every GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from gpupool.core.model import Gpu, GpuMode, GpuUsage, Host, Ratios


class Slot(NamedTuple):
    """One GPU that takes new leases, as placement sees it."""

    physical: bool
    model: str
    memory_mib: int
    free_compute: int
    free_memory: int
    capacity_compute: int
    capacity_memory: int

    def share_free(self) -> float:
        """Idle part of the GPU in GPU units (0..1): the scarcer of compute and memory."""
        c, m = self.capacity_compute, self.capacity_memory
        if c <= 0 or m <= 0:
            return 0.0
        a, b = self.free_compute / c, self.free_memory / m
        return a if a < b else b

    def is_idle(self) -> bool:
        return (
            self.free_compute == self.capacity_compute and self.free_memory == self.capacity_memory
        )


class NodeShape(NamedTuple):
    slots: tuple[Slot, ...]
    """Usable GPUs, sorted: equal shapes mean interchangeable servers."""
    cpu_free: int | None
    memory_free: int | None
    cpu_capacity: int | None
    memory_capacity: int | None
    gpu_count: int
    """All GPUs of the server, usable or not."""


def slot_of(gpu: Gpu, used: GpuUsage, ratios: Ratios) -> Slot | None:
    if not gpu.takes_new_leases():
        return None
    if gpu.mode is GpuMode.PHYSICAL:
        cap_c, cap_m = 100, gpu.memory_mib
        free = not used.leases
        return Slot(
            True,
            gpu.model,
            gpu.memory_mib,
            cap_c if free else 0,
            cap_m if free else 0,
            cap_c,
            cap_m,
        )
    cap_c = int(100 * ratios.compute)
    cap_m = int(gpu.memory_mib * ratios.memory)
    if used.whole:
        return Slot(False, gpu.model, gpu.memory_mib, 0, 0, cap_c, cap_m)
    return Slot(
        False,
        gpu.model,
        gpu.memory_mib,
        cap_c - used.compute_pct,
        cap_m - used.memory_mib,
        cap_c,
        cap_m,
    )


def shape_of(
    gpus: Iterable[Gpu],
    usage: Mapping[str, GpuUsage],
    ratios: Ratios,
    host: Host | None,
    host_used: tuple[int, int],
) -> tuple[NodeShape, tuple[str, ...]]:
    """The node's shape and its usable GPUs' uuids in the order of the shape's slots."""
    pairs: list[tuple[Slot, int, str]] = []
    count = 0
    for gpu in gpus:
        count += 1
        slot = slot_of(gpu, usage[gpu.uuid], ratios)
        if slot is not None:
            pairs.append((slot, gpu.index, gpu.uuid))
    pairs.sort()
    cpu_free = mem_free = cpu_cap = mem_cap = None
    if host is not None:
        cpu_cap, mem_cap = host.cpu_milli, host.memory_mib
        if cpu_cap is not None:
            cpu_free = cpu_cap - host_used[0]
        if mem_cap is not None:
            mem_free = mem_cap - host_used[1]
    shape = NodeShape(tuple(p[0] for p in pairs), cpu_free, mem_free, cpu_cap, mem_cap, count)
    return shape, tuple(p[2] for p in pairs)


@dataclass(slots=True)
class Group:
    """Servers that share one shape; members keep insertion order so ties break reproducibly."""

    shape: NodeShape
    nodes: dict[str, None] = field(default_factory=dict)
    max_free_compute: int = 0
    idle_slots: int = 0


@dataclass(slots=True)
class NodeIndex:
    """Node → shape, shape → group of nodes; kept current by the pool after every change."""

    shapes: dict[str, NodeShape] = field(default_factory=dict)
    order: dict[str, tuple[str, ...]] = field(default_factory=dict)
    groups: dict[NodeShape, Group] = field(default_factory=dict)
    version: int = 0

    def set(self, node: str, shape: NodeShape, order: tuple[str, ...]) -> None:
        old = self.shapes.get(node)
        self.order[node] = order
        if old == shape:
            return
        self.version += 1
        if old is not None:
            self._leave(node, old)
        self.shapes[node] = shape
        group = self.groups.get(shape)
        if group is None:
            group = Group(
                shape,
                max_free_compute=max((s.free_compute for s in shape.slots), default=0),
                idle_slots=sum(1 for s in shape.slots if s.is_idle()),
            )
            self.groups[shape] = group
        group.nodes[node] = None

    def drop(self, node: str) -> None:
        old = self.shapes.pop(node, None)
        self.order.pop(node, None)
        if old is not None:
            self.version += 1
            self._leave(node, old)

    def _leave(self, node: str, shape: NodeShape) -> None:
        group = self.groups[shape]
        del group.nodes[node]
        if not group.nodes:
            del self.groups[shape]

    def __iter__(self) -> Iterator[Group]:
        return iter(self.groups.values())
