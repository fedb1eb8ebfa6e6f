"""The agent's main loop: register this node with the controller, then heartbeat forever."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from gpupool.agent.attach import AttachServer
from gpupool.agent.backends import Backend, FakeBackend, GpuEvent, detect
from gpupool.agent.health import is_fault, isolation_reason
from gpupool.agent.isolation import Cgroups, CgroupUnavailable, WorkerUser, worker_user
from gpupool.agent.metrics import AgentView, HealthCounts
from gpupool.agent.mps import MpsSupervisor
from gpupool.agent.ready import DEFAULT_PER_GPU, MAX_PER_GPU
from gpupool.agent.watch import WATCH_INTERVAL_S, DirectWatch, WatchMode
from gpupool.agent.workers import WorkerSupervisor
from gpupool.protocol.failover import AsyncFailoverTransport, split_urls
from gpupool.protocol.tls import tls_verify
from gpupool.protocol.v1.api import (
    DirectEvent,
    DirectEvents,
    GpuDesired,
    GpuInventory,
    NodeHeartbeat,
    NodeHeartbeatReply,
    NodeRegister,
    RemoteLease,
)

log = logging.getLogger(__name__)

MIB = 1024 * 1024
_NODE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
FIRST_RETRY_S = 0.25
EVENT_POLL_MS = 250
HTTP_TIMEOUT_S = 5.0
KEPT_EVENTS = 1000
WAKE_GAP_S = 0.25
"""The least time between two heartbeats asked early through the agent's wake call."""
READY_WORKERS_ENV = "GPUPOOL_READY_WORKERS"
"""The default of `AgentSettings.ready_workers` (`gpupool agent --ready-workers`)."""
NODE_TOKEN_FILE = "node.token"
"""In the agent's data dir: the node token its join token got (owner-only)."""


def write_secret(path: Path, text: str) -> None:
    """Write a secret readable by its owner only, never visible with wider rights."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text + "\n")
    os.replace(tmp, path)


MAX_DIRECT_EVENTS_PER_POST = 256


class NoGpuFound(Exception):
    """Neither real GPUs nor a fake spec: the agent would have nothing to offer the pool."""


class ControllerRefused(Exception):
    """The controller answered, but not with success (nor with the 404 that asks to register)."""

    def __init__(self, what: str, response: httpx.Response) -> None:
        detail = response.text.strip().replace("\n", " ")[:300]
        super().__init__(f"{what}: HTTP {response.status_code} {detail}")
        self.status_code = response.status_code


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """How one agent runs; `retry_max_s` caps the pause between tries to reach the controller."""

    controller_url: str
    data_dir: Path
    node_name: str = field(default_factory=socket.gethostname)
    fake_spec: str | None = None
    heartbeat_interval_s: float = 2.0
    address: str | None = None
    retry_max_s: float = 5.0
    api_host: str = "127.0.0.1"
    api_port: int | None = 0
    """The agent's own HTTP API: 0 picks a free port, None turns it off."""
    device_plugin_dir: Path | None = None
    """Serve the kubelet device plugin (gpupool.k8s) in this directory; None: no plugin."""
    device_plugin_slots: int = 10
    """gpupool.io/vgpu devices per virtual GPU: how many pods may share one."""
    device_plugin_nodes: bool = True
    """Allocate names the GPU's /dev nodes (found under /proc/driver/nvidia; never for
    simulated GPUs, which have none)."""
    device_plugin_cdi: str | None = None
    """Allocate names the GPUs as CDI devices nvidia.com/gpu=<uuid|index>; None: not."""
    device_plugin_pod_check: bool = True
    """Allocate reads the node's pods from the API server (in-cluster service account), so
    that a pod that got past the webhook is not given another pod's claim; False: not."""
    mps_shm_dir: Path | None = None
    """Host directory that is the MPS daemons' /dev/shm (the agent in a container): slices'
    containers get it as theirs, since an MPS client shares /dev/shm with its daemon."""
    token: str | None = field(default_factory=lambda: os.environ.get("GPUPOOL_TOKEN") or None)
    """The agent's API token (role agent, made for this node): the controller refuses agents
    without one, and an agent token acts for the node it was made for only."""
    join_token: str | None = field(
        default_factory=lambda: os.environ.get("GPUPOOL_JOIN_TOKEN", "").strip() or None
    )
    """A join token ($GPUPOOL_JOIN_TOKEN), used instead of `token`: the agent trades it once
    for an agent token of its node, kept in `data_dir/node.token` (the DaemonSet case, where
    every agent gets the same secret)."""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    """With both, the workers serve their remote clients over TLS (tls://host:port)."""
    room_timeout_s: float | None = None
    """How long a worker's allocation that its GPU lacks memory for waits for other sessions
    to be swapped out (memory oversubscription); None: the worker's default, 60 s."""
    direct_watch: WatchMode | None = None
    """The watch of direct slices (gpupool.agent.watch): enforce, report or off. None:
    enforce, except with the kubelet device plugin, whose pods' processes nobody attaches
    (they would all be stopped as processes without a lease): report there."""
    direct_socket: Path | None = None
    """Where `gpupool run` attaches its processes; None: `direct.sock` in the data dir."""

    @property
    def watch_mode(self) -> WatchMode:
        if self.direct_watch is not None:
            return self.direct_watch
        return WatchMode.REPORT if self.device_plugin_dir is not None else WatchMode.ENFORCE

    @property
    def attach_path(self) -> Path:
        return self.direct_socket or self.data_dir / "direct.sock"

    worker_user: str | None = None
    """The Unix user workers run as when the agent is root (made if missing); None or "": as
    the agent itself (`gpupool agent` defaults to gpupool-worker)."""
    worker_cgroups: bool = True
    """Put each worker in a memory cgroup of its own where the agent can (root)."""
    ready_workers: int | None = field(
        default_factory=lambda: (
            int(os.environ[READY_WORKERS_ENV]) if os.environ.get(READY_WORKERS_ENV) else None
        )
    )
    """Workers kept started ahead of their leases, per GPU that takes remote leases
    (`gpupool.agent.ready`); 0: every remote lease starts its worker cold. From
    $GPUPOOL_READY_WORKERS; None: `ready_per_gpu(mps)` decides."""

    def ready_per_gpu(self, mps: bool) -> int:
        """Ready workers per GPU: as set, else 1 — but 0 where the workers run under MPS. A
        ready worker takes its MPS share at hand-over (the environment it sets before its
        CUDA context exists); until that share is measured on a GPU, the default there is
        the path whose limits were (a worker started for its lease)."""
        if self.ready_workers is not None:
            return self.ready_workers
        return 0 if mps else DEFAULT_PER_GPU

    def __post_init__(self) -> None:
        if not _NODE_NAME.match(self.node_name):
            raise ValueError(
                f"node name {self.node_name!r} must be 1-128 letters, digits, '.', '_' or '-'"
            )
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat interval must be > 0 s, got {self.heartbeat_interval_s}")
        if self.room_timeout_s is not None and self.room_timeout_s <= 0:
            raise ValueError(f"room timeout must be > 0 s, got {self.room_timeout_s}")
        if self.ready_workers is not None and not 0 <= self.ready_workers <= MAX_PER_GPU:
            raise ValueError(
                f"ready workers per GPU must be 0..{MAX_PER_GPU}, got {self.ready_workers}"
            )
        if self.retry_max_s <= 0:
            raise ValueError(f"retry_max_s must be > 0 s, got {self.retry_max_s}")
        for url in self.controller_url.split(","):
            if not url.strip().startswith(("http://", "https://")):
                raise ValueError(f"controller URL must start with http:// or https://: {url!r}")


def open_backend(settings: AgentSettings) -> Backend:
    """The fake backend when a spec is given, else real GPUs; blocks (NVML starts here)."""
    if settings.fake_spec is not None:
        return FakeBackend.from_spec(
            settings.fake_spec,
            node_name=settings.node_name,
            process_dir=settings.data_dir / "simulated-gpu-processes",
        )
    backend = detect(settings.node_name)
    if backend is None:
        raise NoGpuFound(
            "no NVIDIA GPU found (NVML did not start or sees no GPU); "
            "give a fake spec such as '4xH100-80GB' for simulated GPUs"
        )
    return backend


def describe(gpus: list[GpuInventory]) -> str:
    """`2 x NVIDIA H200 (143771 MiB), 1 x NVIDIA L4 (23034 MiB)` for logs and banners."""
    counts: dict[tuple[str, int], int] = {}
    for gpu in gpus:
        key = (gpu.model, gpu.memory_mib)
        counts[key] = counts.get(key, 0) + 1
    if not counts:
        return "no GPUs"
    return ", ".join(f"{n} x {model} ({mib} MiB)" for (model, mib), n in counts.items())


class Backoff:
    """Waits that double from `first_s` up to `max_s`, and start over after a success."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s = min(first_s, max_s)
        self.max_s = max_s
        self._next_s = self.first_s

    def next_s(self) -> float:
        wait_s = self._next_s
        self._next_s = min(self._next_s * 2, self.max_s)
        return wait_s

    def reset(self) -> None:
        self._next_s = self.first_s


class Agent:
    """One node's agent. `backend` may be given (tests, demos); else it comes from settings."""

    def __init__(
        self,
        settings: AgentSettings,
        backend: Backend | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.registered = False
        self.controller_reachable: bool | None = None
        self.heartbeats_sent = 0
        self.registrations = 0
        self.health_events: deque[GpuEvent] = deque(maxlen=KEPT_EVENTS)
        self.health_counts = HealthCounts()
        self.desired: dict[str, GpuDesired] = {}
        """What the controller wants of each GPU (mode, leases), from the last heartbeat reply."""
        self._transport = transport
        self._sent_gpus: list[GpuInventory] | None = None
        self._refusal_logged: str | None = None
        self.mps = MpsSupervisor(settings.data_dir / "mps")
        self.workers: WorkerSupervisor | None = None
        # None until the first heartbeat reply: that one always reaches the workers, so
        # those adopted from an earlier agent whose leases ended meanwhile are stopped.
        self._remote_leases: dict[str, RemoteLease] | None = None
        self._workers_wake = asyncio.Event()
        self.agent_url: str | None = None
        self.faults_reported = 0
        self._faults: asyncio.Queue[GpuEvent] = asyncio.Queue()
        self.token: str | None = settings.token
        """The token the agent acts with: `settings.token`, or the one its join token got."""
        self._credential_ready = asyncio.Event()
        self.device_plugins: Any = None
        """The kubelet device plugin (gpupool.k8s), when the agent serves it."""
        self.watch = DirectWatch(
            settings.watch_mode, self._not_tenants, roots_file=settings.data_dir / "direct.json"
        )
        self.attach_server: AttachServer | None = None
        self._direct_events: asyncio.Queue[DirectEvent] = asyncio.Queue()
        self._heartbeat_now = asyncio.Event()
        self._replies = 0
        self._replied = asyncio.Condition()
        self._woken_at = -WAKE_GAP_S
        self._wake_pending = False

    async def run(self, stop: asyncio.Event) -> None:
        """Register, then heartbeat until `stop` is set; a missing controller never ends it."""
        if self.backend is None:
            self.backend = await asyncio.to_thread(open_backend, self.settings)
        backend = self.backend
        await asyncio.to_thread(self.settings.data_dir.mkdir, parents=True, exist_ok=True)
        if backend.simulated:
            # Simulated GPUs have no driver behind them: an MPS daemon would serve nothing.
            self.mps.enabled = False
        await self._log_banner(backend)
        # The first cpu_percent() reading is meaningless (no interval yet): prime it now.
        await asyncio.to_thread(psutil.cpu_percent, None)
        api = await self._start_api()
        user, cgroups = await asyncio.to_thread(self._isolation)
        self.workers = WorkerSupervisor(
            self.settings.data_dir / "workers",
            self.mps,
            simulated=backend.simulated,
            listen_host=self.settings.address or "127.0.0.1",
            tls=(self.settings.tls_cert, self.settings.tls_key)
            if self.settings.tls_cert and self.settings.tls_key
            else None,
            simulated_gpus=await asyncio.to_thread(_simulated_gpus, backend),
            room_timeout_s=self.settings.room_timeout_s,
            user=user,
            cgroups=cgroups,
            ready_per_gpu=self.settings.ready_per_gpu(self.mps.enabled),
        )
        done = asyncio.Event()
        watcher = asyncio.create_task(self._watch_health(backend, stop, done), name="agent-health")
        keeper = asyncio.create_task(self._keep_workers(done), name="agent-workers")
        direct = None
        if self.watch.mode is not WatchMode.OFF:
            await self._start_attach()
            direct = asyncio.create_task(self._watch_direct(backend, done), name="agent-direct")
        plugin = None
        if self.settings.device_plugin_dir is not None:
            plugin = asyncio.create_task(self._serve_device_plugin(done), name="agent-k8s")
        try:
            urls = split_urls(self.settings.controller_url)
            transport = self._transport
            if len(urls) > 1:
                # Several controllers (high availability): heartbeats move on while one is
                # down or does not lead, so the node stays up through a takeover.
                transport = AsyncFailoverTransport(urls, transport)
            async with httpx.AsyncClient(
                base_url=urls[0],
                timeout=HTTP_TIMEOUT_S,
                transport=transport,
                # The event log names who acted: here, this node's agent (it isolates GPUs).
                headers=self._headers(),
                verify=tls_verify(),
            ) as client:
                if not await self._node_credential(client, stop):
                    return
                reporters = [
                    asyncio.create_task(self._report_faults(client), name="agent-faults"),
                    asyncio.create_task(self._report_direct(client), name="agent-direct-events"),
                ]
                try:
                    await self._heartbeat_loop(client, backend, stop)
                finally:
                    for reporter in reporters:
                        reporter.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await reporter
        finally:
            done.set()
            await watcher
            if direct is not None:
                await direct
            if self.attach_server is not None:
                await self.attach_server.stop()
            if plugin is not None:
                await plugin
            if api is not None:
                api.should_exit = True
                await self._api_task
            self._workers_wake.set()
            await keeper
            await asyncio.to_thread(self.workers.stop_all)
            await asyncio.to_thread(self.mps.stop_all)
            await asyncio.to_thread(backend.close)
            log.info("agent %s stopped", self.settings.node_name)

    # ---- the node's credential ---------------------------------------------------------------

    @property
    def node_token_file(self) -> Path:
        return self.settings.data_dir / NODE_TOKEN_FILE

    async def _node_credential(self, client: httpx.AsyncClient, stop: asyncio.Event) -> bool:
        """Make sure the agent holds its node's token; False if `stop` came first.

        With a join token, the node token kept from an earlier start is used while the
        controller accepts it; otherwise the join token is traded for a new one, which is
        written (owner-only) before it is used, so a restart never needs to join again.
        """
        if self.settings.join_token is None:
            self._credential_ready.set()
            return True
        backoff = Backoff(FIRST_RETRY_S, self.settings.retry_max_s)
        while not stop.is_set():
            try:
                token = await self._kept_node_token(client) or await self._join(client)
            except httpx.TransportError as exc:
                self._controller_away(exc)
                token = None
            except ControllerRefused as exc:
                self._controller_answered()
                self._log_refusal(exc)
                token = None
            if token is not None:
                self.token = token
                client.headers["Authorization"] = f"Bearer {token}"
                self._credential_ready.set()
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=backoff.next_s())
        return False

    async def _kept_node_token(self, client: httpx.AsyncClient) -> str | None:
        path = self.node_token_file
        try:
            token = (await asyncio.to_thread(path.read_text)).strip()
        except FileNotFoundError:
            return None
        answer = await client.get("/api/v1/whoami", headers={"Authorization": f"Bearer {token}"})
        if answer.status_code == 401:
            # Revoked (the operator wants this node to join afresh) or another pool's.
            log.warning("the kept node token %s is not accepted: joining again", path)
            await asyncio.to_thread(path.unlink, True)
            return None
        if answer.is_error:
            raise ControllerRefused("checking the kept node token", answer)
        me = answer.json()
        if me.get("role") != "agent" or me.get("node") != self.settings.node_name:
            raise ControllerRefused("checking the kept node token (made for another node)", answer)
        return token

    async def _join(self, client: httpx.AsyncClient) -> str:
        join = self.settings.join_token
        answer = await client.post(
            f"/api/v1/nodes/{self.settings.node_name}/join",
            headers={"Authorization": f"Bearer {join}"},
        )
        if answer.is_error:
            raise ControllerRefused("joining the pool with the join token", answer)
        token = str(answer.json()["token"])
        await asyncio.to_thread(write_secret, self.node_token_file, token)
        log.info("joined the pool as node %s (token kept in %s)", self.settings.node_name,
                 self.node_token_file)  # fmt: skip
        return token

    async def _start_api(self) -> Any:
        """Serve the agent's API on loopback; its URL goes to the controller with the node."""
        if self.settings.api_port is None:
            return None
        import uvicorn

        from gpupool.agent.api import create_agent_app

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.settings.api_host, self.settings.api_port))
        host, port = sock.getsockname()[:2]
        if host in ("0.0.0.0", ""):
            # Listening everywhere: tell the controller the name other hosts reach us by.
            host = self.settings.address or socket.gethostname()
        self.agent_url = f"http://{host}:{port}"
        config = uvicorn.Config(
            create_agent_app(self), log_level="warning", access_log=False, lifespan="off"
        )
        server = _embedded_server_class()(config)
        self._api_task = asyncio.create_task(server.serve(sockets=[sock]), name="agent-api")
        log.info("agent API on %s", self.agent_url)
        return server

    async def _start_attach(self) -> None:
        """The socket `gpupool run` attaches at; without it the watch would stop every direct
        program as one without a lease, so a failure here leaves the watch reporting only."""
        await asyncio.to_thread(self.watch.restore)
        server = AttachServer(self.settings.attach_path, self.watch, self._learn_leases)
        try:
            await server.start()
        except OSError as exc:
            log.error(
                "cannot serve direct attach socket %s (%s): the direct watch only reports",
                self.settings.attach_path,
                exc,
            )
            self.watch.mode = WatchMode.REPORT
            return
        self.attach_server = server
        if self.watch.mode is WatchMode.REPORT:
            log.warning("the watch of direct slices only reports: it stops no process")

    def wake(self) -> bool:
        """Heartbeat soon (the controller granted a remote lease here): now, or WAKE_GAP_S
        after the last early one. The wake call needs no token, so the gap bounds what any
        caller can make the agent send; calls within one gap share one heartbeat. Returns
        whether this call asked for a heartbeat (False: one is asked already)."""
        if self._wake_pending:
            return False
        wait_s = self._woken_at + WAKE_GAP_S - time.monotonic()
        if wait_s <= 0:
            self._early_heartbeat()
        else:
            self._wake_pending = True
            asyncio.get_running_loop().call_later(wait_s, self._early_heartbeat)
        return True

    # ---- what the agent's API serves -------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The agent's local view, as its API's /agent/v1/status answers it."""
        backend = self.backend
        return {
            "node": self.settings.node_name,
            "backend": backend.name if backend else None,
            "simulated": bool(backend and backend.simulated),
            "registered": self.registered,
            "controller_reachable": self.controller_reachable,
            "faults_reported": self.faults_reported,
            "mps": {
                uuid: {
                    "workers": self.mps.pipe_dir(uuid),
                    "direct": self.mps.direct_pipe_dir(uuid),
                }
                for uuid in self.mps.daemons
            },
            "direct_watch": {
                "mode": self.watch.mode.value,
                "socket": str(self.settings.attach_path) if self.attach_server else None,
                "attached": [{"pid": r.pid, "lease_id": r.lease_id} for r in self.watch.roots()],
                "stopped": dict(self.watch.stopped),
                "reported": dict(self.watch.reported),
                "events": [
                    e.model_dump(mode="json", exclude_none=True)
                    for e in list(self.watch.events)[-50:]
                ],
            },
            "ready_workers": self._ready_status(),
            "health_events": [
                {"gpu_uuid": e.gpu_uuid, "kind": e.kind, "value": e.value, "message": e.message}
                for e in list(self.health_events)[-50:]
            ],
        }

    def _ready_status(self) -> dict[str, Any]:
        """The ready pool: per GPU, workers ready now; the setting; what it has done."""
        workers = self.workers
        if workers is None:
            return {"per_gpu": self.settings.ready_per_gpu(self.mps.enabled), "gpus": {}}
        pool = workers.ready
        return {
            "per_gpu": pool.per_gpu,
            "wanted": pool.wanted,
            "gpus": pool.counts(),
            "started": pool.started,
            "handed_over": pool.handed_over,
            "replaced": pool.replaced,
            "problem": pool.problem,
            "workers": workers.starts(),
        }

    def metrics_view(self) -> AgentView:
        """What the agent's Prometheus metrics show. Blocks (the backend reads the GPUs): call
        it in a thread."""
        backend = self.backend
        inventory = backend.inventory() if backend is not None else []
        telemetry = backend.telemetry() if backend is not None else []
        workers = self.workers
        return AgentView(
            node=self.settings.node_name,
            backend=backend.name if backend is not None else "none",
            simulated=bool(backend is not None and backend.simulated),
            registered=self.registered,
            controller_reachable=self.controller_reachable,
            heartbeats_sent=self.heartbeats_sent,
            mps_daemons=len(self.mps.daemons),
            inventory=inventory,
            telemetry=telemetry,
            desired=dict(self.desired),
            health=self.health_counts.copy(),
            direct_stopped=dict(self.watch.stopped),
            direct_reported=dict(self.watch.reported),
            direct_usage=dict(self.watch.usage),
            direct_attached=len(self.watch.roots()),
            ready_workers=workers.ready.counts() if workers is not None else {},
            ready_wanted=workers.ready.wanted if workers is not None else 0,
            ready_handed_over=workers.ready.handed_over if workers is not None else 0,
        )

    def _early_heartbeat(self) -> None:
        self._wake_pending = False
        self._woken_at = time.monotonic()
        self._heartbeat_now.set()

    async def _learn_leases(self) -> None:
        """Heartbeat now and return once the controller's answer is in (a new direct lease
        attaching its process moments after its grant)."""
        async with self._replied:
            seen = self._replies
            self._heartbeat_now.set()
            await self._replied.wait_for(lambda: self._replies > seen)

    async def _watch_direct(self, backend: Backend, done: asyncio.Event) -> None:
        """Read the GPUs' processes every WATCH_INTERVAL_S and act on what breaks a lease."""
        failing: str | None = None
        while not done.is_set():
            try:
                events = await asyncio.to_thread(self.watch.poll, backend)
                failing = None
            except Exception as exc:
                # A failing reading (NVML, /proc) must not end the watch: the next one may
                # work. Logged once per kind of failure, not four times a second.
                if repr(exc) != failing:
                    log.exception("watching direct slices failed; retrying")
                    failing = repr(exc)
                events = []
            for event in events:
                self._direct_events.put_nowait(event)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=WATCH_INTERVAL_S)

    async def _report_direct(self, client: httpx.AsyncClient) -> None:
        """Send the watch's events to the controller's event log as they come."""
        path = f"/api/v1/nodes/{self.settings.node_name}/direct-events"
        while True:
            batch = [await self._direct_events.get()]
            while not self._direct_events.empty() and len(batch) < MAX_DIRECT_EVENTS_PER_POST:
                batch.append(self._direct_events.get_nowait())
            refused = await self._post_direct(client, path, batch)
            if refused is not None and len(batch) > 1:
                # One event the controller will not take (its lease gone from the controller's
                # memory, say) must not cost the others: each goes on its own.
                for event in batch:
                    await self._post_direct(client, path, [event])

    async def _post_direct(
        self, client: httpx.AsyncClient, path: str, batch: list[DirectEvent]
    ) -> httpx.Response | None:
        """POST one batch, retrying while the controller is unreachable; the refusal, if any."""
        body = DirectEvents(events=batch).model_dump(mode="json", exclude_none=True)
        backoff = Backoff(FIRST_RETRY_S, self.settings.retry_max_s)
        while True:
            try:
                response = await client.post(path, json=body)
            except httpx.TransportError:
                await asyncio.sleep(backoff.next_s())
                continue
            if not response.is_error:
                return None
            log.error(
                "controller refused %d direct-slice event(s): HTTP %d %s",
                len(batch),
                response.status_code,
                response.text[:300],
            )
            return response

    def _not_tenants(self) -> set[int]:
        """Processes on a GPU that are the agent's own, not a tenant's: remote leases' workers
        and the MPS daemons (whose servers hold their clients' contexts)."""
        pids = self.mps.pids()
        if self.workers is not None:
            pids |= self.workers.pids()
        return pids

    async def _report_faults(self, client: httpx.AsyncClient) -> None:
        """Tell the controller at once about each fault, so the GPU is isolated within seconds."""
        while True:
            event = await self._faults.get()
            body = {"reason": isolation_reason(event), "fault": True}
            backoff = Backoff(FIRST_RETRY_S, self.settings.retry_max_s)
            while True:
                try:
                    response = await client.post(
                        f"/api/v1/gpus/{event.gpu_uuid}/isolate", json=body
                    )
                except httpx.TransportError:
                    await asyncio.sleep(backoff.next_s())
                    continue
                if response.is_error:
                    log.error("controller refused to isolate %s: %s", event.gpu_uuid, response.text)
                else:
                    self.faults_reported += 1
                    log.warning("GPU %s isolated: %s", event.gpu_uuid, body["reason"])
                break

    # ---- the loop -------------------------------------------------------------------------

    async def _heartbeat_loop(
        self, client: httpx.AsyncClient, backend: Backend, stop: asyncio.Event
    ) -> None:
        backoff = Backoff(
            min(FIRST_RETRY_S, self.settings.heartbeat_interval_s), self.settings.retry_max_s
        )
        while not stop.is_set():
            started = time.monotonic()
            try:
                if not self.registered:
                    # The first heartbeat follows at once, so telemetry is there from the start.
                    await self._register(client, backend)
                    wait_s = 0.0
                elif await self._heartbeat(client, backend):
                    backoff.reset()
                    wait_s = self.settings.heartbeat_interval_s - (time.monotonic() - started)
                else:
                    # Registering again; through the backoff, so that a controller which keeps
                    # forgetting the node cannot make the agent spin.
                    wait_s = backoff.next_s()
                self._controller_answered()
            except httpx.TransportError as exc:
                self._controller_away(exc)
                wait_s = backoff.next_s()
            except ControllerRefused as exc:
                self._controller_answered()
                self._log_refusal(exc)
                wait_s = backoff.next_s()
            if wait_s > 0 and not self._heartbeat_now.is_set():
                await _first_of(stop, self._heartbeat_now, wait_s)
            self._heartbeat_now.clear()

    async def _register(self, client: httpx.AsyncClient, backend: Backend) -> None:
        body = await asyncio.to_thread(self._registration, backend)
        response = await client.post("/api/v1/nodes", json=body.model_dump(mode="json"))
        if response.is_error:
            raise ControllerRefused("registering the node", response)
        self.registered = True
        self.registrations += 1
        self._sent_gpus = body.gpus
        self._refusal_logged = None
        log.info(
            "registered node %s with %s: %s",
            body.name,
            self.settings.controller_url,
            describe(body.gpus),
        )

    async def _heartbeat(self, client: httpx.AsyncClient, backend: Backend) -> bool:
        """Send one heartbeat; False when the node must register again first."""
        body, gpus = await asyncio.to_thread(self._heartbeat_body, backend)
        if gpus != self._sent_gpus:
            # Registering is how the controller adds and removes GPUs of a node; a heartbeat
            # only refreshes readings.
            log.warning("GPU inventory changed (%s): registering again", describe(gpus))
            self.registered = False
            return False
        response = await client.post(
            f"/api/v1/nodes/{self.settings.node_name}/heartbeat", json=body.model_dump(mode="json")
        )
        if response.status_code == 404:
            # The controller forgot this node (a new database, an operator removed it): the
            # next turn of the loop registers it again, with its full inventory.
            log.warning(
                "controller does not know node %s: registering again", self.settings.node_name
            )
            self.registered = False
            return False
        if response.is_error:
            raise ControllerRefused("heartbeat", response)
        reply = NodeHeartbeatReply.model_validate(response.json())
        self.desired = reply.gpus
        modes = {uuid: (d.mode, d.target_mode) for uuid, d in reply.gpus.items()}
        if modes:
            await asyncio.to_thread(self.mps.reconcile, modes)
        if self.workers is not None:  # after the daemons: a ready CUDA worker joins its GPU's
            self.workers.ready.set_gpus(
                uuid for uuid, d in reply.gpus.items() if d.mode == "virtual"
            )
        if reply.leases != self._remote_leases:
            self._remote_leases = reply.leases
            self._workers_wake.set()
        await asyncio.to_thread(self.watch.set_leases, reply.direct)
        async with self._replied:
            self._replies += 1
            self._replied.notify_all()
        self.heartbeats_sent += 1
        self._refusal_logged = None
        return True

    async def _watch_health(
        self, backend: Backend, stop: asyncio.Event, done: asyncio.Event
    ) -> None:
        """Log health events and keep the latest (NodeHeartbeat has no field for them yet)."""
        while not (stop.is_set() or done.is_set()):
            try:
                events = await asyncio.to_thread(backend.poll_events, EVENT_POLL_MS)
            except Exception:
                # A broken event source must not stop heartbeats, which carry the telemetry.
                log.exception("watching GPU health failed; retrying")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.settings.retry_max_s)
                continue
            for event in events:
                self.health_events.append(event)
                self.health_counts.observe(event)
                log.warning("GPU %s: %s (%s)", event.gpu_uuid, event.message, event.kind)
                if is_fault(event):
                    self._faults.put_nowait(event)

    # ---- bodies (blocking: run in a thread) -------------------------------------------------

    def _registration(self, backend: Backend) -> NodeRegister:
        return NodeRegister(
            name=self.settings.node_name,
            address=self.settings.address,
            agent_url=self.agent_url,
            cpu_count=psutil.cpu_count(),
            memory_mib=int(psutil.virtual_memory().total) // MIB,
            driver_version=backend.driver_version(),
            cuda_version=backend.cuda_version(),
            backend=backend.name,
            gpus=backend.inventory(),
        )

    def _heartbeat_body(self, backend: Backend) -> tuple[NodeHeartbeat, list[GpuInventory]]:
        gpus = backend.inventory()
        attach = str(self.settings.attach_path) if self.attach_server is not None else None
        telemetry = [
            t.model_copy(
                update={
                    "mps_pipe_dir": self.mps.direct_pipe_dir(t.uuid),
                    "direct_socket": attach,
                    **self.health_counts.telemetry_fields(t.uuid),
                }
            )
            for t in backend.telemetry()
        ]
        body = NodeHeartbeat(
            telemetry=telemetry,
            host={
                **host_stats(self.settings.data_dir),
                **(self.workers.confinement() if self.workers is not None else {}),
                **(self.workers.ready_facts() if self.workers is not None else {}),
            },
            workers=self.workers.reports() if self.workers is not None else [],
        )
        return body, gpus

    async def _keep_workers(self, done: asyncio.Event) -> None:
        """Start and stop workers as remote leases come and go, off the heartbeat's path
        (a worker takes seconds to start: heartbeats must not wait for it)."""
        assert self.workers is not None
        while not done.is_set():
            await self._workers_wake.wait()
            self._workers_wake.clear()
            if done.is_set():
                return
            try:
                changed = await asyncio.to_thread(
                    self.workers.reconcile, dict(self._remote_leases or {})
                )
                if changed:  # a new worker's endpoint reaches its client a heartbeat sooner
                    self._heartbeat_now.set()
            except Exception:
                log.exception("managing workers failed; retrying with the next heartbeat")

    async def _serve_device_plugin(self, done: asyncio.Event) -> None:
        """The kubelet device plugin, fed with this agent's GPUs and the controller's modes."""
        from gpupool.client.sdk import PoolClient
        from gpupool.k8s.devicenodes import DeviceNodeFinder
        from gpupool.k8s.deviceplugin.claims import ControllerClaims
        from gpupool.k8s.deviceplugin.server import DevicePlugins, PluginSettings
        from gpupool.k8s.devices import CdiNaming, GpuView, NodeView

        assert self.settings.device_plugin_dir is not None and self.backend is not None
        simulated = self.backend.simulated
        finder = DeviceNodeFinder() if self.settings.device_plugin_nodes and not simulated else None
        cdi = (
            CdiNaming(self.settings.device_plugin_cdi) if self.settings.device_plugin_cdi else None
        )
        # The plugin asks the controller with the node's token, which a join may still fetch.
        waiting = asyncio.create_task(self._credential_ready.wait())
        ending = asyncio.create_task(done.wait())
        await asyncio.wait({waiting, ending}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        ending.cancel()
        if not self._credential_ready.is_set():
            return

        def view() -> NodeView:
            gpus = []
            for gpu in self._sent_gpus or []:
                desired = self.desired.get(gpu.uuid)
                if desired is not None:  # not yet told its mode: not offered yet
                    gpus.append(
                        GpuView(
                            uuid=gpu.uuid,
                            index=gpu.index,
                            mode=desired.mode,
                            target_mode=desired.target_mode,
                            mps_pipe_dir=self.mps.direct_pipe_dir(gpu.uuid),
                        )
                    )
            shm = self.settings.mps_shm_dir
            return NodeView(
                gpus=tuple(gpus),
                simulated=simulated,
                mps_shm_dir=str(shm) if shm else None,
                device_nodes=finder.nodes_for(g.uuid for g in gpus) if finder else None,
                cdi=cdi,
            )

        settings = PluginSettings(
            kubelet_dir=self.settings.device_plugin_dir,
            slots_per_gpu=self.settings.device_plugin_slots,
        )
        client = PoolClient(
            self.settings.controller_url,
            actor=f"agent/{self.settings.node_name}",
            token=self.token,
        )
        pods = None
        if self.settings.device_plugin_pod_check:
            from gpupool.k8s.deviceplugin.pods import NodePods
            from gpupool.k8s.kube import KubeApi

            pods = NodePods(KubeApi.in_cluster(), self.settings.node_name)
        else:
            log.warning(
                "device plugin: Allocate does not read the node's pods (--insecure-no-pod-check)"
            )
        self.device_plugins = DevicePlugins(
            settings, view, ControllerClaims(client, self.settings.node_name), pods
        )
        try:
            await self.device_plugins.run(done)
        finally:
            client.close()
            if pods is not None:
                await pods.close()

    # ---- what people see --------------------------------------------------------------------

    def _isolation(self) -> tuple[WorkerUser | None, Cgroups | CgroupUnavailable | None]:
        """The workers' user and memory cgroups; says in the log what it cannot confine."""
        user = worker_user(self.settings.worker_user) if self.settings.worker_user else None
        if user is not None:
            log.info("workers run as %s (uid %d)", user.name, user.uid)
        cgroups: Cgroups | CgroupUnavailable | None = None
        if self.settings.worker_cgroups:
            try:
                cgroups = Cgroups.detect()
                log.info("workers get memory cgroups (v%d) under %s", cgroups.version, cgroups.base)
            except CgroupUnavailable as exc:
                cgroups = exc
                log.warning("workers run without a memory cgroup of their own: %s", exc)
        return user, cgroups

    async def _log_banner(self, backend: Backend) -> None:
        gpus, driver, cuda = await asyncio.to_thread(
            lambda: (backend.inventory(), backend.driver_version(), backend.cuda_version())
        )
        if backend.simulated:
            log.warning(
                "SIMULATED GPUs (fake backend): %s. Not real hardware: nothing runs on them.",
                describe(gpus),
            )
        else:
            log.info(
                "GPUs (%s backend, driver %s, CUDA %s): %s",
                backend.name,
                driver or "unknown",
                cuda or "unknown",
                describe(gpus),
            )
        log.info(
            "agent %s reports to %s every %gs",
            self.settings.node_name,
            self.settings.controller_url,
            self.settings.heartbeat_interval_s,
        )

    def _controller_away(self, exc: httpx.TransportError) -> None:
        # Once per outage: an agent left running for a day must not fill the log.
        if self.controller_reachable is not False:
            log.warning(
                "controller %s unreachable (%s: %s); retrying every %gs at most",
                self.settings.controller_url,
                type(exc).__name__,
                exc or "no detail",
                self.settings.retry_max_s,
            )
        self.controller_reachable = False

    def _controller_answered(self) -> None:
        if self.controller_reachable is False:
            log.warning("controller %s reachable again", self.settings.controller_url)
        self.controller_reachable = True

    def _headers(self) -> dict[str, str]:
        # The event log names who acted from the token; the header says which node it was.
        headers = {"X-Gpupool-Actor": f"agent/{self.settings.node_name}"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def _log_refusal(self, exc: ControllerRefused) -> None:
        text = str(exc)
        if text != self._refusal_logged:
            log.error("controller refused %s; retrying", text)
            self._refusal_logged = text


async def _first_of(stop: asyncio.Event, now: asyncio.Event, timeout_s: float) -> None:
    """Wait until either event is set, or `timeout_s` passed."""
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(now.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def _embedded_server_class() -> Any:
    import uvicorn

    class EmbeddedServer(uvicorn.Server):
        """uvicorn inside the agent's loop: the agent, not uvicorn, owns SIGINT and SIGTERM."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return EmbeddedServer


def _simulated_gpus(backend: Backend) -> dict[str, int]:
    """The simulated GPUs' memory (MiB) for the workers to share; none on real GPUs."""
    if not backend.simulated:
        return {}
    return {gpu.uuid: gpu.memory_mib for gpu in backend.inventory()}


def host_stats(data_dir: Path) -> dict[str, Any]:
    """This server's load as the dashboard shows it; blocks briefly (psutil reads /proc)."""
    memory = psutil.virtual_memory()
    net = psutil.net_io_counters()
    stats: dict[str, Any] = {
        "cpu_pct": float(psutil.cpu_percent(None)),
        "load1": os.getloadavg()[0],
        # "Used" as people mean it: what programs hold, page cache excluded.
        "memory_used_mib": int(memory.total - memory.available) // MIB,
        "memory_total_mib": int(memory.total) // MIB,
        "net_sent_bytes": int(net.bytes_sent) if net is not None else None,
        "net_recv_bytes": int(net.bytes_recv) if net is not None else None,
    }
    try:
        disk = psutil.disk_usage(str(data_dir))
    except OSError:
        stats.update(disk_used_mib=None, disk_total_mib=None)
    else:
        stats.update(disk_used_mib=int(disk.used) // MIB, disk_total_mib=int(disk.total) // MIB)
    return stats


def run_agent(settings: AgentSettings) -> None:
    """Run the agent until SIGINT or SIGTERM; the entry point of `gpupool agent`."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    asyncio.run(_serve(settings))


async def _serve(settings: AgentSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # not on Windows
            loop.add_signal_handler(sig, stop.set)
    await Agent(settings).run(stop)
