"""The pool's state and its pure operations: place, grant, release, serve the queue, switch modes.

Everything here is deterministic and does no I/O; the controller persists what these
functions decide, and the simulator replays traces through the very same code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from gpupool.core.errors import Conflict, InvalidRequest, NoCapacity, NotFound, QuotaExceeded
from gpupool.core.model import (
    Access,
    Gpu,
    GpuMode,
    GpuUsage,
    Host,
    LeaseRequest,
    QueuedLease,
    Quota,
    Ratios,
    Slice,
    Usage,
    quota_violation,
    usage_of,
)
from gpupool.core.placement.filters import Demand, demand_of, slot_fits
from gpupool.core.placement.index import NodeIndex, NodeShape, shape_of
from gpupool.core.placement.policies import PlacementPolicy, policy_named
from gpupool.core.placement.select import HeldBack, Memo, Placement, Selector
from gpupool.core.placement.workload import Workload, WorkloadLearner
from gpupool.core.preempt import Preemption, plan_preemption, reserve_room, withdrawn
from gpupool.core.queue import Capacity, QueueOrder, QueuePolicy, overdue, priority_refusal
from gpupool.core.units import format_size


@dataclass(frozen=True, slots=True)
class Grant:
    lease_id: str
    slices: tuple[Slice, ...]


@dataclass(frozen=True, slots=True)
class ModeChange:
    gpu_uuid: str
    old: GpuMode
    new: GpuMode
    target: GpuMode | None


@dataclass(slots=True)
class Pool:
    """All GPUs, who holds what, and the queue. Mutated only through its methods.

    `policy` chooses where a request goes (core/placement), `queue_policy` in which order
    waiting requests are served (core/queue). Both are pure; the controller and the
    simulator share them.
    """

    ratios: Ratios = field(default_factory=Ratios)
    gpus: dict[str, Gpu] = field(default_factory=dict)
    nodes_up: set[str] = field(default_factory=set)
    quotas: dict[str, Quota] = field(default_factory=dict)
    holdings: dict[str, tuple[Slice, ...]] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)
    queue: dict[str, QueuedLease] = field(default_factory=dict)
    usage: dict[str, GpuUsage] = field(default_factory=dict)
    tenant_usage: dict[str, Usage] = field(default_factory=dict)
    next_seq: int = 0
    policy: PlacementPolicy = field(default_factory=lambda: policy_named("default"))
    queue_policy: QueuePolicy = field(default_factory=QueuePolicy)
    hosts: dict[str, Host] = field(default_factory=dict)
    workload: Workload = field(default_factory=Workload)
    learn_workload: bool = True
    priorities: dict[str, int] = field(default_factory=dict)
    """Priority of each granted lease: preemption only ever takes lower ones."""
    preempting: dict[str, str] = field(default_factory=dict)
    """Lease being preempted → the queued lease it makes room for ("" if unknown: a
    preemption restored from a database that did not record its cause)."""
    default_max_priority: int | None = None
    """The highest priority a tenant without a `max_priority` of its own may ask for
    (the operator's setting); None: unlimited."""
    charges: dict[str, Usage] = field(default_factory=dict)
    """What a holding charges its tenant where that is not `usage_of` its slices: the old
    place of a moving lease (core/migrate.py), which the GPUs hold but the quota counts once."""
    host_held: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    host_used: dict[str, tuple[int, int]] = field(default_factory=dict)
    index: NodeIndex = field(default_factory=NodeIndex)
    node_gpus: dict[str, dict[str, None]] = field(default_factory=dict)
    placement_memo: Memo = field(default_factory=dict)
    _held_shapes: dict[tuple[object, ...], tuple[NodeShape, tuple[str, ...]]] = field(
        default_factory=dict
    )
    _learner: WorkloadLearner = field(default_factory=WorkloadLearner)
    _ranking: QueueOrder = field(default_factory=QueueOrder)
    _demands: dict[str, Demand] = field(default_factory=dict)
    _shape_keys: dict[str, tuple[object, ...]] = field(default_factory=dict)
    _shape_counts: dict[tuple[object, ...], int] = field(default_factory=dict)
    """How many queued requests share each placement key: a pass stops once all failed."""
    _capacity: tuple[int, Capacity] | None = None
    _inventory_version: int = 0
    _reserved: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    """Room kept for blocked heads (lease → (uuid, compute, memory)), reused while it holds."""

    # ---- inventory -------------------------------------------------------------------

    def upsert_gpu(self, gpu: Gpu) -> None:
        old = self.gpus.get(gpu.uuid)
        self.gpus[gpu.uuid] = gpu
        self._inventory_version += 1
        self.usage.setdefault(gpu.uuid, GpuUsage())
        if old is not None and old.node != gpu.node:
            self.node_gpus.get(old.node, {}).pop(gpu.uuid, None)
            self._refresh(old.node)
        self.node_gpus.setdefault(gpu.node, {})[gpu.uuid] = None
        self._refresh(gpu.node)

    def remove_gpu(self, uuid: str) -> None:
        if self.usage.get(uuid, GpuUsage()).leases:
            raise Conflict(f"GPU {uuid} still holds leases")
        gpu = self.gpus.pop(uuid, None)
        self.usage.pop(uuid, None)
        self._inventory_version += 1
        if gpu is not None:
            self.node_gpus.get(gpu.node, {}).pop(uuid, None)
            self._refresh(gpu.node)

    def set_host(self, node: str, host: Host) -> None:
        """Account the server's own CPU and memory (for direct leases that run on it)."""
        self.hosts[node] = host
        self._refresh(node)

    def set_node_up(self, node: str, up: bool) -> None:
        if up:
            self.nodes_up.add(node)
        else:
            self.nodes_up.discard(node)

    def gpu(self, uuid: str) -> Gpu:
        try:
            return self.gpus[uuid]
        except KeyError:
            raise NotFound(f"no GPU {uuid!r}") from None

    def _refresh(self, node: str) -> None:
        """Recompute one server's shape in the index after anything on it changed."""
        uuids = self.node_gpus.get(node, {})
        if not uuids and node not in self.hosts:
            self.node_gpus.pop(node, None)
            self.workload.account(self.index.shapes.get(node), None)
            self.index.drop(node)
            return
        shape, order = shape_of(
            (self.gpus[u] for u in uuids),
            self.usage,
            self.ratios,
            self.hosts.get(node),
            self.host_used.get(node, (0, 0)),
        )
        old = self.index.shapes.get(node)
        self.index.set(node, shape, order)
        if old != shape:
            self.workload.account(old, shape)

    # ---- capacity --------------------------------------------------------------------

    def free_on(self, gpu: Gpu) -> tuple[int, int]:
        """Compute % and memory MiB still grantable on a virtual GPU, with oversubscription."""
        used = self.usage[gpu.uuid]
        compute = int(100 * self.ratios.compute) - used.compute_pct
        memory = int(gpu.memory_mib * self.ratios.memory) - used.memory_mib
        return compute, memory

    def capacity(self) -> Capacity:
        """What shares are measured against: GPUs that are not isolated."""
        cached = self._capacity
        if cached is not None and cached[0] == self._inventory_version:
            return cached[1]
        gpus = [g for g in self.gpus.values() if g.mode is not GpuMode.ISOLATED]
        capacity = Capacity(
            compute_pct=100 * len(gpus),
            memory_mib=sum(g.memory_mib for g in gpus),
            gpus=len(gpus),
        )
        self._capacity = (self._inventory_version, capacity)
        return capacity

    def _selector(self, held_back: HeldBack | None = None) -> Selector:
        if self.workload.counted_version != self.workload.version:
            self.workload.recount(self.index.shapes.values())
        held = held_back or {}
        held_nodes = {self.gpus[u].node for u in held if u in self.gpus}
        return Selector(
            self.index,
            self.nodes_up,
            self.policy,
            self.workload,
            self.placement_memo,
            held,
            held_nodes,
            self._held_shapes,
        )

    def plan(
        self,
        request: LeaseRequest,
        held_back: HeldBack | None = None,
        demand: Demand | None = None,
        within_quota: bool = True,
    ) -> Placement | None:
        """Where `request` would go now (GPUs and server share), or None; changes nothing."""
        demand = demand or demand_of(request)
        if within_quota:
            demand = self._within_quota(request, demand)
        return self._selector(held_back).place(request, demand)

    def _placement_or_why(self, lease_id: str, request: LeaseRequest) -> Placement | str:
        """A placement within the tenant's quota, or why there is none (capacity or quota)."""
        placement = self.plan(request)
        if placement is not None:
            problem = self.quota_blocks(lease_id, request, placement.slices)
            return placement if problem is None else f"tenant quota: {problem}"
        anywhere = self.plan(request, within_quota=False)
        if anywhere is None:
            return self.shortage(request)
        problem = self.quota_blocks(lease_id, request, anywhere.slices)
        return f"tenant quota: {problem or 'memory of the GPUs with room'}"

    def _within_quota(self, request: LeaseRequest, demand: Demand) -> Demand:
        """Slices whose memory depends on the GPU go only where the memory quota allows."""
        quota = self.quotas.get(request.tenant)
        if quota is None or quota.max_memory_mib is None or demand.gpus == 0:
            return demand
        left = quota.max_memory_mib - self.held_by(request.tenant).memory_mib
        return demand._replace(memory_cap_mib=max(left, 0) // demand.gpus)

    def place(self, request: LeaseRequest) -> tuple[Slice, ...]:
        """Choose GPUs for `request` now, all or nothing, or raise NoCapacity."""
        placement = self.plan(request)
        if placement is None:
            raise NoCapacity(self.shortage(request))
        return placement.slices

    def shortage(self, request: LeaseRequest) -> str:
        """Why `request` does not fit now, in the words a user reads in the queue."""
        demand = demand_of(request)
        one = demand._replace(gpus=1, cpu_milli=0, host_memory_mib=0)
        found = 0
        per_node: dict[str, int] = {}
        for group in self.index:
            count = sum(1 for slot in group.shape.slots if slot_fits(slot, one))
            if not count:
                continue
            for node in group.nodes:
                if node in self.nodes_up and (request.node is None or node == request.node):
                    found += count
                    per_node[node] = count
        kind = "free physical GPUs" if request.physical else "virtual GPUs with room"
        if found >= request.gpus and request.gpus > 0:
            if not request.span_nodes and max(per_node.values(), default=0) < request.gpus:
                return f"no single server has {request.gpus} free GPUs for this request"
            if request.cpu_milli or request.host_memory_mib:
                return (
                    f"no server with {request.gpus} suitable GPUs has "
                    f"{request.cpu_milli / 1000:g} CPU cores and "
                    f"{format_size(request.host_memory_mib)} of memory free"
                )
        if request.gpus == 0:
            return "no server has the CPU and memory free"
        return f"needs {request.gpus} {kind}, {found} available now"

    def check_can_ever_fit(self, request: LeaseRequest) -> None:
        """Refuse at once a request that no state of this pool could satisfy."""
        gpus = [
            g
            for g in self.gpus.values()
            if g.healthy
            and request.model_allowed(g.model)
            and (request.node is None or g.node == request.node)
        ]
        if request.physical:
            fit = gpus
        else:
            # Only remote slices may be granted oversubscribed memory (see Demand.remote).
            cap = self.ratios.memory if request.access is Access.REMOTE else 1.0
            fit = [g for g in gpus if request.slice_memory_mib(g) <= int(g.memory_mib * cap)]
        if len(fit) < request.gpus:
            where = f" on node {request.node}" if request.node else ""
            models = f" of model {'|'.join(request.gpu_models)}" if request.gpu_models else ""
            size = (
                ""
                if request.physical or request.memory_mib is None
                else f" with {format_size(request.memory_mib)}"
            )
            raise NoCapacity(
                f"this pool has {len(fit)} GPUs{models}{where}{size}; "
                f"the request needs {request.gpus}: it can never be granted"
            )
        if not request.span_nodes:
            per_node: dict[str, int] = {}
            for g in fit:
                per_node[g.node] = per_node.get(g.node, 0) + 1
            if max(per_node.values(), default=0) < request.gpus:
                raise NoCapacity(
                    f"no server has {request.gpus} suitable GPUs and the request may not span "
                    "servers: it can never be granted"
                )
        if request.gpus and (request.cpu_milli or request.host_memory_mib):
            self._check_host_can_ever_fit(request, fit)

    def _check_host_can_ever_fit(self, request: LeaseRequest, fit: list[Gpu]) -> None:
        """The servers' own CPU and memory must be able to hold the request at all."""
        per_node: dict[str, int] = {}
        for g in fit:
            per_node[g.node] = per_node.get(g.node, 0) + 1

        unknown = 10**15  # a server that does not report its CPU or memory limits nothing

        def room(node: str) -> tuple[int, int]:
            host = self.hosts.get(node)
            cpu = host.cpu_milli if host and host.cpu_milli is not None else unknown
            mem = host.memory_mib if host and host.memory_mib is not None else unknown
            return cpu, mem

        whole = [
            n
            for n, count in per_node.items()
            if count >= request.gpus
            and room(n)[0] >= request.cpu_milli
            and room(n)[1] >= request.host_memory_mib
        ]
        if whole:
            return
        if request.span_nodes:
            cpu_each = -(-request.cpu_milli // request.gpus)
            mem_each = -(-request.host_memory_mib // request.gpus)
            usable = 0
            for node, count in per_node.items():
                cpu, mem = room(node)
                by_cpu = cpu // cpu_each if cpu_each else count
                by_mem = mem // mem_each if mem_each else count
                usable += min(count, by_cpu, by_mem)
            if usable >= request.gpus:
                return
        raise NoCapacity(
            f"no server with {request.gpus} suitable GPU(s) has {request.cpu_milli / 1000:g} CPU "
            f"cores and {format_size(request.host_memory_mib)} of memory in all: it can never be "
            "granted"
        )

    # ---- quotas ----------------------------------------------------------------------

    def held_by(self, tenant: str) -> Usage:
        return self.tenant_usage.get(tenant, Usage())

    def check_quota_ever(self, request: LeaseRequest, privileged: bool = False) -> None:
        """Refuse a request that breaks its tenant's quota even when the tenant holds nothing.

        The priority cap binds every caller but a `privileged` one (an admin): a tenant that
        could ask any priority could preempt every other tenant for free.
        """
        quota = self.quotas.get(request.tenant)
        if quota is None:
            raise NotFound(f"no tenant {request.tenant!r}")
        if not privileged:
            problem = priority_refusal(
                request.tenant, request.priority, quota.max_priority, self.default_max_priority
            )
            if problem is not None:
                raise QuotaExceeded(problem)
        smallest = min(
            (request.slice_memory_mib(g) for g in self.gpus.values()),
            default=request.memory_mib or 1,
        )
        alone = Usage(
            gpus=request.gpus if request.physical else 0,
            memory_mib=smallest * request.gpus,
            compute_pct=request.compute_pct * request.gpus,
            leases=1,
        )
        problem = quota_violation(quota, Usage(), alone)
        if problem is not None:
            raise QuotaExceeded(f"tenant {request.tenant}: {problem} for this request alone")

    def quota_blocks(
        self, lease_id: str, request: LeaseRequest, slices: tuple[Slice, ...]
    ) -> str | None:
        quota = self.quotas.get(request.tenant, Quota())
        return quota_violation(quota, self.held_by(request.tenant), usage_of(slices))

    # ---- grants and releases ---------------------------------------------------------

    def grant(
        self,
        lease_id: str,
        tenant: str,
        slices: tuple[Slice, ...],
        priority: int = 0,
        host: tuple[tuple[str, int, int], ...] = (),
        charge: Usage | None = None,
    ) -> None:
        """Hold `slices` for a lease; its tenant is charged `usage_of(slices)`, or `charge`."""
        if lease_id in self.holdings:
            raise Conflict(f"lease {lease_id} already holds GPUs")
        for s in slices:
            gpu = self.gpu(s.gpu_uuid)
            used = self.usage[gpu.uuid]
            if s.whole and used.leases:
                raise NoCapacity(f"GPU {gpu.uuid} is not free for a whole-GPU lease")
            if used.whole:
                raise NoCapacity(f"GPU {gpu.uuid} is held whole")
        touched: dict[str, None] = {}
        for s in slices:
            used = self.usage[s.gpu_uuid]
            used.compute_pct += s.compute_pct
            used.memory_mib += s.memory_mib
            used.leases.add(lease_id)
            used.whole = used.whole or s.whole
            touched[self.gpus[s.gpu_uuid].node] = None
        for node, cpu, mem in host:
            was = self.host_used.get(node, (0, 0))
            self.host_used[node] = (was[0] + cpu, was[1] + mem)
            touched[node] = None
        if host:
            self.host_held[lease_id] = host
        self.holdings[lease_id] = slices
        self.owners[lease_id] = tenant
        self.priorities[lease_id] = priority
        if charge is not None:
            self.charges[lease_id] = charge
        self.tenant_usage.setdefault(tenant, Usage()).add(
            usage_of(slices) if charge is None else charge
        )
        self._ranking.touch(tenant)
        for node in touched:
            self._refresh(node)

    def release(self, lease_id: str) -> list[ModeChange]:
        """Return a lease's capacity exactly; draining GPUs that become empty switch mode."""
        queued = self.queue.pop(lease_id, None)
        if queued is not None:
            self._unqueued(queued)
        self._reserved.pop(lease_id, None)
        self.preempting.pop(lease_id, None)
        slices = self.holdings.pop(lease_id, None)
        tenant = self.owners.pop(lease_id, None)
        self.priorities.pop(lease_id, None)
        host = self.host_held.pop(lease_id, ())
        charge = self.charges.pop(lease_id, None)
        if slices is None:
            return []
        if tenant is not None:
            self.tenant_usage.setdefault(tenant, Usage()).add(
                usage_of(slices) if charge is None else charge, sign=-1
            )
            self._ranking.touch(tenant)
        touched: dict[str, None] = {}
        for node, cpu, mem in host:
            was = self.host_used.get(node, (0, 0))
            self.host_used[node] = (was[0] - cpu, was[1] - mem)
            touched[node] = None
        changes: list[ModeChange] = []
        for s in slices:
            used = self.usage.get(s.gpu_uuid)
            if used is None:
                continue
            used.compute_pct -= s.compute_pct
            used.memory_mib -= s.memory_mib
            used.leases.discard(lease_id)
            if s.whole:
                used.whole = False
            change = self._finish_drain(s.gpu_uuid)
            if change is not None:
                changes.append(change)
            touched[self.gpus[s.gpu_uuid].node] = None
        for node in touched:
            self._refresh(node)
        return changes

    def _finish_drain(self, uuid: str) -> ModeChange | None:
        gpu = self.gpus.get(uuid)
        if gpu is None or gpu.mode is not GpuMode.DRAINING or gpu.target_mode is None:
            return None
        if self.usage[uuid].leases:
            return None
        self.gpus[uuid] = replace(gpu, mode=gpu.target_mode, target_mode=None)
        self._inventory_version += 1
        return ModeChange(uuid, GpuMode.DRAINING, gpu.target_mode, None)

    # ---- the queue -------------------------------------------------------------------

    def enqueue(self, lease_id: str, request: LeaseRequest, now: float = 0.0) -> QueuedLease:
        entry = QueuedLease(lease_id, request, self.next_seq, enqueued_at=now)
        self.next_seq += 1
        self.queue[lease_id] = entry
        self._queued(entry)
        self._observe(request)
        return entry

    def restore_queued(self, entry: QueuedLease) -> None:
        old = self.queue.get(entry.lease_id)
        if old is not None:
            self._unqueued(old)
        self.queue[entry.lease_id] = entry
        self._queued(entry)
        self.next_seq = max(self.next_seq, entry.seq + 1)

    def _queued(self, entry: QueuedLease) -> None:
        demand = demand_of(entry.request)
        self._demands[entry.lease_id] = demand
        key = self._shape_key(entry.request, demand)
        self._shape_keys[entry.lease_id] = key
        self._shape_counts[key] = self._shape_counts.get(key, 0) + 1
        self._ranking.add(entry)

    def _unqueued(self, entry: QueuedLease) -> None:
        demand = self._demands.pop(entry.lease_id, None) or demand_of(entry.request)
        key = self._shape_keys.pop(entry.lease_id, None) or self._shape_key(entry.request, demand)
        left = self._shape_counts.get(key, 0) - 1
        if left > 0:
            self._shape_counts[key] = left
        else:
            self._shape_counts.pop(key, None)
        self._ranking.remove(entry)

    def _shape_key(self, request: LeaseRequest, demand: Demand) -> tuple[object, ...]:
        delay = self.queue_policy.max_head_delay_s
        bold = (
            delay > 0
            and request.expected_duration_s is not None
            and request.expected_duration_s <= delay
        )
        return (demand, request.node, request.span_nodes, bold)

    def _observe(self, request: LeaseRequest) -> None:
        if self.learn_workload:
            self._learner.observe(demand_of(request), self.workload)

    def ordered_queue(self, now: float | None = None) -> list[QueuedLease]:
        """The queue in grant order: priority, then (with fair share) tenant share, then age."""
        self._rank(now)
        return [self.queue[lid] for lid in self._ranking.ids()]

    def _rank(self, now: float | None) -> None:
        self._ranking.refresh(
            self.queue, self.queue_policy, self.tenant_usage, self.quotas, self.capacity(), now
        )

    def position(self, lease_id: str) -> int | None:
        self._rank(None)
        return self._ranking.position(lease_id)

    def try_grant(self, lease_id: str, request: LeaseRequest) -> tuple[Slice, ...] | str:
        """Grant now if it fits and the quota allows; else return why it waits."""
        self._observe(request)
        placement = self._placement_or_why(lease_id, request)
        if isinstance(placement, str):
            return placement
        self.grant(lease_id, request.tenant, placement.slices, request.priority, placement.host)
        return placement.slices

    def serve_queue(self, now: float | None = None) -> list[Grant]:
        """Grant queued requests in order, backfilling around the blocked heads.

        The first blocked request of each kind (virtual, physical), up to
        `queue_policy.reservations` of them, keeps the room it needs on the GPUs closest
        to fitting it; later requests are granted only where they leave that room alone,
        so a stream of small requests cannot starve a large one. A request held back only
        by its own tenant's quota blocks nobody else.
        """
        grants: list[Grant] = []
        held: dict[str, tuple[int, int]] = {}
        heads = {False: 0, True: 0}
        failed: set[tuple[object, ...]] = set()
        # Per kind of constraint, failed demands that no other failed demand is below.
        smallest: dict[tuple[object, ...], list[Demand]] = {}
        policy = self.queue_policy
        self._rank(now)
        counts = self._shape_counts
        keys = self._shape_keys
        for lease_id in self._ranking.ids():
            key = keys.get(lease_id)
            if key in failed:
                if len(failed) >= len(counts) and failed.issuperset(counts):
                    break  # every kind of request still queued was tried and does not fit
                continue
            entry = self.queue[lease_id]
            req = entry.request
            demand = self._demands.get(lease_id) or demand_of(req)
            if key is None:
                key = self._shape_key(req, demand)
            placement = None
            if self._within_quota(req, demand) is not demand:
                # Its tenant's quota shapes where it fits: no other request is judged by it.
                placement = self.plan(req, None if key[3] else held, demand)
                if placement is None:
                    continue
            kind = (key[1:], demand.physical, demand.models, demand.memory_mib is None)
            below = smallest.get(kind, ())
            if placement is None and not any(_at_least(demand, small) for small in below):
                placement = self.plan(req, None if key[3] else held, demand)
            if placement is None:
                failed.add(key)
                kept = [d for d in below if not _at_least(d, demand)] + [demand]
                smallest[kind] = kept[-16:]
                if heads[req.physical] < policy.reservations:
                    heads[req.physical] += 1
                    for uuid, compute, memory in self._reserve(entry, held):
                        was = held.get(uuid, (0, 0))
                        held[uuid] = (was[0] + compute, was[1] + memory)
                continue
            if self.quota_blocks(entry.lease_id, req, placement.slices) is not None:
                continue
            self.grant(entry.lease_id, req.tenant, placement.slices, req.priority, placement.host)
            del self.queue[entry.lease_id]
            self._unqueued(entry)
            self._reserved.pop(entry.lease_id, None)
            grants.append(Grant(entry.lease_id, placement.slices))
        return grants

    def _reserve(
        self, entry: QueuedLease, held: Mapping[str, tuple[int, int]]
    ) -> tuple[tuple[str, int, int], ...]:
        """Room for a blocked head: kept while it still suits the request, else chosen anew."""
        kept = self._reserved.get(entry.lease_id)
        if kept is not None and all(
            u in self.gpus and self.gpus[u].takes_new_leases() for u, _c, _m in kept
        ):
            return kept
        victims = self.preempted_for(entry.lease_id)
        room = reserve_room(self, entry.request, held, prefer_leases=victims)
        self._reserved[entry.lease_id] = room
        return room

    def why_waiting(self, lease_id: str) -> str:
        entry = self.queue.get(lease_id)
        if entry is None:
            return ""
        victims = self.preempted_for(lease_id)
        if victims:
            return (
                f"waiting for {len(victims)} lower-priority lease(s) it preempted to end: "
                + ", ".join(sorted(victims))
            )
        self._rank(None)
        kind = entry.request.physical
        same_kind = (
            lid
            for _key, lid in self._ranking.ranked
            if lid in self.queue and self.queue[lid].request.physical == kind
        )
        first = next(same_kind, lease_id) == lease_id
        placement = self._placement_or_why(lease_id, entry.request)
        if isinstance(placement, str):
            if not first and placement.startswith("tenant quota"):
                return "tenant quota"
            return placement
        if not first:
            return "behind earlier requests of the same kind"
        return "about to be granted"

    def overdue(self, now: float) -> list[tuple[str, str]]:
        """Queued requests past their maximum wait, with the reason to tell their holders."""
        return [
            (
                entry.lease_id,
                f"waited {now - entry.enqueued_at:.0f} s (limit {limit:g} s); "
                f"{self.why_waiting(entry.lease_id)}",
            )
            for entry, limit in overdue(self.queue.values(), self.queue_policy, now)
        ]

    # ---- preemption ------------------------------------------------------------------

    def preempted_for(self, lease_id: str) -> set[str]:
        return {victim for victim, by in self.preempting.items() if by == lease_id}

    def withdraw_preemptions(self) -> dict[str, str]:
        """Stop preempting for requests that no longer wait (released, expired, or granted
        before their victims were gone): returns victim → the request it was preempted for.

        The victims keep their leases; they are no longer counted as on their way out.
        """
        gone = withdrawn(self.preempting, self.queue.keys())
        for victim in gone:
            del self.preempting[victim]
        return gone

    def plan_preemptions(
        self, now: float | None = None, max_candidates: int = 16
    ) -> list[Preemption]:
        """For blocked queued requests, in order, the cheapest sets of lower-priority leases
        whose end makes them fit; marks those leases as being preempted."""
        out: list[Preemption] = []
        lowest = min(
            (p for lid, p in self.priorities.items() if lid not in self.preempting), default=None
        )
        looked = 0
        for entry in self.ordered_queue(now):
            if lowest is None or looked >= max_candidates:
                break
            if entry.request.priority <= lowest or self.preempted_for(entry.lease_id):
                continue
            looked += 1
            if self.plan(entry.request) is not None:
                continue
            found = plan_preemption(self, entry.lease_id, entry.request)
            if found is None:
                continue
            for victim in found.victims:
                self.preempting[victim] = entry.lease_id
            self._reserved[entry.lease_id] = found.room
            out.append(found)
        return out

    # ---- modes -----------------------------------------------------------------------

    def set_mode(self, uuid: str, target: GpuMode) -> ModeChange:
        """Switch between the virtual and physical pools, through `draining` while in use."""
        if target not in (GpuMode.VIRTUAL, GpuMode.PHYSICAL):
            raise InvalidRequest(f"a GPU's mode can be set to virtual or physical, not {target}")
        gpu = self.gpu(uuid)
        old = gpu.mode
        if gpu.mode is GpuMode.ISOLATED:
            raise Conflict(f"GPU {uuid} is isolated: clear it before switching its mode")
        busy = bool(self.usage[uuid].leases)
        if gpu.mode is target:
            new = replace(gpu, target_mode=None)
        elif busy:
            new = replace(gpu, mode=GpuMode.DRAINING, target_mode=target)
            if gpu.mode is GpuMode.DRAINING and self._holds_only(
                uuid, physical=target is GpuMode.PHYSICAL
            ):
                # Cancelling a drain: the leases it holds already belong to the target pool.
                new = replace(gpu, mode=target, target_mode=None)
        else:
            new = replace(gpu, mode=target, target_mode=None)
        self.gpus[uuid] = new
        self._inventory_version += 1
        self._refresh(new.node)
        return ModeChange(uuid, old, new.mode, new.target_mode)

    def _holds_only(self, uuid: str, physical: bool) -> bool:
        leases = self.usage[uuid].leases
        return all(
            any(s.whole == physical for s in self.holdings.get(lid, ()) if s.gpu_uuid == uuid)
            for lid in leases
        )

    def drain(self, uuid: str) -> ModeChange:
        """Stop new leases on a GPU and keep it drained until an operator switches it."""
        gpu = self.gpu(uuid)
        if gpu.mode is GpuMode.ISOLATED:
            raise Conflict(f"GPU {uuid} is isolated: clear it before draining it")
        new = replace(gpu, mode=GpuMode.DRAINING, target_mode=None)
        self.gpus[uuid] = new
        self._inventory_version += 1
        self._refresh(new.node)
        return ModeChange(uuid, gpu.mode, new.mode, None)

    def isolate(self, uuid: str) -> ModeChange:
        gpu = self.gpu(uuid)
        if gpu.mode is GpuMode.ISOLATED:
            return ModeChange(uuid, gpu.mode, gpu.mode, gpu.target_mode)
        back = gpu.target_mode if gpu.mode is GpuMode.DRAINING else gpu.mode
        new = replace(gpu, mode=GpuMode.ISOLATED, target_mode=back or GpuMode.VIRTUAL)
        self.gpus[uuid] = new
        self._inventory_version += 1
        self._refresh(new.node)
        return ModeChange(uuid, gpu.mode, new.mode, new.target_mode)

    def clear(self, uuid: str) -> ModeChange:
        gpu = self.gpu(uuid)
        if gpu.mode is not GpuMode.ISOLATED:
            raise Conflict(f"GPU {uuid} is not isolated (it is {gpu.mode.value})")
        back = gpu.target_mode or GpuMode.VIRTUAL
        new = replace(gpu, mode=back, target_mode=None, healthy=True)
        if not self._holds_only(uuid, physical=back is GpuMode.PHYSICAL):
            # Isolated mid-drain: its leases belong to the other pool, so the drain goes on.
            new = replace(new, mode=GpuMode.DRAINING, target_mode=back)
        self.gpus[uuid] = new
        self._inventory_version += 1
        self._refresh(new.node)
        return ModeChange(uuid, gpu.mode, new.mode, new.target_mode)

    def leases_on(self, uuids: Iterable[str]) -> set[str]:
        out: set[str] = set()
        for uuid in uuids:
            out |= self.usage.get(uuid, GpuUsage()).leases
        return out


def _at_least(big: Demand, little: Demand) -> bool:
    """A request at least as large as one that did not fit, with the same constraints,
    does not fit either (capacity only shrinks during a pass)."""
    return (
        big.gpus >= little.gpus
        and big.compute_pct >= little.compute_pct
        and (big.memory_mib or 0) >= (little.memory_mib or 0)
        and big.cpu_milli >= little.cpu_milli
        and big.host_memory_mib >= little.host_memory_mib
    )
