"""The request sizes a pool usually sees, and two measures of what a placement costs them.

Fragmentation (Fragmentation Gradient Descent, Weng et al., ATC '23): for a server and
one typical request, the idle GPU capacity that request cannot use there (all of it when
the request cannot run on the server at all); a server's fragmentation is the expected
fragment over the mix of typical requests.

Room (gpupool's default policy): for each typical request, how much of it the server can
still hand out (how many fit, times their size); the pool keeps the totals, so a
placement's cost is the share of each kind's remaining room it uses up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from gpupool.core.placement.filters import Demand, host_fits, slot_fits
from gpupool.core.placement.index import NodeShape, Slot

DEFAULT_MIX: tuple[tuple[Demand, float], ...] = (
    (Demand(1, 25, None, False, (), 0, 0), 0.35),
    (Demand(1, 50, None, False, (), 0, 0), 0.25),
    (Demand(1, 100, None, False, (), 0, 0), 0.25),
    (Demand(2, 100, None, False, (), 0, 0), 0.10),
    (Demand(4, 100, None, False, (), 0, 0), 0.05),
)
"""Before a pool has seen requests: mostly slices, some whole and multi-GPU requests."""


def idle_units(shape: NodeShape) -> float:
    return sum(slot.share_free() for slot in shape.slots)


def fragment(shape: NodeShape, demand: Demand) -> float:
    """Idle GPU units of the server that `demand` cannot use."""
    idle = idle_units(shape)
    if idle <= 0.0:
        return 0.0
    if demand.gpus == 0 or not host_fits(shape, demand.cpu_milli, demand.host_memory_mib):
        return idle
    usable = 0
    stranded = 0.0
    for slot in shape.slots:
        if slot_fits(slot, demand):
            usable += 1
        else:
            stranded += slot.share_free()
    return stranded if usable >= demand.gpus else idle


@dataclass(slots=True)
class Workload:
    """A weighted mix of typical requests; `version` changes whenever the mix does."""

    items: tuple[tuple[Demand, float], ...] = DEFAULT_MIX
    version: int = 0
    _memo: dict[NodeShape, float] = field(default_factory=dict)
    _by_slots: dict[tuple[Slot, ...], tuple[float, tuple[float, ...]]] = field(default_factory=dict)
    _room_by_slots: dict[tuple[Slot, ...], tuple[int, ...]] = field(default_factory=dict)
    _room: dict[NodeShape, tuple[float, ...]] = field(default_factory=dict)
    totals: list[float] = field(default_factory=list)
    """Pool-wide room for each typical request, in GPU units; kept by the pool."""
    counted_version: int = -1

    def set_mix(self, items: Iterable[tuple[Demand, float]]) -> None:
        pairs = [(d, w) for d, w in items if w > 0]
        total = sum(w for _, w in pairs) or 1.0
        self.items = tuple((d, w / total) for d, w in pairs)
        self.version += 1
        self._memo.clear()
        self._by_slots.clear()
        self._room_by_slots.clear()
        self._room.clear()

    def fragmentation(self, shape: NodeShape) -> float:
        """Expected idle GPU units of the server that a typical request cannot use."""
        hit = self._memo.get(shape)
        if hit is not None:
            return hit
        idle, stranded = self._gpu_side(shape.slots)
        total = 0.0
        if idle > 0.0:
            cpu, mem = shape.cpu_free, shape.memory_free
            for (d, w), lost in zip(self.items, stranded, strict=True):
                if (d.cpu_milli and cpu is not None and cpu < d.cpu_milli) or (
                    d.host_memory_mib and mem is not None and mem < d.host_memory_mib
                ):
                    lost = idle
                total += w * lost
        if len(self._memo) > 500_000:
            self._memo.clear()
        self._memo[shape] = total
        return total

    def room(self, shape: NodeShape) -> tuple[float, ...]:
        """For each typical request, the GPU units a server of this shape can still hand out
        to requests of exactly that kind (how many fit, times their size)."""
        hit = self._room.get(shape)
        if hit is not None:
            return hit
        counts = self._room_by_slots.get(shape.slots)
        if counts is None:
            counts = tuple(_fit_count(shape.slots, d) for d, _w in self.items)
            if len(self._room_by_slots) > 200_000:
                self._room_by_slots.clear()
            self._room_by_slots[shape.slots] = counts
        cpu, mem = shape.cpu_free, shape.memory_free
        out = []
        for (d, _w), count in zip(self.items, counts, strict=True):
            if d.gpus == 0:
                out.append(0.0)
                continue
            if d.cpu_milli and cpu is not None:
                count = min(count, max(cpu, 0) // d.cpu_milli)
            if d.host_memory_mib and mem is not None:
                count = min(count, max(mem, 0) // d.host_memory_mib)
            out.append(count * d.gpu_units())
        found = tuple(out)
        if len(self._room) > 500_000:
            self._room.clear()
        self._room[shape] = found
        return found

    def account(self, old: NodeShape | None, new: NodeShape | None) -> None:
        """A server changed shape: move its room from the old to the new in the totals."""
        if self.counted_version != self.version:
            return
        if old is not None:
            for i, r in enumerate(self.room(old)):
                self.totals[i] -= r
        if new is not None:
            for i, r in enumerate(self.room(new)):
                self.totals[i] += r

    def recount(self, shapes: Iterable[NodeShape]) -> None:
        totals = [0.0] * len(self.items)
        for shape in shapes:
            for i, r in enumerate(self.room(shape)):
                totals[i] += r
        self.totals = totals
        self.counted_version = self.version

    def room_lost(self, before: NodeShape, after: NodeShape) -> float:
        """Expected share of the pool's room for typical requests that a placement uses up:
        scarce kinds (a GPU model few servers have, whole servers for 8-GPU gangs) weigh
        more, because each unit lost is a larger part of what is left of them."""
        if self.counted_version != self.version:
            return 0.0
        lost = 0.0
        for (_d, w), total, b, a in zip(
            self.items, self.totals, self.room(before), self.room(after), strict=True
        ):
            if b > a and total > 0:
                lost += w * (b - a) / total
        # In GPU units of an average kind: a pool-wide share times the pool's size.
        return lost * self.pool_units

    @property
    def pool_units(self) -> float:
        return max(self.totals, default=0.0)

    def _gpu_side(self, slots: tuple[Slot, ...]) -> tuple[float, tuple[float, ...]]:
        """Idle GPU units of these GPUs, and for each typical request what it cannot use."""
        hit = self._by_slots.get(slots)
        if hit is not None:
            return hit
        shares = [s.share_free() for s in slots]
        idle = sum(shares)
        lost: list[float] = []
        for d, _w in self.items:
            if d.gpus == 0 or idle <= 0.0:
                lost.append(idle)
                continue
            usable = 0
            stranded = 0.0
            for slot, share in zip(slots, shares, strict=True):
                if slot_fits(slot, d):
                    usable += 1
                else:
                    stranded += share
            lost.append(stranded if usable >= d.gpus else idle)
        found = (idle, tuple(lost))
        if len(self._by_slots) > 200_000:
            self._by_slots.clear()
        self._by_slots[slots] = found
        return found


def _fit_count(slots: tuple[Slot, ...], d: Demand) -> int:
    """How many requests like `d` these GPUs can take at once (GPU side only)."""
    if d.gpus == 0:
        return 0
    if d.gpus > 1 or d.physical or d.compute_pct >= 100:
        return sum(1 for slot in slots if slot_fits(slot, d)) // d.gpus
    count = 0
    for slot in slots:
        if not slot_fits(slot, d):
            continue
        need_m = d.slice_memory_mib(slot.memory_mib)
        count += min(slot.free_compute // d.compute_pct, slot.free_memory // max(need_m, 1))
    return count


def mix_of(demands: Iterable[Demand], top: int = 64) -> list[tuple[Demand, float]]:
    """The `top` most frequent request shapes with their frequencies.

    Requests that differ only in the server CPU and memory they need count as one shape,
    needing the median of those, so that rare sizes of host share do not crowd out
    GPU shapes from the mix.
    """
    groups: dict[Demand, list[Demand]] = {}
    for d in demands:
        groups.setdefault(d._replace(cpu_milli=0, host_memory_mib=0), []).append(d)
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), _order(kv[0])))[:top]
    total = sum(len(members) for _, members in ranked) or 1
    out = []
    for shape, members in ranked:
        cpus = sorted(m.cpu_milli for m in members)
        mems = sorted(m.host_memory_mib for m in members)
        typical = shape._replace(
            cpu_milli=cpus[len(cpus) // 2], host_memory_mib=mems[len(mems) // 2]
        )
        out.append((typical, len(members) / total))
    return out


@dataclass(slots=True)
class WorkloadLearner:
    """Learns the mix from the requests a pool sees.

    Every `every` requests it recomputes the mix from the last `keep`, and adopts it only
    when it moved by more than `threshold` (total variation): a new mix invalidates the
    memoised scores, so a steady stream of requests must not churn it.
    """

    every: int = 256
    keep: int = 2048
    threshold: float = 0.1
    seen: list[Demand] = field(default_factory=list)
    pending: int = 0

    def observe(self, demand: Demand, workload: Workload) -> None:
        self.seen.append(demand)
        if len(self.seen) > self.keep:
            del self.seen[: len(self.seen) - self.keep]
        self.pending += 1
        if self.pending < self.every and workload.version > 0:
            return
        if self.pending < min(self.every, 32):
            return
        self.pending = 0
        mix = mix_of(self.seen)
        if _moved(dict(workload.items), dict(mix)) > self.threshold:
            workload.set_mix(mix)


def _order(d: Demand) -> tuple[object, ...]:
    """A total order on demands (None memory sorts first), for reproducible ties."""
    return (
        d.gpus,
        d.compute_pct,
        -1 if d.memory_mib is None else d.memory_mib,
        d.physical,
        d.models,
        d.cpu_milli,
        d.host_memory_mib,
    )


def _moved(old: dict[Demand, float], new: dict[Demand, float]) -> float:
    """Total variation distance between two mixes."""
    keys = set(old) | set(new)
    return 0.5 * sum(abs(old.get(k, 0.0) - new.get(k, 0.0)) for k in keys)
