"""The kubelet device plugin: serves gpupool.io/vgpu and gpupool.io/gpu to the kubelet.

One gRPC server per resource, each on its own Unix socket in the kubelet's device-plugins
directory, registered through the kubelet's `kubelet.sock`. A kubelet that restarts removes
every socket there and makes a new `kubelet.sock`; the plugin notices (the file's identity
changes, or its own socket is gone), serves again on a fresh socket and registers again,
and the kubelet then re-lists the devices through a new ListAndWatch stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from gpupool.k8s.deviceplugin.pods import PodsUnavailable
from gpupool.k8s.deviceplugin.v1beta1 import api_pb2 as pb
from gpupool.k8s.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpupool.k8s.devices import (
    AllocationRefused,
    Device,
    NodeView,
    allocation,
    devices,
    preferred,
)
from gpupool.k8s.resources import RESOURCE_OF, ResourceKind
from gpupool.protocol.v1.k8s import ClaimOut, WaitingPod

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet/device-plugins")
REGISTER_TIMEOUT_S = 5.0


class Claims(Protocol):
    """The controller's side of allocation: the claim waiting on this node."""

    async def allocate(
        self, kind: ResourceKind, devices: int, waiting: list[WaitingPod] | None
    ) -> ClaimOut: ...

    async def pending(self) -> ClaimOut | None: ...


class Pods(Protocol):
    """The node's pods that ask for a resource and have not started (from the API server)."""

    async def waiting(self, resource: str) -> list[WaitingPod]: ...


class ClaimError(Exception):
    """The controller refused or could not be asked; the message says why, for the pod."""


@dataclass(frozen=True, slots=True)
class PluginSettings:
    kubelet_dir: Path = DEFAULT_KUBELET_DIR
    slots_per_gpu: int = 10
    """vgpu devices per virtual GPU: at most this many pods share one GPU."""
    watch_interval_s: float = 0.5
    """How often the plugin looks at its GPUs and at the kubelet's socket."""

    def __post_init__(self) -> None:
        if not 1 <= self.slots_per_gpu <= 100:
            raise ValueError(f"slots per GPU must be 1..100, got {self.slots_per_gpu}")
        if self.watch_interval_s <= 0:
            raise ValueError(f"watch interval must be > 0 s, got {self.watch_interval_s}")


class DeviceList:
    """The current device list of one resource, and a way to wait until it changes."""

    def __init__(self) -> None:
        self.devices: list[Device] = []
        self.version = 0
        self._changed = asyncio.Condition()

    async def set(self, new: list[Device]) -> bool:
        if new == self.devices:
            return False
        async with self._changed:
            self.devices = new
            self.version += 1
            self._changed.notify_all()
        return True

    async def wait_newer(self, version: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.version != version)

    async def wake_all(self) -> None:
        """Wake every waiter (they see the same version and look at why they woke)."""
        async with self._changed:
            self.version += 1
            self._changed.notify_all()


class DevicePluginService(pb_grpc.DevicePluginServicer):
    """The DevicePlugin gRPC service of one resource (`vgpu` or `gpu`)."""

    def __init__(
        self,
        kind: ResourceKind,
        listing: DeviceList,
        view: Callable[[], NodeView],
        claims: Claims,
        pods: Pods | None,
    ) -> None:
        self.kind = kind
        self.listing = listing
        self.view = view
        self.claims = claims
        self.pods = pods
        """None: Allocate does not check the node's pods (the agent was told so)."""

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.DevicePluginOptions]
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    async def ListAndWatch(
        self,
        request: pb.Empty,
        context: grpc.aio.ServicerContext[pb.Empty, pb.ListAndWatchResponse],
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        sent: list[Device] | None = None
        while True:
            version = self.listing.version
            current = self.listing.devices
            if current != sent:
                yield pb.ListAndWatchResponse(
                    devices=[pb.Device(ID=d.id, health=d.health) for d in current]
                )
                sent = current
            await self.listing.wait_newer(version)

    async def GetPreferredAllocation(
        self,
        request: pb.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[
            pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
        ],
    ) -> pb.PreferredAllocationResponse:
        try:
            claim = await self.claims.pending()
        except ClaimError as exc:
            # Only a preference: the kubelet goes on with its own choice.
            log.warning("no preferred allocation for %s: %s", self.kind, exc)
            claim = None
        mine = claim is not None and claim.resource == self.kind
        gpus = [s.gpu_uuid for s in claim.lease.slices] if claim is not None and mine else []
        return pb.PreferredAllocationResponse(
            container_responses=[
                pb.ContainerPreferredAllocationResponse(
                    deviceIDs=preferred(
                        list(r.available_deviceIDs),
                        list(r.must_include_deviceIDs),
                        r.allocation_size,
                        gpus,
                    )
                )
                for r in request.container_requests
            ]
        )

    async def Allocate(
        self,
        request: pb.AllocateRequest,
        context: grpc.aio.ServicerContext[pb.AllocateRequest, pb.AllocateResponse],
    ) -> pb.AllocateResponse:
        if len(request.container_requests) != 1:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"gpupool gives one container per pod its GPUs; "
                f"{len(request.container_requests)} containers ask for {RESOURCE_OF[self.kind]}",
            )
        ids = list(request.container_requests[0].devices_ids)
        try:
            waiting = None if self.pods is None else await self.pods.waiting(RESOURCE_OF[self.kind])
            claim = await self.claims.allocate(self.kind, len(ids), waiting)
            given = allocation(claim, self.view(), ids)
        except (ClaimError, AllocationRefused, PodsUnavailable) as exc:
            log.error("refused %s for devices %s: %s", RESOURCE_OF[self.kind], ids, exc)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        log.info(
            "claim %s: lease %s to a container (%s)", claim.claim, claim.lease.id, ", ".join(ids)
        )
        return pb.AllocateResponse(
            container_responses=[
                pb.ContainerAllocateResponse(
                    envs=given.envs,
                    mounts=[
                        pb.Mount(container_path=c, host_path=h, read_only=ro)
                        for c, h, ro in given.mounts
                    ],
                    devices=[
                        pb.DeviceSpec(container_path=c, host_path=h, permissions=perms)
                        for c, h, perms in given.devices
                    ],
                    cdi_devices=[pb.CDIDevice(name=n) for n in given.cdi_devices],
                )
            ]
        )

    async def PreStartContainer(
        self,
        request: pb.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[
            pb.PreStartContainerRequest, pb.PreStartContainerResponse
        ],
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


class DevicePlugins:
    """Both resources' services, their sockets and their registration with the kubelet."""

    def __init__(
        self,
        settings: PluginSettings,
        view: Callable[[], NodeView],
        claims: Claims,
        pods: Pods | None,
    ) -> None:
        self.settings = settings
        self.view = view
        self.listings: dict[ResourceKind, DeviceList] = {"vgpu": DeviceList(), "gpu": DeviceList()}
        self.services = {
            kind: DevicePluginService(kind, listing, view, claims, pods)
            for kind, listing in self.listings.items()
        }
        self._servers: dict[ResourceKind, grpc.aio.Server] = {}
        self._kubelet_identity: tuple[int, int] | None = None
        self._last_error: str | None = None

    def socket_path(self, kind: ResourceKind) -> Path:
        return self.settings.kubelet_dir / f"gpupool-{kind}.sock"

    async def run(self, stop: asyncio.Event) -> None:
        """Serve and stay registered until `stop` is set."""
        try:
            while not stop.is_set():
                try:
                    await self.refresh()
                    if self._needs_registration():
                        await self._restart()
                except (OSError, ValueError, grpc.RpcError) as exc:
                    # A socket that cannot be made, a device id the kubelet would refuse: say
                    # so (once) and try again; the agent's other duties go on.
                    if str(exc) != self._last_error:
                        log.error("device plugin: %s; trying again", exc)
                        self._last_error = str(exc)
                else:
                    self._last_error = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.watch_interval_s)
        finally:
            await self._stop_server()

    async def refresh(self) -> None:
        """Recompute both device lists; ListAndWatch streams send what changed."""
        view = self.view()
        for kind, listing in self.listings.items():
            if await listing.set(devices(kind, view, self.settings.slots_per_gpu)):
                log.info(
                    "%s: %d devices (%d healthy)",
                    RESOURCE_OF[kind],
                    len(listing.devices),
                    sum(1 for d in listing.devices if d.health == "Healthy"),
                )

    def _kubelet_socket_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.settings.kubelet_dir / KUBELET_SOCKET)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_ctime_ns

    def _needs_registration(self) -> bool:
        identity = self._kubelet_socket_identity()
        if identity is None:
            return False  # no kubelet yet: nothing to register with
        if identity != self._kubelet_identity:
            return True
        return any(not self.socket_path(kind).exists() for kind in self.listings)

    async def _restart(self) -> None:
        """Serve on fresh sockets, then register both resources with the kubelet."""
        identity = self._kubelet_socket_identity()
        await self._stop_server()
        for kind, service in self.services.items():
            # One server per resource: the kubelet dials one endpoint per resource name.
            path = self.socket_path(kind)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            server = grpc.aio.server()
            pb_grpc.add_DevicePluginServicer_to_server(service, server)  # type: ignore[no-untyped-call]
            server.add_insecure_port(f"unix://{path}")
            await server.start()
            self._servers[kind] = server
        for kind in self.listings:
            # A refusal raises to run(), which says so once; the identity stays unrecorded,
            # so the next turn serves and registers again.
            await self._register(kind)
        self._kubelet_identity = identity

    async def _register(self, kind: ResourceKind) -> None:
        kubelet = self.settings.kubelet_dir / KUBELET_SOCKET
        async with grpc.aio.insecure_channel(f"unix://{kubelet}") as channel:
            stub = pb_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            await stub.Register(
                pb.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.socket_path(kind).name,
                    resource_name=RESOURCE_OF[kind],
                    options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
                ),
                timeout=REGISTER_TIMEOUT_S,
            )
        log.info("registered %s with the kubelet (%s)", RESOURCE_OF[kind], kubelet)

    async def _stop_server(self) -> None:
        servers, self._servers = self._servers, {}
        for listing in self.listings.values():
            await listing.wake_all()
        for server in servers.values():
            await server.stop(grace=0.5)
