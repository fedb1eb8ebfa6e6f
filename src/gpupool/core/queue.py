"""The queue's policy: who goes first (priority, weighted dominant share, age), backfill, limits.

Order: higher priority first. Within a priority, with fair share on, the request whose
tenant would hold the smallest dominant share of the pool (its larger share of compute or
of memory, divided by the tenant's weight) once this and its own earlier requests are
granted goes first; ties, and fair share off, are first come first served. A request that
has waited `age_boost_s` goes ahead of everything of its priority that has not, so no
tenant can be starved by others that keep arriving with smaller shares.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpupool.core.errors import InvalidRequest
from gpupool.core.model import LeaseRequest, QueuedLease, Quota, Usage

OrderKey = tuple[int, int, float, int]


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """How the queue is served; the pool's default is plain priority then first come."""

    fair_share: bool = False
    """Order equals by weighted dominant share (DRF) instead of arrival alone."""
    reservations: int = 1
    """Blocked requests of each kind (virtual, physical) whose GPUs are kept for them."""
    max_head_delay_s: float = 0.0
    """A request that says it ends within this may use room kept for a blocked head."""
    max_wait_s: float | None = None
    """A request still queued after this long fails with the reason it waited."""
    age_boost_s: float | None = 600.0
    """After this long a request goes ahead of younger ones of its priority, shares aside."""

    def __post_init__(self) -> None:
        if self.reservations < 0:
            raise InvalidRequest(f"reservations must not be negative, got {self.reservations}")
        if self.max_wait_s is not None and self.max_wait_s <= 0:
            raise InvalidRequest(f"maximum wait must be positive, got {self.max_wait_s}")
        if self.max_head_delay_s < 0:
            raise InvalidRequest("maximum head delay must not be negative")


FAIR = QueuePolicy(fair_share=True)
"""What the controller and the simulator use."""


@dataclass(frozen=True, slots=True)
class Capacity:
    """The pool's totals that shares are measured against."""

    compute_pct: int
    memory_mib: int
    gpus: int

    def average_gpu_memory_mib(self) -> float:
        return self.memory_mib / self.gpus if self.gpus else 0.0


def demand_usage(request: LeaseRequest, capacity: Capacity) -> tuple[float, float]:
    """Compute % and memory MiB a request would hold, memory estimated for proportional slices."""
    per_gpu_mem = capacity.average_gpu_memory_mib()
    if request.physical:
        return 100.0 * request.gpus, per_gpu_mem * request.gpus
    memory = (
        request.memory_mib
        if request.memory_mib is not None
        else per_gpu_mem * request.compute_pct / 100
    )
    return float(request.compute_pct * request.gpus), float(memory * request.gpus)


def dominant_share(compute_pct: float, memory_mib: float, capacity: Capacity) -> float:
    shares = []
    if capacity.compute_pct:
        shares.append(compute_pct / capacity.compute_pct)
    if capacity.memory_mib:
        shares.append(memory_mib / capacity.memory_mib)
    return max(shares, default=0.0)


def waited_s(entry: QueuedLease, now: float | None) -> float:
    return 0.0 if now is None else max(0.0, now - entry.enqueued_at)


def order(
    entries: Iterable[QueuedLease],
    policy: QueuePolicy,
    held: Mapping[str, Usage],
    quotas: Mapping[str, Quota],
    capacity: Capacity,
    now: float | None = None,
) -> list[QueuedLease]:
    """The queue in grant order under `policy`."""
    keys = order_keys(entries, policy, held, quotas, capacity, now)
    return [entry for _key, entry in sorted(keys, key=lambda ke: ke[0])]


def order_keys(
    entries: Iterable[QueuedLease],
    policy: QueuePolicy,
    held: Mapping[str, Usage],
    quotas: Mapping[str, Quota],
    capacity: Capacity,
    now: float | None = None,
    sizes: dict[str, tuple[float, float]] | None = None,
) -> list[tuple[OrderKey, QueuedLease]]:
    """Each entry's order key; `sizes` caches what each request would hold."""
    items = list(entries)
    sizes = {} if sizes is None else sizes
    boost = policy.age_boost_s
    out: list[tuple[OrderKey, QueuedLease]] = []
    if not policy.fair_share:
        for e in items:
            aged = 0 if boost is not None and waited_s(e, now) >= boost else 1
            out.append(((-e.request.priority, aged, 0.0, e.seq), e))
        return out
    by_tenant: dict[str, list[QueuedLease]] = {}
    for e in items:
        by_tenant.setdefault(e.request.tenant, []).append(e)
    for tenant, mine in by_tenant.items():
        mine.sort(key=lambda e: (-e.request.priority, e.seq))
        usage = held.get(tenant)
        compute = float(usage.compute_pct) if usage else 0.0
        memory = float(usage.memory_mib) if usage else 0.0
        quota = quotas.get(tenant)
        weight = quota.weight if quota is not None else 1.0
        total_c = float(capacity.compute_pct) or 1.0
        total_m = float(capacity.memory_mib) or 1.0
        for e in mine:
            size = sizes.get(e.lease_id)
            if size is None:
                size = sizes[e.lease_id] = demand_usage(e.request, capacity)
            compute += size[0]
            memory += size[1]
            if boost is not None and now is not None and now - e.enqueued_at >= boost:
                key: OrderKey = (-e.request.priority, 0, 0.0, e.seq)
            else:
                share = round(max(compute / total_c, memory / total_m) / weight, 9)
                key = (-e.request.priority, 1, share, e.seq)
            out.append((key, e))
    return out


def overdue(
    entries: Iterable[QueuedLease], policy: QueuePolicy, now: float
) -> list[tuple[QueuedLease, float]]:
    """Requests that waited past their limit (theirs or the policy's), with the limit."""
    out = []
    for e in entries:
        limits = [w for w in (e.request.max_wait_s, policy.max_wait_s) if w is not None]
        if limits and now - e.enqueued_at >= min(limits):
            out.append((e, min(limits)))
    return out


@dataclass(slots=True)
class QueueOrder:
    """The queue kept in grant order; only tenants whose share or entries changed are re-keyed.

    Each tenant's requests form a lane sorted by (priority, arrival) whose keys only grow
    along it, so the grant order is a merge of the lanes: re-keying one tenant after a
    grant or release costs its own requests, and the merge is one sort of sorted runs.
    """

    lanes: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)
    lane_keys: dict[str, list[tuple[OrderKey, str]]] = field(default_factory=dict)
    dirty: set[str] = field(default_factory=set)
    stamp: tuple[object, ...] = ()
    waiting_since: list[tuple[float, str]] = field(default_factory=list)
    clock: float | None = None
    ranked: list[tuple[OrderKey, str]] = field(default_factory=list)
    positions: dict[str, int] | None = None
    sizes: dict[str, tuple[float, float]] = field(default_factory=dict)

    def touch(self, tenant: str) -> None:
        if tenant in self.lanes:
            self.dirty.add(tenant)

    def add(self, entry: QueuedLease) -> None:
        lane = self.lanes.setdefault(entry.request.tenant, [])
        bisect.insort(lane, (-entry.request.priority, entry.seq, entry.lease_id))
        heapq.heappush(self.waiting_since, (entry.enqueued_at, entry.lease_id))
        self.dirty.add(entry.request.tenant)

    def remove(self, entry: QueuedLease) -> None:
        tenant = entry.request.tenant
        lane = self.lanes.get(tenant)
        if lane is not None:
            item = (-entry.request.priority, entry.seq, entry.lease_id)
            at = bisect.bisect_left(lane, item)
            if at < len(lane) and lane[at] == item:
                del lane[at]
            if not lane:
                del self.lanes[tenant]
                self.lane_keys.pop(tenant, None)
        self.sizes.pop(entry.lease_id, None)
        self.dirty.add(tenant)

    def refresh(
        self,
        queue: Mapping[str, QueuedLease],
        policy: QueuePolicy,
        held: Mapping[str, Usage],
        quotas: Mapping[str, Quota],
        capacity: Capacity,
        now: float | None,
    ) -> None:
        if now is not None and (self.clock is None or now > self.clock):
            self.clock = now
        weights = (
            tuple(sorted((t, q.weight) for t, q in quotas.items())) if policy.fair_share else ()
        )
        stamp = (policy, capacity if policy.fair_share else None, weights)
        if stamp != self.stamp:
            self.stamp = stamp
            self.sizes.clear()
            self.dirty.update(self.lanes)
        self._age(queue, policy)
        if sum(len(lane) for lane in self.lanes.values()) != len(queue):
            self._rebuild_lanes(queue)  # changed behind our back: start over
        if not self.dirty:
            return
        for tenant in self.dirty:
            lane = self.lanes.get(tenant)
            if not lane:
                self.lane_keys.pop(tenant, None)
                continue
            entries = [queue[lid] for _p, _s, lid in lane]
            pairs = order_keys(entries, policy, held, quotas, capacity, self.clock, self.sizes)
            self.lane_keys[tenant] = [(key, e.lease_id) for key, e in pairs]
        self.dirty.clear()
        # Lanes are sorted runs: the sort merges them.
        self.ranked = sorted(pair for keys in self.lane_keys.values() for pair in keys)
        self.positions = None

    def ids(self) -> list[str]:
        return [lid for _key, lid in self.ranked]

    def position(self, lease_id: str) -> int | None:
        if self.positions is None:
            self.positions = {lid: i for i, (_k, lid) in enumerate(self.ranked, start=1)}
        return self.positions.get(lease_id)

    def _age(self, queue: Mapping[str, QueuedLease], policy: QueuePolicy) -> None:
        """Requests that just reached the boost age re-key their tenant."""
        boost = policy.age_boost_s
        if boost is None or self.clock is None:
            return
        while self.waiting_since and self.waiting_since[0][0] + boost <= self.clock:
            _since, lid = heapq.heappop(self.waiting_since)
            entry = queue.get(lid)
            if entry is not None:
                self.dirty.add(entry.request.tenant)

    def _rebuild_lanes(self, queue: Mapping[str, QueuedLease]) -> None:
        self.lanes = {}
        for entry in queue.values():
            self.lanes.setdefault(entry.request.tenant, []).append(
                (-entry.request.priority, entry.seq, entry.lease_id)
            )
        for lane in self.lanes.values():
            lane.sort()
        self.lane_keys = {}
        self.dirty = set(self.lanes)


# ---- priority caps ----------------------------------------------------------------------


def priority_cap(tenant_max: int | None, default_max: int | None) -> int | None:
    """The highest priority a tenant's requests may carry: its own `max_priority` if the
    operator set one, else the pool's default (None: unlimited)."""
    return tenant_max if tenant_max is not None else default_max


def priority_refusal(
    tenant: str, priority: int, tenant_max: int | None, default_max: int | None
) -> str | None:
    """Why `priority` is above the tenant's cap, naming the cap and where it comes from;
    None when it is allowed."""
    cap = priority_cap(tenant_max, default_max)
    if cap is None or priority <= cap:
        return None
    source = (
        f"tenant {tenant}'s max_priority"
        if tenant_max is not None
        else "the pool's default max priority (controller --default-max-priority)"
    )
    return (
        f"priority {priority} is above the highest priority tenant {tenant} may ask for: "
        f"{cap} ({source}); an admin can raise it with `gpupool tenant update {tenant} "
        f"--max-priority N`"
    )

