"""Bodies of the REST API `/api/v1`, shared by the controller, the agent, the CLI and the SDK."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpupool.core.units import parse_compute_pct, parse_cpu_milli, parse_memory_mib

Mode = Literal["virtual", "physical", "draining", "isolated"]
LeaseStateName = Literal[
    "queued", "granted", "active", "idle", "swapped", "migrating", "preempted", "released"
]


INT32_MAX = 2**31 - 1
"""The largest number an integer column holds (PostgreSQL's INTEGER): bigger ones are refused
with a 422 here rather than failing the database write they would be part of."""
JSON_INT_MAX = 2**53
"""Integers inside free-form JSON (telemetry, host facts) stay exact in JavaScript and doubles."""

Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]


def check_storable(value: object, where: str = "") -> None:
    """Refuse what a database cannot store, before it reaches a write.

    A request is written in one transaction with the requests that arrived with it, so a
    value the database rejects at commit would fail its neighbours too: NUL characters
    (PostgreSQL text cannot hold them), lone surrogates (not UTF-8; JSON's `\\udXXX` escapes
    can make them), NaN and infinities (not JSON) and integers no column or JSON reader holds.
    """
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{where or 'text'} must not contain NUL characters")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where or 'text'} is not valid Unicode text") from None
    elif isinstance(value, bool):
        return
    elif isinstance(value, int):
        if abs(value) > JSON_INT_MAX:
            raise ValueError(f"{where or 'number'} is too large: {value}")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where or 'number'} must be a finite number, got {value}")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_storable(key, where)
            check_storable(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list | tuple):
        for item in value:
            check_storable(item, where)
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            check_storable(getattr(value, name), f"{where}.{name}" if where else name)


class Strict(BaseModel):
    """Unknown fields are errors: a typo in a request must not silently do something else.

    Every field of a request is also checked to be storable (`check_storable`), so a hostile
    body gets a 422 naming the field instead of failing the transaction it would share.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _storable(cls, value: object) -> object:
        check_storable(value)
        return value


# ---- nodes and GPUs ---------------------------------------------------------------------


class GpuInventory(Strict):
    uuid: Annotated[str, Field(min_length=1, max_length=128)]
    index: Int32 = 0
    model: Annotated[str, Field(min_length=1, max_length=128)]
    memory_mib: Annotated[int, Field(gt=0, le=INT32_MAX)]
    pci_bus_id: Annotated[str, Field(max_length=32)] | None = None
    mig_mode: bool | None = None
    simulated: bool = False


class GpuTelemetry(Strict):
    uuid: Annotated[str, Field(max_length=128)]
    utilization_pct: float | None = None
    memory_used_mib: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_uncorrected: int | None = None
    ecc_corrected: int | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    processes: list[dict[str, Any]] = Field(default_factory=list)
    mps_pipe_dir: str | None = None
    direct_socket: Annotated[str, Field(max_length=512)] | None = None
    """The agent's Unix socket where `gpupool run` attaches a direct lease's processes, so
    the agent's watch knows them (see gpupool.protocol.v1.attach); None: no watch."""
    """Where the GPU's MPS control daemon listens; None when the GPU runs without MPS."""
    xid_errors: int | None = None
    """Xid errors the agent has seen on the GPU since it started."""
    xid_last: int | None = None


class NodeRegister(Strict):
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
    """The node's name: an agent token registers the node it was made for, and no other."""
    address: Annotated[str, Field(max_length=256)] | None = None
    agent_url: Annotated[str, Field(max_length=512)] | None = None
    cpu_count: Int32 | None = None
    memory_mib: Int32 | None = None
    driver_version: Annotated[str, Field(max_length=64)] | None = None
    cuda_version: Annotated[str, Field(max_length=64)] | None = None
    backend: Annotated[str, Field(max_length=32)] = "fake"
    gpus: Annotated[list[GpuInventory], Field(max_length=1024)] = Field(default_factory=list)


class NodeHeartbeat(Strict):
    telemetry: list[GpuTelemetry] = Field(default_factory=list)
    host: dict[str, Any] = Field(default_factory=dict)
    gpus: list[GpuInventory] | None = None
    workers: list[WorkerReport] = Field(default_factory=list)


class GpuDesired(BaseModel):
    """What the controller wants of one GPU, told to its agent in each heartbeat reply."""

    mode: Mode
    target_mode: Mode | None
    leases: list[str]


class RemoteSlice(BaseModel):
    gpu_uuid: str
    gpu_index: int
    compute_pct: int
    memory_mib: int
    generation: int = 0
    """Which worker of the lease this is: a migration or a restore starts generation n+1 on
    the destination (maybe the same GPU) while generation n still holds the state."""
    restore_from: str | None = None
    """The endpoint of the worker whose state this one takes over before serving."""
    room_denied_seq: int | None = None
    """The worker's request for room (memory oversubscription) with this number found nobody
    to give way: the allocation that waits for it fails now."""


class RemoteLease(BaseModel):
    """A remote lease with slices on the agent's node: the agent runs one worker per slice."""

    token: str
    """The lease's client token: the worker admits its holder with it, as a client only."""
    slices: list[RemoteSlice]
    peer_secret: str | None = None
    """The lease's worker secret, for the agents that host the lease only: its workers accept
    peer copies and successors with it (None: they accept neither)."""
    peers: list[str | None] = Field(default_factory=list)
    """Where the lease's workers listen, by device: the only addresses its workers send to."""
    host_memory_mib: int = 0
    """The lease's host memory allowance: part of each worker's cgroup memory limit."""
    idle_timeout_s: float | None = None
    """Ask the client to swap out after this long without ops (None: never)."""
    swap_reason: str | None = None
    """Swap the client out now ("oversubscription": another session of the GPU needs the
    memory); None: only when idle."""


class WorkerReport(BaseModel):
    """One worker as its agent sees it, sent with each heartbeat."""

    lease_id: Annotated[str, Field(max_length=32)]
    gpu_uuid: Annotated[str, Field(max_length=128)]
    endpoint: Annotated[str, Field(max_length=256)] | None = None
    alive: bool = True
    last_op_at: float | None = None
    memory_mib: int | None = None
    error: Annotated[str, Field(max_length=1024)] | None = None
    generation: int = 0
    swapped: bool = False
    """The client's tensors are in host memory: the slice may go back to the pool."""
    wants_gpu: bool = False
    """A swapped client needs its slice again."""
    adopted: bool = False
    """This worker took its predecessor's state over."""
    moved_to: str | None = None
    room_seq: int = 0
    """The number of the worker's last request for room on its GPU."""
    room_wanted_mib: int = 0
    """While an allocation waits for room: how much the GPU lacks (oversubscription); else 0."""


class DirectSlice(BaseModel):
    """One slice of a direct lease on the agent's node: what its processes may use there."""

    gpu_uuid: str
    compute_pct: int
    memory_mib: int
    whole: bool = False
    """A whole GPU (physical lease, or a 100 % slice of all its memory): no memory limit below
    the GPU's own."""


class DirectLease(BaseModel):
    """A direct lease with slices on the agent's node, for the agent's watch of its processes."""

    token_sha256: str | None
    """The SHA-256 (hex) of the lease's token: `gpupool run` proves it holds the lease with the
    token itself; the agent never learns more than the hash. None: the lease has no token (made
    before direct leases had one) and nothing can be attached to it."""
    slices: list[DirectSlice]


class NodeHeartbeatReply(BaseModel):
    ok: bool = True
    resumed: bool = False
    gpus: dict[str, GpuDesired] = Field(default_factory=dict)
    leases: dict[str, RemoteLease] = Field(default_factory=dict)
    direct: dict[str, DirectLease] | None = None
    """The direct leases with slices on this node; None from a controller that does not say
    (the agent then watches nothing rather than stopping every process it cannot place)."""


DirectEventKind = Literal[
    "process_stopped",
    "process_not_stopped",
    "compute_over_share",
    "limits_raised",
    "process_unattributable",
]
"""process_stopped: a process broke its lease's memory or GPUs and was stopped;
process_not_stopped: the same, seen by an agent whose watch only reports; compute_over_share:
a lease's processes use more SM time than its share; limits_raised: a process was started
with MPS or device variables beyond its lease; process_unattributable: a process on a GPU
that the agent cannot see in /proc (another pid namespace) and so can neither place nor stop."""


class DirectEvent(Strict):
    """What the agent's watch of direct slices did or saw, for the controller's event log."""

    kind: DirectEventKind
    reason: Annotated[str, Field(min_length=1, max_length=64)]
    message: Annotated[str, Field(min_length=1, max_length=500)]
    gpu_uuid: Annotated[str, Field(min_length=1, max_length=128)]
    lease_id: Annotated[str, Field(min_length=1, max_length=32)] | None = None
    pid: Annotated[int, Field(ge=0, le=INT32_MAX)]
    command: Annotated[str, Field(max_length=256)] = ""
    used_memory_mib: Int32 | None = None
    limit_memory_mib: Int32 | None = None
    compute_pct: Annotated[float, Field(ge=0, le=100_000)] | None = None
    share_pct: Annotated[int, Field(ge=0, le=100)] | None = None


class DirectEvents(Strict):
    events: Annotated[list[DirectEvent], Field(min_length=1, max_length=256)]


class NodeOut(BaseModel):
    name: str
    address: str | None
    agent_url: str | None
    state: Literal["up", "down"]
    backend: str
    cpu_count: int | None
    memory_mib: int | None
    driver_version: str | None
    cuda_version: str | None
    gpu_count: int
    registered_at: datetime
    last_seen_at: datetime
    host: dict[str, Any] = Field(default_factory=dict)


class GpuOut(BaseModel):
    uuid: str
    node: str
    index: int
    model: str
    memory_mib: int
    mode: Mode
    target_mode: Mode | None
    healthy: bool
    simulated: bool
    pci_bus_id: str | None
    compute_granted_pct: int
    memory_granted_mib: int
    leases: list[str]
    telemetry: dict[str, Any] = Field(default_factory=dict)
    isolation_reason: str | None = None


class GpuModeSet(Strict):
    mode: Literal["virtual", "physical"]


class GpuIsolate(Strict):
    reason: Annotated[str, Field(min_length=1, max_length=500)]
    fault: bool = False
    """True when the agent saw a hardware fault: the GPU's leases end ("its GPU failed")."""


# ---- leases -----------------------------------------------------------------------------


RequestId = Annotated[str, Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]


def compute_pct_input(value: object) -> object:
    """A compute share as sent (`25`, `"25%"`), checked as a whole percent 1..100."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("compute_pct must be an integer percent 1..100")
    return parse_compute_pct(value)


def storable_memory(text: str | None) -> str | None:
    """A memory size as written, once it reads as one and fits an integer column in MiB."""
    if text is not None and parse_memory_mib(text) > INT32_MAX:
        raise ValueError(f"memory {text!r} is more than any pool holds (at most {INT32_MAX} MiB)")
    return text


class LeaseCreate(Strict):
    """A lease request. Memory needs a unit (`20GiB`); compute is a whole percent (1..100)."""

    tenant: Annotated[str, Field(min_length=1, max_length=64)] = "default"
    gpus: Annotated[int, Field(ge=1, le=256)] = 1
    compute_pct: int | None = None
    memory: str | None = None
    physical: bool = False
    priority: Annotated[int, Field(ge=0, le=1000)] = 0
    access: Literal["direct", "remote"] = "direct"
    node: Annotated[str, Field(max_length=128)] | None = None
    gpu_models: Annotated[list[Annotated[str, Field(max_length=128)]], Field(max_length=64)] = (
        Field(default_factory=list)
    )
    span_nodes: bool = True
    cpu: str | None = None
    """CPU of the lease's server a direct lease needs: cores (`4`, `0.5`) or millicores (`500m`)."""
    host_memory: str | None = None
    """Memory of the lease's server a direct lease needs, with a unit (`32GiB`)."""
    holder: Annotated[str, Field(max_length=256)] = ""
    ttl_s: Annotated[float, Field(gt=0, le=86400)] | None = None
    wait: bool = True
    """False: fail with 409 instead of queueing when the request does not fit now."""
    prefer_node: Annotated[str, Field(max_length=128)] | None = None
    """The client's own server: placement tries it first, then any server (locality `any`)."""
    max_wait_s: Annotated[float, Field(gt=0, le=30 * 86400)] | None = None
    """Fail, saying why, instead of waiting longer than this in the queue."""
    request_id: RequestId | None = None
    """The client's key for this request: sending it again (after a failover cut the
    answer off) returns the lease the first send made, never a second lease."""
    idle_timeout_s: Annotated[float, Field(gt=0, le=30 * 86400)] | None = None
    """A remote lease without GPU work this long is swapped to host memory (default: the
    tenant's setting; none: never)."""

    @field_validator("compute_pct", mode="before")
    @classmethod
    def _compute(cls, value: object) -> object:
        return compute_pct_input(value)

    @field_validator("memory")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        return storable_memory(value)

    def memory_mib(self) -> int | None:
        return None if self.memory is None else parse_memory_mib(self.memory)

    @field_validator("cpu")
    @classmethod
    def _cpu(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cpu_milli(value)
        return value

    @field_validator("host_memory")
    @classmethod
    def _host_memory(cls, value: str | None) -> str | None:
        return storable_memory(value)


class SliceOut(BaseModel):
    gpu_uuid: str
    node: str
    gpu_index: int
    compute_pct: int
    memory_mib: int
    whole: bool
    endpoint: str | None = None
    """The worker of a remote slice (tcp://HOST:PORT), once it runs."""


class LeaseOut(BaseModel):
    id: str
    tenant: str
    state: LeaseStateName
    gpus: int
    compute_pct: int | None
    memory_mib: int | None
    physical: bool
    priority: int
    access: str
    holder: str
    ttl_s: float
    created_at: datetime
    granted_at: datetime | None
    released_at: datetime | None
    last_heartbeat_at: datetime
    release_reason: str | None
    slices: list[SliceOut]
    queue_position: int | None = None
    waiting_reason: str | None = None
    token: str | None = None
    """A remote lease's data-plane token: only in the answer to the request that made it."""
    activity: dict[str, Any] = Field(default_factory=dict)
    """A remote lease's GPU activity as its workers report it (last op, memory held)."""
    node: str | None = None
    gpu_models: list[str] = Field(default_factory=list)
    idle_timeout_s: float | None = None
    swap_reason: str | None = None
    """Why a swapped lease was swapped out ("idle", "oversubscription"), or why it is asked
    to swap now."""


class LeaseHeartbeat(Strict):
    active: bool | None = None


class LeaseResize(Strict):
    """A live resize of an active remote lease: each slice gets this compute and memory."""

    compute_pct: int | None = None
    memory: str | None = None

    @field_validator("compute_pct", mode="before")
    @classmethod
    def _compute(cls, value: object) -> object:
        return compute_pct_input(value)

    @field_validator("memory")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        return storable_memory(value)

    def memory_mib(self) -> int | None:
        return None if self.memory is None else parse_memory_mib(self.memory)


class LeaseMigrate(Strict):
    """Move a remote lease while its program runs: to a GPU (uuid), a node, or anywhere else."""

    to: Annotated[str, Field(min_length=1, max_length=128)] | None = None


# ---- tenants ----------------------------------------------------------------------------


class QuotaIn(Strict):
    max_gpus: Int32 | None = None
    max_memory: str | None = None
    max_compute_pct: Int32 | None = None
    max_leases: Int32 | None = None
    max_priority: Annotated[int, Field(ge=0, le=1000)] | None = None
    guaranteed_gpus: Annotated[float, Field(ge=0, le=INT32_MAX)] | None = None
    """GPU-equivalents that preemption never takes from the tenant."""

    @field_validator("max_memory")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        return storable_memory(value)


class TenantCreate(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
    weight: Annotated[float, Field(gt=0, le=1000)] = 1.0
    quota: QuotaIn = Field(default_factory=QuotaIn)
    idle_timeout_s: Annotated[float, Field(gt=0, le=30 * 86400)] | None = None
    """The tenant's remote leases are swapped out after this long without GPU work."""


class TenantUpdate(Strict):
    weight: Annotated[float, Field(gt=0, le=1000)] | None = None
    quota: QuotaIn | None = None
    idle_timeout_s: Annotated[float, Field(gt=0, le=30 * 86400)] | None = None


class TenantOut(BaseModel):
    name: str
    weight: float
    max_gpus: int | None
    max_memory_mib: int | None
    max_compute_pct: int | None
    max_leases: int | None
    max_priority: int | None
    guaranteed_gpus: float = 0.0
    idle_timeout_s: float | None = None
    used_gpus: int
    used_memory_mib: int
    used_compute_pct: int
    used_leases: int
    queued_leases: int


# ---- the rest ---------------------------------------------------------------------------


class EventOut(BaseModel):
    id: int
    at: datetime
    actor: str
    kind: str
    subject: str
    message: str
    data: dict[str, Any] = Field(default_factory=dict)


class QueueEntryOut(BaseModel):
    position: int
    lease: LeaseOut


class HaMemberOut(BaseModel):
    """One controller of a high-availability group, as it last reported itself."""

    id: str
    url: str
    role: Literal["leader", "standby", "stopped"]
    epoch: int
    version: str
    last_seen_s: float
    """Seconds since it last reported, by the database's clock."""
    up: bool
    """It reported recently enough to be counted alive."""


class HaOut(BaseModel):
    """Who leads the pool, since when, and the state of every controller."""

    enabled: bool
    me: str
    """The URL of the controller that answered."""
    role: Literal["leader", "standby"]
    leader: str | None
    """The leader's URL; None while no controller leads (a takeover is under way)."""
    epoch: int
    """Grows by one with every takeover."""
    leader_since: datetime | None
    members: list[HaMemberOut] = Field(default_factory=list)


class PoolSummary(BaseModel):
    nodes_up: int
    nodes_down: int
    gpus: dict[str, int]
    compute_capacity_pct: int
    compute_granted_pct: int
    memory_capacity_mib: int
    memory_granted_mib: int
    leases: dict[str, int]
    queued: int
    ratios: dict[str, float]
    simulated: bool
    ha: HaOut | None = None
    """Which controller leads and the state of the others (high availability)."""


class ErrorOut(BaseModel):
    """Every refusal of the API: a machine-readable code and one line for people."""

    error: str
    detail: str


# ---- tokens -----------------------------------------------------------------------------

Role = Literal["admin", "viewer", "agent", "tenant", "join", "scheduler"]

NODE_NAME = r"^[A-Za-z0-9._-]+$"
"""What a node may be called (NodeRegister.name): also what an agent token may be bound to."""

MAX_JOINS = 100_000


class TokenCreate(Strict):
    """A new API token. A tenant token acts for its tenant only, an agent token for its node
    only; `admin` may do everything, `viewer` reads everything, `scheduler` (the Kubernetes
    extender) places pods and keeps their claims, and `join` does nothing but make agent
    tokens for new nodes (at most `max_nodes` of them), which is how a DaemonSet's agents,
    which share one secret, get a credential each."""

    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._@:-]+$")]
    role: Role
    tenant: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    node: Annotated[str, Field(min_length=1, max_length=128, pattern=NODE_NAME)] | None = None
    """The node an agent token acts for (required for role agent, refused for the others)."""
    max_nodes: Annotated[int, Field(ge=1, le=MAX_JOINS)] | None = None
    """How many new nodes a join token may join (role join only; default 1)."""
    expires_in_s: Annotated[float, Field(gt=0, le=10 * 365 * 86400)] | None = None


class TokenOut(BaseModel):
    id: str
    name: str
    role: Role
    tenant: str | None
    created_at: datetime
    created_by: str
    expires_at: datetime | None
    revoked_at: datetime | None
    node: str | None = None
    """The node of an agent token."""
    joins_left: int | None = None
    """The new nodes a join token may still join."""


class TokenCreated(TokenOut):
    token: str
    """The secret, shown this once: the controller keeps only its hash."""


class WhoAmI(BaseModel):
    token_id: str
    name: str
    role: Role
    tenant: str | None
    node: str | None = None
    """The node an agent token acts for."""
    actor: str
    """How this caller appears in the event log."""


class SessionCreate(Strict):
    """The dashboard's sign-in: the token goes into an HttpOnly cookie, not into scripts."""

    token: Annotated[str, Field(min_length=1, max_length=256)]


class ValidationErrorOut(ErrorOut):
    """A 422: what was wrong in the request, and each problem pydantic found."""

    problems: list[dict[str, Any]] = Field(default_factory=list)
