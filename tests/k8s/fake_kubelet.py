"""A kubelet for tests that speaks the real device-plugin gRPC protocol (v1beta1).

It serves the Registration service on `<dir>/kubelet.sock`, dials each plugin that registers
on the endpoint the plugin named, and follows its ListAndWatch stream. `restart()` does what
a restarting kubelet does: its socket and every plugin socket in the directory disappear,
then a new `kubelet.sock` appears.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpupool.k8s.deviceplugin.v1beta1 import api_pb2 as pb
from gpupool.k8s.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from tests.timing import scaled


@dataclass
class Plugin:
    """One registered resource, as the kubelet sees it."""

    request: pb.RegisterRequest
    channel: grpc.Channel
    stub: Any
    lists: list[dict[str, str]] = field(default_factory=list)
    """Every device list received on ListAndWatch: device id -> health."""
    stream_ended: bool = False


class FakeKubelet(pb_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.plugins: dict[str, Plugin] = {}
        self.registrations: list[pb.RegisterRequest] = []
        self.changed = threading.Condition()
        self._server: grpc.Server | None = None
        self._streams: list[Any] = []
        self.refuse_next = 0
        """Refuse this many registrations first (as a kubelet does for a taken resource name)."""
        self.refused = 0

    # ---- the Registration service -----------------------------------------------------------

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        with self.changed:
            if self.refuse_next > 0:
                self.refuse_next -= 1
                self.refused += 1
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{request.resource_name} is taken")
        if request.version != "v1beta1":
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version}"
            )
        channel = grpc.insecure_channel(f"unix://{self.directory / request.endpoint}")
        plugin = Plugin(request, channel, pb_grpc.DevicePluginStub(channel))
        with self.changed:
            old = self.plugins.get(request.resource_name)
            self.plugins[request.resource_name] = plugin
            self.registrations.append(request)
            self.changed.notify_all()
        if old is not None:
            old.channel.close()
        # Like the kubelet: after a registration, open the plugin's ListAndWatch stream.
        threading.Thread(target=self._follow, args=(plugin,), daemon=True).start()
        return pb.Empty()

    def _follow(self, plugin: Plugin) -> None:
        stream = plugin.stub.ListAndWatch(pb.Empty())
        self._streams.append(stream)
        try:
            for response in stream:
                with self.changed:
                    plugin.lists.append({d.ID: d.health for d in response.devices})
                    self.changed.notify_all()
        except grpc.RpcError:
            pass
        with self.changed:
            plugin.stream_ended = True
            self.changed.notify_all()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.directory / 'kubelet.sock'}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None
        for stream in self._streams:
            stream.cancel()
        for plugin in self.plugins.values():
            plugin.channel.close()
        with contextlib.suppress(FileNotFoundError):
            (self.directory / "kubelet.sock").unlink()

    def restart(self) -> None:
        """Stop, remove every socket in the directory (as the kubelet does), start again."""
        self.stop()
        for path in self.directory.glob("*.sock"):
            path.unlink()
        with self.changed:
            self.plugins.clear()
        self.start()

    # ---- what tests ask -----------------------------------------------------------------------

    def wait(self, what: str, check: Callable[[], Any], timeout_s: float = 20) -> Any:
        deadline = time.monotonic() + scaled(timeout_s)
        with self.changed:
            while True:
                value = check()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"fake kubelet: timed out waiting for {what}")
                self.changed.wait(timeout=min(left, 0.5))

    def plugin(self, resource: str, timeout_s: float = 20) -> Plugin:
        found: Plugin = self.wait(
            f"{resource} to register", lambda: self.plugins.get(resource), timeout_s
        )
        return found

    def devices(
        self, resource: str, check: Callable[[dict[str, str]], bool], timeout_s: float = 20
    ) -> dict[str, str]:
        """Wait for a device list of `resource` for which `check` holds; return it."""

        def latest() -> tuple[dict[str, str]] | None:
            plugin = self.plugins.get(resource)
            if plugin is None or not plugin.lists:
                return None
            last = plugin.lists[-1]
            return (last,) if check(last) else None

        found: tuple[dict[str, str]] = self.wait(
            f"a matching {resource} device list", latest, timeout_s
        )
        return found[0]
