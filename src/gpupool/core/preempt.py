"""Preemption planning, and the room a blocked request keeps: which leases must end so it fits.

Only leases of strictly lower priority are ever chosen, never more of a tenant than its
holdings above its guaranteed share, and only when ending them makes the request fit.
Among the sets that do, the cheapest: the fewest GPU-equivalents lost, lower priorities
first. The controller then tells the holders and releases the leases after a grace period.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gpupool.core.model import Gpu, GpuUsage, LeaseRequest, Quota, Ratios, Slice
from gpupool.core.placement.filters import Demand, demand_of, slot_fits, statically_fits
from gpupool.core.placement.index import NodeIndex, NodeShape, Slot, slot_of
from gpupool.core.placement.select import Memo, held_back_shape

Room = tuple[tuple[str, int, int], ...]
"""(GPU uuid, compute %, memory MiB) kept free for one request."""


class PoolView(Protocol):
    """What planning reads of the pool (gpupool.core.pool.Pool, which calls in here): its
    GPUs and their use, who holds what at which priority, the quotas, the placement index."""

    @property
    def ratios(self) -> Ratios: ...
    @property
    def gpus(self) -> Mapping[str, Gpu]: ...
    @property
    def nodes_up(self) -> Collection[str]: ...
    @property
    def quotas(self) -> Mapping[str, Quota]: ...
    @property
    def holdings(self) -> Mapping[str, tuple[Slice, ...]]: ...
    @property
    def owners(self) -> Mapping[str, str]: ...
    @property
    def usage(self) -> Mapping[str, GpuUsage]: ...
    @property
    def priorities(self) -> Mapping[str, int]: ...
    @property
    def preempting(self) -> Mapping[str, str]: ...
    @property
    def index(self) -> NodeIndex: ...
    @property
    def placement_memo(self) -> Memo: ...


@dataclass(frozen=True, slots=True)
class Preemption:
    lease_id: str
    """The queued request that the preemption makes room for."""
    victims: tuple[str, ...]
    room: Room


def withdrawn(preempting: Mapping[str, str], waiting: Collection[str]) -> dict[str, str]:
    """The preemptions to withdraw: victim → cause, for every victim whose cause no longer
    waits in the queue (it was released, expired, or was granted before the victims were
    gone). A cause of "" (not recorded) is never withdrawn: its grace period runs out as
    before, since nothing says what it was for."""
    return {victim: by for victim, by in preempting.items() if by and by not in waiting}


def units_of(slices: Iterable[Slice]) -> float:
    """GPU-equivalents a lease holds: whole GPUs count 1, slices their compute share."""
    return sum(1.0 if s.whole else s.compute_pct / 100 for s in slices)


def held_units(pool: PoolView, tenant: str) -> float:
    return sum(
        units_of(pool.holdings[lid]) for lid, owner in pool.owners.items() if owner == tenant
    )


def _room_on(slot: Slot, uuid: str, demand: Demand) -> tuple[str, int, int]:
    if demand.physical:
        return (uuid, slot.capacity_compute, slot.capacity_memory)
    return (uuid, demand.compute_pct, demand.slice_memory_mib(slot.memory_mib))


def _shortage(slot: Slot, demand: Demand) -> float:
    if demand.physical:
        return 0.0 if slot.is_idle() else 1.0
    need_m = demand.slice_memory_mib(slot.memory_mib)
    return max(0, demand.compute_pct - slot.free_compute) / max(slot.capacity_compute, 1) + max(
        0, need_m - slot.free_memory
    ) / max(slot.capacity_memory, 1)


def _candidate_nodes(pool: PoolView, request: LeaseRequest) -> list[str]:
    if request.node is not None:
        return [request.node] if request.node in pool.nodes_up else []
    return [n for g in pool.index for n in g.nodes if n in pool.nodes_up]


def reserve_room(
    pool: PoolView,
    request: LeaseRequest,
    held: Mapping[str, tuple[int, int]],
    prefer_leases: Iterable[str] = (),
) -> Room:
    """GPUs a blocked request will take once enough ends there: those short the least."""
    demand = demand_of(request)
    if demand.gpus == 0:
        return ()
    victims = sorted(prefer_leases)
    if victims:
        room: list[tuple[str, int, int]] = []
        for lid in victims:
            for s in pool.holdings.get(lid, ()):
                slot = _slot(pool, s.gpu_uuid)
                fits = slot is not None and statically_fits(slot, demand)
                if fits and slot is not None and all(r[0] != s.gpu_uuid for r in room):
                    room.append(_room_on(slot, s.gpu_uuid, demand))
        if len(room) >= demand.gpus:
            return tuple(room[: demand.gpus])
    best: tuple[float, str, NodeShape, tuple[str, ...], tuple[int, ...]] | None = None
    held_nodes = {pool.gpus[u].node for u in held if u in pool.gpus}
    for group in pool.index:
        node = next(
            (
                n
                for n in group.nodes
                if n in pool.nodes_up
                and n not in held_nodes
                and (request.node is None or n == request.node)
            ),
            None,
        )
        if node is None:
            continue
        found = _closest(group.shape, demand, pool)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], node, group.shape, pool.index.order[node], found[1])
    for node in held_nodes:
        if node not in pool.nodes_up or (request.node is not None and node != request.node):
            continue
        shape, order = held_back_shape(pool.index.shapes[node], pool.index.order[node], held)
        found = _closest(shape, demand, pool)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], node, shape, order, found[1])
    if best is not None:
        _cost, _node, shape, order, chosen = best
        return tuple(_room_on(shape.slots[i], order[i], demand) for i in chosen)
    if not request.span_nodes:
        return ()
    spread: list[tuple[float, str, Slot]] = []
    for node in _candidate_nodes(pool, request):
        for uuid in pool.index.order.get(node, ()):
            slot = _slot(pool, uuid)
            if uuid not in held and slot is not None and statically_fits(slot, demand):
                spread.append((_shortage(slot, demand), uuid, slot))
    if len(spread) < demand.gpus:
        return ()
    spread.sort(key=lambda o: (o[0], o[1]))
    return tuple(_room_on(slot, uuid, demand) for _c, uuid, slot in spread[: demand.gpus])


def _closest(
    shape: NodeShape, demand: Demand, pool: PoolView
) -> tuple[float, tuple[int, ...]] | None:
    """On a server of this shape, the GPUs short the least of fitting `demand`, and by how much."""
    key = (shape, demand, "~closest", 0)
    memo = pool.placement_memo
    if key in memo:
        return memo[key]
    offers = sorted(
        (_shortage(slot, demand), i)
        for i, slot in enumerate(shape.slots)
        if statically_fits(slot, demand)
    )
    found = None
    if len(offers) >= demand.gpus:
        chosen = offers[: demand.gpus]
        found = (sum(c for c, _i in chosen), tuple(i for _c, i in chosen))
    memo[key] = found
    return found


def _slot(pool: PoolView, uuid: str) -> Slot | None:
    gpu = pool.gpus.get(uuid)
    if gpu is None:
        return None
    return slot_of(gpu, pool.usage[uuid], pool.ratios)


def _eligible_victims(pool: PoolView, request: LeaseRequest) -> dict[str, float]:
    """Leases that may be preempted for `request`, with what ending each costs."""
    budget: dict[str, float] = {}
    for tenant, quota in pool.quotas.items():
        if quota.guaranteed_gpus > 0:
            budget[tenant] = held_units(pool, tenant) - quota.guaranteed_gpus
    out: dict[str, float] = {}
    for lid, slices in pool.holdings.items():
        priority = pool.priorities.get(lid, 0)
        if priority >= request.priority or lid in pool.preempting:
            continue
        size = units_of(slices)
        owner = pool.owners.get(lid, "")
        if owner in budget and size > budget[owner] + 1e-9:
            continue
        # Lower priorities are cheaper to end: a priority step weighs a hundredth of a GPU.
        out[lid] = size * (1.0 + priority / 100.0)
    return out


def _free_after(slot: Slot, uuid: str, pool: PoolView, gone: set[str]) -> Slot:
    compute, memory = slot.free_compute, slot.free_memory
    for lid in gone:
        for s in pool.holdings.get(lid, ()):
            if s.gpu_uuid == uuid:
                compute += s.compute_pct
                memory += s.memory_mib
    if slot.physical:
        left = pool.usage[uuid].leases - gone
        if not left:
            return slot._replace(
                free_compute=slot.capacity_compute, free_memory=slot.capacity_memory
            )
        return slot._replace(free_compute=0, free_memory=0)
    return slot._replace(free_compute=compute, free_memory=memory)


def _cheapest_on_gpu(
    pool: PoolView,
    uuid: str,
    slot: Slot,
    demand: Demand,
    costs: Mapping[str, float],
    already: set[str],
) -> tuple[float, set[str]] | None:
    """The cheapest extra leases to end on one GPU so the demand fits there."""
    if slot_fits(_free_after(slot, uuid, pool, already), demand):
        return (0.0, set())
    on_gpu = [lid for lid in sorted(pool.usage[uuid].leases) if lid not in already]
    if any(lid not in costs for lid in on_gpu) and slot.physical:
        return None
    movable = sorted((costs[lid], lid) for lid in on_gpu if lid in costs)
    # One lease whose end alone suffices, the cheapest such...
    single: tuple[float, set[str]] | None = None
    for cost, lid in movable:
        if slot_fits(_free_after(slot, uuid, pool, already | {lid}), demand):
            single = (cost, {lid})
            break
    # ...or the cheapest ones first until it fits.
    chosen: set[str] = set()
    total = 0.0
    greedy: tuple[float, set[str]] | None = None
    for cost, lid in movable:
        chosen.add(lid)
        total += cost
        if slot_fits(_free_after(slot, uuid, pool, already | chosen), demand):
            greedy = (total, set(chosen))
            break
    options = [o for o in (single, greedy) if o is not None]
    return min(options, key=lambda o: (o[0], sorted(o[1]))) if options else None


def plan_preemption(
    pool: PoolView, lease_id: str, request: LeaseRequest, among: Collection[str] | None = None
) -> Preemption | None:
    """The cheapest set of lower-priority leases whose end makes `request` fit, or None.

    `among`: only these leases may be chosen (those whose holders the caller can end, as
    the Kubernetes scheduler can evict pods but not end other leases)."""
    demand = demand_of(request)
    if demand.gpus == 0:
        return None
    costs = _eligible_victims(pool, request)
    if among is not None:
        allowed = set(among)
        costs = {lid: cost for lid, cost in costs.items() if lid in allowed}
    if not costs:
        return None
    best: tuple[float, set[str], list[tuple[str, Slot]]] | None = None
    offers_by_node: dict[str, list[tuple[str, Slot]]] = {}
    for node in _candidate_nodes(pool, request):
        offers = []
        for uuid in pool.index.order.get(node, ()):
            slot = _slot(pool, uuid)
            if slot is None or not statically_fits(slot, demand):
                continue
            offers.append((uuid, slot))
        offers_by_node[node] = offers
        found = _clear_greedily(pool, offers, demand, costs)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    if best is None and request.span_nodes and demand.gpus > 1:
        # No one server can be cleared for the whole gang: clear GPUs across servers, which
        # the gang may span (its placement then takes the fewest servers it can).
        everywhere = [offer for offers in offers_by_node.values() for offer in offers]
        best = _clear_greedily(pool, everywhere, demand, costs)
    if best is None:
        return None
    _total, gone, picked = best
    if not _guarantees_hold(pool, gone) or not _fits_after(pool, demand, picked, gone):
        return None
    room = tuple(_room_on(slot, uuid, demand) for uuid, slot in picked)
    return Preemption(lease_id, tuple(sorted(gone)), room)


def _clear_greedily(
    pool: PoolView,
    offers: list[tuple[str, Slot]],
    demand: Demand,
    costs: Mapping[str, float],
) -> tuple[float, set[str], list[tuple[str, Slot]]] | None:
    """Greedy over the offered GPUs: each time the GPU that is cheapest to clear next."""
    if len(offers) < demand.gpus:
        return None
    gone: set[str] = set()
    total = 0.0
    picked: list[tuple[str, Slot]] = []
    left = list(offers)
    while len(picked) < demand.gpus:
        options = []
        for uuid, slot in left:
            found = _cheapest_on_gpu(pool, uuid, slot, demand, costs, gone)
            if found is not None:
                options.append((found[0], uuid, slot, found[1]))
        if not options:
            return None
        cost, uuid, slot, extra = min(options, key=lambda o: (o[0], o[1]))
        total += cost
        gone |= extra
        picked.append((uuid, slot))
        left = [o for o in left if o[0] != uuid]
    return (total, gone, picked) if gone else None


def _guarantees_hold(pool: PoolView, gone: set[str]) -> bool:
    taken: dict[str, float] = {}
    for lid in gone:
        owner = pool.owners.get(lid, "")
        taken[owner] = taken.get(owner, 0.0) + units_of(pool.holdings.get(lid, ()))
    for tenant, units in taken.items():
        quota = pool.quotas.get(tenant)
        guaranteed = quota.guaranteed_gpus if quota is not None else 0.0
        if guaranteed > 0 and held_units(pool, tenant) - units < guaranteed - 1e-9:
            return False
    return True


def _fits_after(
    pool: PoolView, demand: Demand, picked: list[tuple[str, Slot]], gone: set[str]
) -> bool:
    return all(slot_fits(_free_after(slot, uuid, pool, gone), demand) for uuid, slot in picked)
