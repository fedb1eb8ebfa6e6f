"""The agent's watch of direct slices in its loop: the attach socket is advertised, a lease
granted a moment ago is learned by an early heartbeat, and a breach reaches the controller."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from gpupool.agent.service import Agent
from gpupool.protocol.v1.api import DirectEvents
from gpupool.protocol.v1.attach import token_sha256
from tests.agent.test_service import (
    StubController,
    fake,
    free_port,
    running,
    serving,
    settings_for,
    wait_until,
)

TOKEN = "a-direct-lease-token"


class DirectStub(StubController):
    """A controller stub that names a direct lease once `granted`, and keeps watch events."""

    def __init__(self, gpu_uuid: str) -> None:
        super().__init__()
        self.gpu_uuid = gpu_uuid
        self.granted = False
        self.events: list[DirectEvents] = []
        self.app.post("/api/v1/nodes/{name}/direct-events")(self._direct_events)

    async def _heartbeat(self, name: str, request: Request) -> JSONResponse:
        answer = await super()._heartbeat(name, request)
        if answer.status_code != 200:
            return answer
        direct: dict[str, Any] = {}
        if self.granted:
            direct["l-new"] = {
                "token_sha256": token_sha256(TOKEN),
                "slices": [{"gpu_uuid": self.gpu_uuid, "compute_pct": 25, "memory_mib": 1024}],
            }
        return JSONResponse({"ok": True, "direct": direct})

    async def _direct_events(self, name: str, request: Request) -> JSONResponse:
        self.events.append(DirectEvents.model_validate(await request.json()))
        return JSONResponse({"recorded": len(self.events[-1].events)})


def test_a_new_lease_is_learned_early_and_its_breach_is_reported(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = fake()
        gpu = backend.inventory()[0].uuid
        stub, port = DirectStub(gpu), free_port()
        # Heartbeats are 60 s apart: only the early one an attach asks for can name the lease.
        agent = Agent(settings_for(port, tmp_path, heartbeat_interval_s=60.0), backend)
        async with serving(stub, port), running(agent):
            await wait_until(lambda: len(stub.heartbeats) >= 1, "the first heartbeat")
            socket_path = stub.heartbeats[-1].telemetry[0].direct_socket
            assert socket_path == str(tmp_path / "agent" / "direct.sock")
            stub.granted = True
            code = (
                "import subprocess, sys; from pathlib import Path; "
                "from gpupool.protocol.v1.attach import attach; "
                f"attach(Path({socket_path!r}), 'l-new', {TOKEN!r}); "
                "print(subprocess.Popen([sys.executable, '-c', 'import time; "
                "time.sleep(120)']).pid, flush=True); sys.stdin.read()"
            )
            parent = await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            assert parent.stdout is not None and parent.stdin is not None
            child = int(await asyncio.wait_for(parent.stdout.readline(), 30))
            assert len(stub.heartbeats) == 2, "the attach asked for one early heartbeat"
            backend.set_processes(0, [{"pid": child, "used_memory_mib": 4096}])
            await wait_until(lambda: bool(stub.events), "the breach to reach the controller")
            (event,) = stub.events[0].events
            assert (event.kind, event.reason, event.lease_id, event.pid) == (
                "process_stopped",
                "over_memory",
                "l-new",
                child,
            )
            assert agent.watch.stopped["over_memory"] == 1
            parent.stdin.close()
            await parent.wait()
        assert not (tmp_path / "agent" / "direct.sock").exists(), "the socket goes with the agent"

    asyncio.run(scenario())


def test_a_controller_that_names_no_direct_leases_gets_nothing_stopped(tmp_path: Path) -> None:
    backend = fake()
    stub, port = StubController(), free_port()  # answers {"ok": true}: no "direct" at all
    agent = Agent(settings_for(port, tmp_path), backend)

    async def scenario() -> None:
        async with serving(stub, port), running(agent):
            await wait_until(lambda: len(stub.heartbeats) >= 5, "five heartbeats")

    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        backend.set_processes(0, [{"pid": stray.pid, "used_memory_mib": 1}])
        asyncio.run(scenario())
        assert stray.poll() is None
        assert agent.watch.stopped == {}
    finally:
        stray.kill()
        stray.wait()


def test_the_agent_watch_mode_follows_the_device_plugin(tmp_path: Path) -> None:
    settings = settings_for(free_port(), tmp_path)
    assert settings.watch_mode.value == "enforce"
    with_plugin = settings_for(free_port(), tmp_path, device_plugin_dir=tmp_path)
    assert with_plugin.watch_mode.value == "report"
