"""The plugin waits for a kubelet that is not there yet, and registers again after a refusal."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_kubelet import FakeKubelet

from gpupool.k8s.deviceplugin.server import ClaimError, DevicePlugins, PluginSettings
from gpupool.k8s.devices import GpuView, NodeView
from gpupool.k8s.resources import ResourceKind
from gpupool.protocol.v1.k8s import ClaimOut, WaitingPod


class NoClaims:
    """No controller behind this plugin: registration and listing need none."""

    async def allocate(
        self, kind: ResourceKind, devices: int, waiting: list[WaitingPod] | None
    ) -> ClaimOut:
        raise ClaimError("no controller in this test")

    async def pending(self) -> ClaimOut | None:
        return None


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="kubelet-"))
    yield directory
    for path in directory.glob("*"):
        path.unlink()
    directory.rmdir()


def run_plugin(
    directory: Path,
) -> tuple[threading.Thread, asyncio.AbstractEventLoop, asyncio.Event]:
    view = NodeView(gpus=(GpuView("GPU-x", 0, "virtual"),), simulated=True)
    plugins = DevicePlugins(
        PluginSettings(kubelet_dir=directory, slots_per_gpu=2, watch_interval_s=0.1),
        lambda: view,
        NoClaims(),
        None,
    )
    ready = threading.Event()
    holder: dict[str, object] = {}

    def main() -> None:
        async def serve() -> None:
            holder["loop"] = asyncio.get_running_loop()
            holder["stop"] = stop = asyncio.Event()
            ready.set()
            await plugins.run(stop)

        asyncio.run(serve())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    ready.wait(10)
    return thread, holder["loop"], holder["stop"]  # type: ignore[return-value]


def test_plugin_waits_for_the_kubelet_and_retries_a_refused_registration(kubelet_dir: Path) -> None:
    thread, loop, stop = run_plugin(kubelet_dir)
    kubelet = FakeKubelet(kubelet_dir)
    try:
        time.sleep(0.5)  # no kubelet yet: the plugin serves nothing and does not fail
        assert not list(kubelet_dir.glob("gpupool-*.sock"))
        assert thread.is_alive()
        kubelet.refuse_next = 1
        kubelet.start()
        kubelet.plugin("gpupool.io/vgpu")
        kubelet.plugin("gpupool.io/gpu")
        assert kubelet.refused == 1
        devices = kubelet.devices("gpupool.io/vgpu", lambda d: len(d) == 2)
        assert devices == {"GPU-x-slot0": "Healthy", "GPU-x-slot1": "Healthy"}
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        kubelet.stop()
    assert not thread.is_alive()
