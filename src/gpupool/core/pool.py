"""The pool's state and its pure operations: place, grant, release, serve the queue, switch modes.

Everything here is deterministic and does no I/O; the controller persists what these
functions decide, and the simulator replays traces through the very same code.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from gpupool.core.errors import Conflict, InvalidRequest, NoCapacity, NotFound, QuotaExceeded
from gpupool.core.model import (
    Gpu,
    GpuMode,
    GpuUsage,
    LeaseRequest,
    QueuedLease,
    Quota,
    Ratios,
    Slice,
    Usage,
    quota_violation,
    usage_of,
)


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
    """All GPUs, who holds what, and the queue. Mutated only through its methods."""

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

    # ---- inventory -------------------------------------------------------------------

    def upsert_gpu(self, gpu: Gpu) -> None:
        self.gpus[gpu.uuid] = gpu
        self.usage.setdefault(gpu.uuid, GpuUsage())

    def remove_gpu(self, uuid: str) -> None:
        if self.usage.get(uuid, GpuUsage()).leases:
            raise Conflict(f"GPU {uuid} still holds leases")
        self.gpus.pop(uuid, None)
        self.usage.pop(uuid, None)

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

    # ---- capacity --------------------------------------------------------------------

    def free_on(self, gpu: Gpu) -> tuple[int, int]:
        """Compute % and memory MiB still grantable on a virtual GPU, with oversubscription."""
        used = self.usage[gpu.uuid]
        compute = int(100 * self.ratios.compute) - used.compute_pct
        memory = int(gpu.memory_mib * self.ratios.memory) - used.memory_mib
        return compute, memory

    def _eligible(self, gpu: Gpu, request: LeaseRequest) -> bool:
        if not gpu.takes_new_leases() or gpu.node not in self.nodes_up:
            return False
        if request.node is not None and gpu.node != request.node:
            return False
        if not request.model_allowed(gpu.model):
            return False
        used = self.usage[gpu.uuid]
        if request.physical:
            return gpu.mode is GpuMode.PHYSICAL and not used.leases
        if gpu.mode is not GpuMode.VIRTUAL:
            return False
        compute, memory = self.free_on(gpu)
        return compute >= request.compute_pct and memory >= request.slice_memory_mib(gpu)

    def _fit_score(self, gpu: Gpu, request: LeaseRequest) -> tuple[float, int, str]:
        """Best fit: the GPU left with the least room after placing goes first (packing)."""
        if request.physical:
            return (0.0, gpu.index, gpu.uuid)
        compute, memory = self.free_on(gpu)
        left_compute = (compute - request.compute_pct) / 100
        left_memory = (memory - request.slice_memory_mib(gpu)) / max(gpu.memory_mib, 1)
        return (left_compute + left_memory, gpu.index, gpu.uuid)

    def place(self, request: LeaseRequest) -> tuple[Slice, ...]:
        """Choose GPUs for `request` now, all or nothing, or raise NoCapacity."""
        candidates = [g for g in self.gpus.values() if self._eligible(g, request)]
        if len(candidates) < request.gpus:
            raise NoCapacity(self._shortage(request, len(candidates)))
        by_node: dict[str, list[Gpu]] = {}
        for gpu in candidates:
            by_node.setdefault(gpu.node, []).append(gpu)
        for gpus in by_node.values():
            gpus.sort(key=lambda g: self._fit_score(g, request))
        # Gang locality: one server is better than several; among servers that fit, the tightest.
        fitting = [(node, gpus) for node, gpus in by_node.items() if len(gpus) >= request.gpus]
        if fitting:
            _node, gpus = min(
                fitting,
                key=lambda item: (
                    sum(self._fit_score(g, request)[0] for g in item[1][: request.gpus]),
                    item[0],
                ),
            )
            chosen = gpus[: request.gpus]
        elif request.span_nodes:
            ordered = sorted(by_node.items(), key=lambda item: (-len(item[1]), item[0]))
            chosen = [g for _, gpus in ordered for g in gpus][: request.gpus]
        else:
            raise NoCapacity(f"no single server has {request.gpus} free GPUs for this request")
        return tuple(
            Slice(
                gpu_uuid=g.uuid,
                compute_pct=100 if request.physical else request.compute_pct,
                memory_mib=request.slice_memory_mib(g),
                whole=request.physical,
            )
            for g in chosen
        )

    def _shortage(self, request: LeaseRequest, found: int) -> str:
        kind = "free physical GPUs" if request.physical else "virtual GPUs with room"
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
            cap = self.ratios.memory
            fit = [g for g in gpus if request.slice_memory_mib(g) <= int(g.memory_mib * cap)]
        if len(fit) < request.gpus:
            where = f" on node {request.node}" if request.node else ""
            models = f" of model {'|'.join(request.gpu_models)}" if request.gpu_models else ""
            size = "" if request.physical else f" with {request.memory_mib or 'proportional'}MiB"
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

    # ---- quotas ----------------------------------------------------------------------

    def held_by(self, tenant: str) -> Usage:
        return self.tenant_usage.get(tenant, Usage())

    def check_quota_ever(self, request: LeaseRequest) -> None:
        """Refuse a request that breaks its tenant's quota even when the tenant holds nothing."""
        quota = self.quotas.get(request.tenant)
        if quota is None:
            raise NotFound(f"no tenant {request.tenant!r}")
        if quota.max_priority is not None and request.priority > quota.max_priority:
            raise QuotaExceeded(
                f"priority {request.priority} is above tenant {request.tenant}'s "
                f"highest allowed priority {quota.max_priority}"
            )
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

    def grant(self, lease_id: str, tenant: str, slices: tuple[Slice, ...]) -> None:
        if lease_id in self.holdings:
            raise Conflict(f"lease {lease_id} already holds GPUs")
        for s in slices:
            gpu = self.gpu(s.gpu_uuid)
            used = self.usage[gpu.uuid]
            if s.whole and used.leases:
                raise NoCapacity(f"GPU {gpu.uuid} is not free for a whole-GPU lease")
            if used.whole:
                raise NoCapacity(f"GPU {gpu.uuid} is held whole")
        for s in slices:
            used = self.usage[s.gpu_uuid]
            used.compute_pct += s.compute_pct
            used.memory_mib += s.memory_mib
            used.leases.add(lease_id)
            used.whole = used.whole or s.whole
        self.holdings[lease_id] = slices
        self.owners[lease_id] = tenant
        self.tenant_usage.setdefault(tenant, Usage()).add(usage_of(slices))

    def release(self, lease_id: str) -> list[ModeChange]:
        """Return a lease's capacity exactly; draining GPUs that become empty switch mode."""
        self.queue.pop(lease_id, None)
        slices = self.holdings.pop(lease_id, None)
        tenant = self.owners.pop(lease_id, None)
        if slices is None:
            return []
        if tenant is not None:
            self.tenant_usage.setdefault(tenant, Usage()).add(usage_of(slices), sign=-1)
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
        return changes

    def _finish_drain(self, uuid: str) -> ModeChange | None:
        gpu = self.gpus.get(uuid)
        if gpu is None or gpu.mode is not GpuMode.DRAINING or gpu.target_mode is None:
            return None
        if self.usage[uuid].leases:
            return None
        self.gpus[uuid] = replace(gpu, mode=gpu.target_mode, target_mode=None)
        return ModeChange(uuid, GpuMode.DRAINING, gpu.target_mode, None)

    # ---- the queue -------------------------------------------------------------------

    def enqueue(self, lease_id: str, request: LeaseRequest) -> QueuedLease:
        entry = QueuedLease(lease_id, request, self.next_seq)
        self.next_seq += 1
        self.queue[lease_id] = entry
        return entry

    def restore_queued(self, entry: QueuedLease) -> None:
        self.queue[entry.lease_id] = entry
        self.next_seq = max(self.next_seq, entry.seq + 1)

    def ordered_queue(self) -> list[QueuedLease]:
        """Higher priority first, then first come, first served."""
        return sorted(self.queue.values(), key=lambda q: (-q.request.priority, q.seq))

    def position(self, lease_id: str) -> int | None:
        for i, entry in enumerate(self.ordered_queue(), start=1):
            if entry.lease_id == lease_id:
                return i
        return None

    def try_grant(self, lease_id: str, request: LeaseRequest) -> tuple[Slice, ...] | str:
        """Grant now if it fits and the quota allows; else return why it waits."""
        try:
            slices = self.place(request)
        except NoCapacity as exc:
            return exc.message
        problem = self.quota_blocks(lease_id, request, slices)
        if problem is not None:
            return f"tenant quota: {problem}"
        self.grant(lease_id, request.tenant, slices)
        return slices

    def serve_queue(self) -> list[Grant]:
        """Grant queued requests in order.

        A request that does not fit blocks later requests of its own kind (physical or
        virtual), so a stream of small requests cannot starve a large one; a request
        held back only by its own tenant's quota blocks nobody else.
        """
        grants: list[Grant] = []
        blocked_kinds: set[bool] = set()
        for entry in self.ordered_queue():
            req = entry.request
            if req.physical in blocked_kinds:
                continue
            try:
                slices = self.place(req)
            except NoCapacity:
                blocked_kinds.add(req.physical)
                if len(blocked_kinds) == 2:
                    break
                continue
            if self.quota_blocks(entry.lease_id, req, slices) is not None:
                continue
            self.grant(entry.lease_id, req.tenant, slices)
            del self.queue[entry.lease_id]
            grants.append(Grant(entry.lease_id, slices))
        return grants

    def why_waiting(self, lease_id: str) -> str:
        entry = self.queue.get(lease_id)
        if entry is None:
            return ""
        ahead = [q for q in self.ordered_queue() if q.request.physical == entry.request.physical]
        if ahead and ahead[0].lease_id != lease_id:
            try:
                slices = self.place(entry.request)
            except NoCapacity as exc:
                return exc.message
            if self.quota_blocks(lease_id, entry.request, slices) is not None:
                return "tenant quota"
            return "behind earlier requests of the same kind"
        try:
            slices = self.place(entry.request)
        except NoCapacity as exc:
            return exc.message
        problem = self.quota_blocks(lease_id, entry.request, slices)
        return f"tenant quota: {problem}" if problem else "about to be granted"

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
        return ModeChange(uuid, gpu.mode, new.mode, None)

    def isolate(self, uuid: str) -> ModeChange:
        gpu = self.gpu(uuid)
        if gpu.mode is GpuMode.ISOLATED:
            return ModeChange(uuid, gpu.mode, gpu.mode, gpu.target_mode)
        back = gpu.target_mode if gpu.mode is GpuMode.DRAINING else gpu.mode
        new = replace(gpu, mode=GpuMode.ISOLATED, target_mode=back or GpuMode.VIRTUAL)
        self.gpus[uuid] = new
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
        return ModeChange(uuid, gpu.mode, new.mode, new.target_mode)

    def leases_on(self, uuids: Iterable[str]) -> set[str]:
        out: set[str] = set()
        for uuid in uuids:
            out |= self.usage.get(uuid, GpuUsage()).leases
        return out
