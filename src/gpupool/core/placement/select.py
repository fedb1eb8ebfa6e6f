"""Selection: run the filters and the policy's scorer over the index and pick the placement.

Each distinct server shape is evaluated once per request shape (memoised), then the first
server of the best group that is up is chosen. The client's own server is tried first.
A gang that fits no single server may span servers, the fewest possible.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass

from gpupool.core.model import LeaseRequest, Slice
from gpupool.core.placement.filters import Demand, fitting_slots, host_fits
from gpupool.core.placement.index import Group, NodeIndex, NodeShape, Slot
from gpupool.core.placement.policies import PlacementPolicy
from gpupool.core.placement.scorers import Candidate, shape_after
from gpupool.core.placement.workload import Workload

Choice = tuple[float, tuple[int, ...]]
Memo = dict[tuple[NodeShape, Demand, str, int], Choice | None]
HeldBack = Mapping[str, tuple[int, int]]
"""Room kept free on a GPU for the queue's head: compute %, memory MiB (uuid → room)."""

MEMO_LIMIT = 400_000


@dataclass(frozen=True, slots=True)
class Placement:
    slices: tuple[Slice, ...]
    host: tuple[tuple[str, int, int], ...]
    """(node, CPU milli, memory MiB) charged to each server the lease runs on."""


def evaluate(
    shape: NodeShape, demand: Demand, policy: PlacementPolicy, workload: Workload, memo: Memo
) -> Choice | None:
    """The best choice of GPUs on a server of this shape, with its score; None if none fits."""
    key = (shape, demand, policy.memo_key, workload.version)
    if key in memo:
        return memo[key]
    result = _evaluate(shape, demand, policy, workload)
    if len(memo) > MEMO_LIMIT:
        memo.clear()
    memo[key] = result
    return result


def _evaluate(
    shape: NodeShape, demand: Demand, policy: PlacementPolicy, workload: Workload
) -> Choice | None:
    if not host_fits(shape, demand.cpu_milli, demand.host_memory_mib):
        return None
    fits = fitting_slots(shape, demand)
    if len(fits) < demand.gpus:
        return None
    options: list[tuple[int, ...]]
    if demand.gpus == 0:
        options = [()]
    elif demand.gpus == 1:
        seen: set[Slot] = set()
        options = []
        for i in fits:
            if shape.slots[i] not in seen:
                seen.add(shape.slots[i])
                options.append((i,))
    else:
        # Slots are sorted tightest first: try the tightest and the emptiest GPUs.
        options = [tuple(fits[: demand.gpus]), tuple(fits[-demand.gpus :])]
    best: Choice | None = None
    for chosen in options:
        after = shape_after(shape, demand, chosen, demand.cpu_milli, demand.host_memory_mib)
        score = policy.scorer(Candidate(shape, after, chosen, demand), workload)
        if best is None or score < best[0]:
            best = (score, chosen)
    return best


def held_back_shape(
    shape: NodeShape, order: tuple[str, ...], held: HeldBack
) -> tuple[NodeShape, tuple[str, ...]]:
    """The server as a backfilled request sees it: room kept for the head taken away."""
    pairs = []
    for slot, uuid in zip(shape.slots, order, strict=True):
        room = held.get(uuid)
        if room is not None:
            slot = slot._replace(
                free_compute=slot.free_compute - room[0], free_memory=slot.free_memory - room[1]
            )
        pairs.append((slot, uuid))
    pairs.sort(key=lambda p: p[0])
    return shape._replace(slots=tuple(p[0] for p in pairs)), tuple(p[1] for p in pairs)


@dataclass(slots=True)
class Selector:
    """One decision's view: the index, who is up, the policy and what is held back."""

    index: NodeIndex
    nodes_up: Set[str]
    policy: PlacementPolicy
    workload: Workload
    memo: Memo
    held_back: HeldBack
    held_nodes: Set[str]
    held_shapes: dict[tuple[object, ...], tuple[NodeShape, tuple[str, ...]]]

    def shape(self, node: str) -> tuple[NodeShape, tuple[str, ...]] | None:
        shape = self.index.shapes.get(node)
        if shape is None:
            return None
        order = self.index.order[node]
        if node in self.held_nodes:
            key = (shape, order, tuple(self.held_back.get(u) for u in order))
            hit = self.held_shapes.get(key)
            if hit is None:
                if len(self.held_shapes) > 10_000:
                    self.held_shapes.clear()
                hit = self.held_shapes[key] = held_back_shape(shape, order, self.held_back)
            return hit
        return shape, order

    def place(self, request: LeaseRequest, demand: Demand) -> Placement | None:
        """Pinned server only; else the client's own server if it fits; else the best."""
        if request.node is not None:
            return self._on(request.node, demand)
        if request.prefer_node is not None:
            local = self._on(request.prefer_node, demand)
            if local is not None:
                return local
        found = self._random(demand) if self.policy.rng is not None else self._best(demand)
        if found is None and demand.gpus > 1 and request.span_nodes:
            return self._span(demand)
        return found

    def _on(self, node: str, demand: Demand) -> Placement | None:
        if node not in self.nodes_up:
            return None
        seen = self.shape(node)
        if seen is None:
            return None
        shape, order = seen
        choice = evaluate(shape, demand, self.policy, self.workload, self.memo)
        if choice is None:
            return None
        return self._build(node, shape, order, choice[1], demand)

    @staticmethod
    def _quick_reject(group: Group, demand: Demand) -> bool:
        shape = group.shape
        if demand.cpu_milli and shape.cpu_free is not None and shape.cpu_free < demand.cpu_milli:
            return True
        if (
            demand.host_memory_mib
            and shape.memory_free is not None
            and shape.memory_free < demand.host_memory_mib
        ):
            return True
        if demand.gpus == 0:
            return False
        if demand.physical:
            return group.idle_slots < demand.gpus
        return group.max_free_compute < demand.compute_pct

    def _best(self, demand: Demand) -> Placement | None:
        best: tuple[float, str, NodeShape, tuple[str, ...], tuple[int, ...]] | None = None
        held_nodes = self.held_nodes
        up = self.nodes_up
        for group in self.index:
            if self._quick_reject(group, demand):
                continue
            node = next((n for n in group.nodes if n in up and n not in held_nodes), None)
            if node is None:
                continue
            choice = evaluate(group.shape, demand, self.policy, self.workload, self.memo)
            if choice is not None and (best is None or choice[0] < best[0]):
                best = (choice[0], node, group.shape, self.index.order[node], choice[1])
        for node in held_nodes:
            if node not in up:
                continue
            seen = self.shape(node)
            if seen is None:
                continue
            choice = evaluate(seen[0], demand, self.policy, self.workload, self.memo)
            if choice is not None and (best is None or choice[0] < best[0]):
                best = (choice[0], node, seen[0], seen[1], choice[1])
        if best is None:
            return None
        return self._build(best[1], best[2], best[3], best[4], demand)

    def _random(self, demand: Demand) -> Placement | None:
        assert self.policy.rng is not None
        feasible: list[tuple[str, NodeShape, tuple[str, ...], tuple[int, ...]]] = []
        for group in self.index:
            if self._quick_reject(group, demand):
                continue
            nodes = [n for n in group.nodes if n in self.nodes_up and n not in self.held_nodes]
            if not nodes:
                continue
            choice = evaluate(group.shape, demand, self.policy, self.workload, self.memo)
            if choice is None:
                continue
            for node in nodes:
                feasible.append((node, group.shape, self.index.order[node], choice[1]))
        for node in self.held_nodes:
            seen = self.shape(node) if node in self.nodes_up else None
            if seen is None:
                continue
            choice = evaluate(seen[0], demand, self.policy, self.workload, self.memo)
            if choice is not None:
                feasible.append((node, seen[0], seen[1], choice[1]))
        if not feasible:
            return None
        node, shape, order, _ = feasible[self.policy.rng.randrange(len(feasible))]
        # A random GPU among those that fit on the chosen server.
        fits = fitting_slots(shape, demand)
        chosen = tuple(sorted(self.policy.rng.sample(fits, demand.gpus)))
        return self._build(node, shape, order, chosen, demand)

    def _fits(self, shape: NodeShape, one: Demand) -> tuple[int, ...]:
        key = (shape, one, "~fits", 0)
        hit = self.memo.get(key)
        if hit is None:
            hit = (0.0, tuple(fitting_slots(shape, one)))
            self.memo[key] = hit
        return hit[1]

    def _span(self, demand: Demand) -> Placement | None:
        """A gang over several servers: the fewest servers, the ones with most room first."""
        one = demand._replace(gpus=1, cpu_milli=0, host_memory_mib=0)
        per_gpu_cpu = -(-demand.cpu_milli // demand.gpus)
        per_gpu_mem = -(-demand.host_memory_mib // demand.gpus)
        offers: list[tuple[int, str, NodeShape, tuple[str, ...], list[int]]] = []
        total = 0

        def offer(node: str, shape: NodeShape, order: tuple[str, ...], fits: list[int]) -> None:
            nonlocal total
            while fits and not host_fits(shape, per_gpu_cpu * len(fits), per_gpu_mem * len(fits)):
                fits.pop()
            if fits:
                offers.append((-len(fits), node, shape, order, fits))
                total += len(fits)

        for group in self.index:
            if self._quick_reject(group, one):
                continue
            fits = self._fits(group.shape, one)
            if not fits:
                continue
            for node in group.nodes:
                if node in self.nodes_up and node not in self.held_nodes:
                    offer(node, group.shape, self.index.order[node], list(fits))
        for node in self.held_nodes:
            seen = self.shape(node) if node in self.nodes_up else None
            if seen is not None:
                offer(node, seen[0], seen[1], fitting_slots(seen[0], one))
        if total < demand.gpus:
            return None
        offers.sort(key=lambda o: (o[0], o[1]))
        slices: list[Slice] = []
        host: list[tuple[str, int, int]] = []
        need = demand.gpus
        for _neg, node, shape, order, offered in offers:
            taken = offered[:need]
            part = self._build(node, shape, order, tuple(taken), one._replace(gpus=len(taken)))
            slices.extend(part.slices)
            if demand.cpu_milli or demand.host_memory_mib:
                host.append((node, per_gpu_cpu * len(taken), per_gpu_mem * len(taken)))
            need -= len(taken)
            if need == 0:
                break
        return Placement(tuple(slices), tuple(host))

    def _build(
        self,
        node: str,
        shape: NodeShape,
        order: tuple[str, ...],
        chosen: tuple[int, ...],
        demand: Demand,
    ) -> Placement:
        slices = tuple(
            Slice(
                gpu_uuid=order[i],
                compute_pct=100 if demand.physical else demand.compute_pct,
                memory_mib=demand.slice_memory_mib(shape.slots[i].memory_mib),
                whole=demand.physical,
            )
            for i in chosen
        )
        host: tuple[tuple[str, int, int], ...] = ()
        if demand.cpu_milli or demand.host_memory_mib:
            host = ((node, demand.cpu_milli, demand.host_memory_mib),)
        return Placement(slices, host)
