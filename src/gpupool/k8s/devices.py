"""What the device plugin tells the kubelet: devices per resource, preferences, container env.

Pure functions of the agent's view of its GPUs (their modes come from the controller's
heartbeat reply) and of the claim the controller hands out; no I/O, so tests need no kubelet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpupool.k8s.devicenodes import DeviceNodes
from gpupool.k8s.resources import ALLOCATED_CLAIM_ENV, LEASE_ENV, ResourceKind
from gpupool.protocol.v1.k8s import ClaimOut

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_DEVICE_ID = 63
"""The kubelet's limit on a device id's length."""
SLOT_SEPARATOR = "-slot"
MPS_PIPE_IN_CONTAINER = "/run/gpupool/mps/pipe"
MPS_LOG_IN_CONTAINER = "/run/gpupool/mps/log"
DEVICE_PERMISSIONS = "rw"
"""Read and write, no mknod: what a CUDA process needs of its device nodes."""
CDI_KIND = "nvidia.com/gpu"
"""The kind of the NVIDIA Container Toolkit's CDI specs (`nvidia-ctk cdi generate`)."""


class AllocationRefused(Exception):
    """The container cannot be given the claim's GPUs; the kubelet fails its admission."""


@dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU as the agent knows it: the controller's mode for it and its MPS daemon."""

    uuid: str
    index: int
    mode: str
    target_mode: str | None = None
    mps_pipe_dir: str | None = None


@dataclass(frozen=True, slots=True)
class CdiNaming:
    """How the node's CDI spec names its GPUs: `<kind>=<uuid>` or `<kind>=<index>` (the
    toolkit's `--device-name-strategy uuid` or `index`)."""

    strategy: str = "uuid"
    kind: str = CDI_KIND

    def __post_init__(self) -> None:
        if self.strategy not in ("uuid", "index"):
            raise ValueError(f"CDI device names are by uuid or index, not {self.strategy!r}")
        vendor, sep, klass = self.kind.partition("/")
        if not (sep and "." in vendor and klass and "=" not in self.kind):
            raise ValueError(f"a CDI kind is vendor.tld/class, got {self.kind!r}")

    def name(self, gpu: GpuView) -> str:
        return f"{self.kind}={gpu.uuid if self.strategy == 'uuid' else gpu.index}"


@dataclass(frozen=True, slots=True)
class NodeView:
    gpus: tuple[GpuView, ...] = ()
    simulated: bool = False
    mps_shm_dir: str | None = None
    """Host directory that is /dev/shm of the agent's MPS daemons: MPS clients share it."""
    device_nodes: DeviceNodes | None = None
    """Given: Allocate names the GPUs' device nodes (None: the runtime's hook makes them)."""
    cdi: CdiNaming | None = None
    """Given: Allocate names the GPUs as CDI devices (kubelets of 1.28 on read them)."""


@dataclass(frozen=True, slots=True)
class Device:
    id: str
    gpu_uuid: str
    health: str


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    envs: dict[str, str]
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)
    """(container path, host path, read only)."""
    devices: list[tuple[str, str, str]] = field(default_factory=list)
    """(container path, host path, permissions) of device nodes."""
    cdi_devices: list[str] = field(default_factory=list)
    """Fully qualified CDI device names (vendor.tld/class=name)."""


def slot_id(gpu_uuid: str, slot: int) -> str:
    return f"{gpu_uuid}{SLOT_SEPARATOR}{slot}"


def gpu_of(device_id: str) -> str:
    """The GPU a device id stands for (a whole GPU's id is its UUID)."""
    head, sep, tail = device_id.rpartition(SLOT_SEPARATOR)
    return head if sep and tail.isdigit() else device_id


def devices(kind: ResourceKind, view: NodeView, slots_per_gpu: int) -> list[Device]:
    """The device list of one resource.

    `vgpu`: `slots_per_gpu` devices per virtual GPU, so that several pods can share one (the
    controller, not the count, decides whether a slice fits). `gpu`: one device per physical
    GPU. A GPU draining towards the other pool stays listed where it was, unhealthy, so the
    kubelet places nothing new on it while its pods run on; an isolated GPU is unhealthy in
    both lists.
    """
    out: list[Device] = []
    for gpu in sorted(view.gpus, key=lambda g: g.index):
        health = _health(kind, gpu)
        if health is None:
            continue
        if kind == "gpu":
            out.append(Device(_checked(gpu.uuid), gpu.uuid, health))
        else:
            out.extend(
                Device(_checked(slot_id(gpu.uuid, k)), gpu.uuid, health)
                for k in range(slots_per_gpu)
            )
    return out


def _health(kind: ResourceKind, gpu: GpuView) -> str | None:
    """Healthy or Unhealthy in this resource's list, or None when the GPU is not in it."""
    own = "physical" if kind == "gpu" else "virtual"
    other = "virtual" if kind == "gpu" else "physical"
    if gpu.mode == own:
        return HEALTHY
    if gpu.mode == "isolated":
        return UNHEALTHY
    if gpu.mode == "draining" and gpu.target_mode == other:
        return UNHEALTHY  # it was in this pool and is leaving it
    return None


def _checked(device_id: str) -> str:
    if len(device_id) > MAX_DEVICE_ID:
        raise ValueError(f"device id {device_id!r} is longer than {MAX_DEVICE_ID} characters")
    return device_id


def preferred(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    claim_gpus: Sequence[str],
) -> list[str]:
    """Devices on the claim's GPUs first (the pool's placement), then the kubelet's order.

    The kubelet's choice of device ids only books its own count; the GPUs the container
    really gets are the claim's. Steering the ids to the same GPUs keeps both books equal.
    """
    chosen = list(dict.fromkeys(must_include))[:size]
    for gpu in claim_gpus:
        if len(chosen) >= size:
            break
        pick = next((d for d in available if gpu_of(d) == gpu and d not in chosen), None)
        if pick is not None:
            chosen.append(pick)
    for device in available:
        if len(chosen) >= size:
            break
        if device not in chosen:
            chosen.append(device)
    return chosen


def allocation(claim: ClaimOut, view: NodeView, device_ids: Iterable[str]) -> ContainerAllocation:
    """The env and mounts that give a container its claim's lease, and only that lease."""
    lease = claim.lease
    gpus = {g.uuid: g for g in view.gpus}
    uuids = [s.gpu_uuid for s in lease.slices]
    unknown = [u for u in uuids if u not in gpus]
    if unknown:
        raise AllocationRefused(
            f"claim {claim.claim}: lease {lease.id} holds GPUs this node does not have: "
            + ", ".join(unknown)
        )
    ids = list(device_ids)
    envs = {
        ALLOCATED_CLAIM_ENV: claim.claim,
        LEASE_ENV: lease.id,
        "GPUPOOL_LEASE_ID": lease.id,
        "CUDA_VISIBLE_DEVICES": ",".join(uuids),
        # The NVIDIA container runtime exposes exactly these GPUs (device nodes, driver).
        "NVIDIA_VISIBLE_DEVICES": ",".join(uuids),
        "GPUPOOL_DEVICE_IDS": ",".join(ids),
    }
    mounts: list[tuple[str, str, bool]] = []
    if view.simulated:
        envs["GPUPOOL_SIMULATED"] = "1"
    if not lease.physical:
        if len(lease.slices) != 1:
            raise AllocationRefused(
                f"claim {claim.claim}: a direct slice spans one GPU (one MPS daemon per GPU), "
                f"lease {lease.id} has {len(lease.slices)}"
            )
        piece = lease.slices[0]
        envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(piece.compute_pct)
        envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={piece.memory_mib}M"
        pipe = gpus[piece.gpu_uuid].mps_pipe_dir
        if pipe is not None:
            envs["CUDA_MPS_PIPE_DIRECTORY"] = MPS_PIPE_IN_CONTAINER
            envs["CUDA_MPS_LOG_DIRECTORY"] = MPS_LOG_IN_CONTAINER
            mounts.append((MPS_PIPE_IN_CONTAINER, pipe, False))
            mounts.append((MPS_LOG_IN_CONTAINER, _log_dir(pipe), False))
            if view.mps_shm_dir is not None:
                mounts.append(("/dev/shm", view.mps_shm_dir, False))
        elif not view.simulated:
            raise AllocationRefused(
                f"claim {claim.claim}: GPU {piece.gpu_uuid} runs no MPS daemon, so the slice's "
                "compute share and memory limit could not be enforced"
            )
    return ContainerAllocation(
        envs=envs,
        mounts=mounts,
        devices=_device_specs(claim, view, [gpus[u] for u in uuids]),
        cdi_devices=[view.cdi.name(gpus[u]) for u in uuids] if view.cdi is not None else [],
    )


def _device_specs(
    claim: ClaimOut, view: NodeView, gpus: list[GpuView]
) -> list[tuple[str, str, str]]:
    """The lease's GPUs' nodes and the control nodes, each at its host path; only those."""
    nodes = view.device_nodes
    if nodes is None:
        return []
    specs = [(path, path, DEVICE_PERMISSIONS) for path in nodes.control]
    for gpu in gpus:
        path = nodes.gpu_node(gpu.uuid)
        if path is None:
            raise AllocationRefused(
                f"claim {claim.claim}: no device node of GPU {gpu.uuid} was found on this "
                "node (/proc/driver/nvidia/gpus), so the container could not reach it"
            )
        specs.append((path, path, DEVICE_PERMISSIONS))
    return specs


def _log_dir(pipe_dir: str) -> str:
    head, _, _ = pipe_dir.rstrip("/").rpartition("/")
    return f"{head}/log" if head else "log"
