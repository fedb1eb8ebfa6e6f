"""The agent loop against a real HTTP controller stub on loopback: register, heartbeat, outages."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import gpupool.agent.service as service
from gpupool.agent.backends import FakeBackend
from gpupool.agent.service import Agent, AgentSettings, NoGpuFound
from gpupool.protocol.v1.api import GpuInventory, NodeHeartbeat, NodeRegister
from tests.ports import free_port
from tests.timing import scaled

NODE = "node-a"
WAIT_S = 10.0  # generous: the suite must pass on a loaded two-core machine


class StubController:
    """Just enough of the controller's node API to watch an agent; validates what it receives."""

    def __init__(self) -> None:
        self.registrations: list[NodeRegister] = []
        self.heartbeats: list[NodeHeartbeat] = []
        self.known: set[str] = set()
        self.refuse_with: int | None = None
        self.app = FastAPI()
        self.app.post("/api/v1/nodes")(self._register)
        self.app.post("/api/v1/nodes/{name}/heartbeat")(self._heartbeat)

    async def _register(self, request: Request) -> JSONResponse:
        if self.refuse_with is not None:
            return JSONResponse({"error": "conflict", "detail": "refused"}, self.refuse_with)
        body = NodeRegister.model_validate(await request.json())
        self.registrations.append(body)
        self.known.add(body.name)
        return JSONResponse({"name": body.name}, 201)

    async def _heartbeat(self, name: str, request: Request) -> JSONResponse:
        if name not in self.known:
            return JSONResponse({"error": "not_found", "detail": f"no node {name!r}"}, 404)
        self.heartbeats.append(NodeHeartbeat.model_validate(await request.json()))
        return JSONResponse({"ok": True})


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def serving(stub: StubController, port: int) -> AsyncIterator[None]:
    config = uvicorn.Config(
        stub.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started or task.done(), "the stub controller to start")
    if task.done():
        task.result()
    try:
        yield
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT_S)


@asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        yield
    finally:
        stop.set()
        # Stopping is prompt: at most one event poll and one HTTP call in flight.
        await asyncio.wait_for(task, WAIT_S)


def settings_for(port: int, tmp_path: Path, **overrides: Any) -> AgentSettings:
    values: dict[str, Any] = {
        "controller_url": f"http://127.0.0.1:{port}",
        "node_name": NODE,
        "data_dir": tmp_path / "agent",
        "heartbeat_interval_s": 0.05,
        "retry_max_s": 0.2,
    }
    values.update(overrides)
    return AgentSettings(**values)


def fake(spec: str = "2xH100-80GB") -> FakeBackend:
    return FakeBackend.from_spec(spec, node_name=NODE)


# ---- the happy path ----------------------------------------------------------------------


def test_agent_registers_its_node_then_heartbeats(tmp_path: Path) -> None:
    async def scenario() -> None:
        stub, port = StubController(), free_port()
        backend = fake()
        backend.set_utilization(1, 40)
        agent = Agent(settings_for(port, tmp_path, address="10.0.0.7"), backend)
        async with serving(stub, port), running(agent):
            await wait_until(lambda: len(stub.heartbeats) >= 3, "three heartbeats")
        (registration,) = stub.registrations
        assert registration.name == NODE and registration.backend == "fake"
        assert registration.address == "10.0.0.7"
        assert registration.cpu_count and registration.memory_mib and registration.memory_mib > 0
        assert registration.driver_version == "simulated"
        assert [g.uuid for g in registration.gpus] == ["GPU-sim-node-a-0", "GPU-sim-node-a-1"]
        assert all(g.simulated for g in registration.gpus)
        beat = stub.heartbeats[-1]
        assert [t.utilization_pct for t in beat.telemetry] == [0.0, 40.0]
        assert {
            "cpu_pct",
            "load1",
            "memory_used_mib",
            "memory_total_mib",
            "net_sent_bytes",
            "net_recv_bytes",
            "disk_used_mib",
            "disk_total_mib",
        } <= beat.host.keys()
        assert beat.host["disk_total_mib"] > 0
        assert agent.heartbeats_sent >= 3

    asyncio.run(scenario())


def test_banner_says_the_gpus_are_simulated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        stub, port = StubController(), free_port()
        agent = Agent(settings_for(port, tmp_path), fake("1xL4-24GB"))
        async with serving(stub, port), running(agent):
            await wait_until(lambda: bool(stub.registrations), "a registration")

    with caplog.at_level(logging.INFO, logger="gpupool.agent"):
        asyncio.run(scenario())
    banner = [r.getMessage() for r in caplog.records if "SIMULATED GPUs" in r.getMessage()]
    assert banner == [
        "SIMULATED GPUs (fake backend): 1 x NVIDIA L4-24GB (simulated) (24576 MiB). "
        "Not real hardware: nothing runs on them."
    ]


def test_health_events_are_logged_and_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> Agent:
        stub, port = StubController(), free_port()
        backend = fake()
        agent = Agent(settings_for(port, tmp_path), backend)
        async with serving(stub, port), running(agent):
            await wait_until(lambda: bool(stub.heartbeats), "a heartbeat")
            backend.inject_xid(1, 48)
            backend.inject_ecc(1)
            await wait_until(lambda: len(agent.health_events) == 2, "two health events")
            seen = len(stub.heartbeats)
            await wait_until(lambda: len(stub.heartbeats) > seen, "a later heartbeat")
            assert stub.heartbeats[-1].telemetry[1].ecc_uncorrected == 1
        return agent

    with caplog.at_level(logging.WARNING, logger="gpupool.agent"):
        agent = asyncio.run(scenario())
    assert [(e.kind, e.value) for e in agent.health_events] == [
        ("xid", 48),
        ("ecc_uncorrected", 1),
    ]
    assert any("Xid 48" in r.getMessage() for r in caplog.records)


# ---- the controller forgets, refuses, goes away ------------------------------------------


def test_agent_registers_again_when_the_controller_forgets_the_node(tmp_path: Path) -> None:
    async def scenario() -> None:
        stub, port = StubController(), free_port()
        agent = Agent(settings_for(port, tmp_path), fake())
        async with serving(stub, port), running(agent):
            await wait_until(lambda: len(stub.heartbeats) >= 2, "heartbeats")
            stub.known.clear()  # as after `gpupool node rm` or a fresh database
            await wait_until(lambda: len(stub.registrations) == 2, "a second registration")
            seen = len(stub.heartbeats)
            await wait_until(lambda: len(stub.heartbeats) > seen, "heartbeats after it")
        assert stub.registrations[1].gpus == stub.registrations[0].gpus
        assert agent.registrations == 2

    asyncio.run(scenario())


def test_agent_keeps_trying_while_the_controller_refuses_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        stub, port = StubController(), free_port()
        stub.refuse_with = 409
        agent = Agent(settings_for(port, tmp_path), fake())
        async with serving(stub, port), running(agent):
            await wait_until(
                lambda: any("HTTP 409" in r.getMessage() for r in caplog.records), "a refusal"
            )
            stub.refuse_with = None
            await wait_until(lambda: bool(stub.heartbeats), "heartbeats once accepted")

    with caplog.at_level(logging.ERROR, logger="gpupool.agent"):
        asyncio.run(scenario())
    refusals = [r for r in caplog.records if "HTTP 409" in r.getMessage()]
    assert len(refusals) == 1  # the same refusal is logged once, not every retry


def test_agent_survives_losing_the_controller_and_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        stub, port = StubController(), free_port()
        agent = Agent(settings_for(port, tmp_path), fake())
        async with running(agent):
            async with serving(stub, port):
                await wait_until(lambda: len(stub.heartbeats) >= 2, "heartbeats")
            await wait_until(lambda: agent.controller_reachable is False, "the outage noticed")
            seen = len(stub.heartbeats)
            # Several failed tries pass (backoff is capped at 0.2 s here) before it returns.
            await asyncio.sleep(0.5)
            assert len(stub.heartbeats) == seen
            async with serving(stub, port):  # the same port, the node still known
                await wait_until(lambda: len(stub.heartbeats) > seen + 1, "heartbeats again")
                assert agent.controller_reachable is True
                messages = [r.getMessage() for r in caplog.records]
        assert len(stub.registrations) == 1
        assert sum("unreachable" in m for m in messages) == 1
        assert sum("reachable again" in m for m in messages) == 1

    with caplog.at_level(logging.WARNING, logger="gpupool.agent"):
        asyncio.run(scenario())


def test_agent_registers_with_a_controller_that_came_back_empty(tmp_path: Path) -> None:
    async def scenario() -> None:
        first, port = StubController(), free_port()
        agent = Agent(settings_for(port, tmp_path), fake())
        async with running(agent):
            async with serving(first, port):
                await wait_until(lambda: bool(first.heartbeats), "heartbeats")
            await wait_until(lambda: agent.controller_reachable is False, "the outage noticed")
            second = StubController()  # restarted without its state
            async with serving(second, port):
                await wait_until(lambda: len(second.heartbeats) >= 2, "heartbeats to the new one")
            assert [r.name for r in second.registrations] == [NODE]

    asyncio.run(scenario())


def test_agent_started_before_the_controller_registers_once_it_is_up(tmp_path: Path) -> None:
    async def scenario() -> None:
        stub, port = StubController(), free_port()
        agent = Agent(settings_for(port, tmp_path), fake())
        async with running(agent):
            await wait_until(lambda: agent.controller_reachable is False, "a failed first try")
            async with serving(stub, port):
                await wait_until(lambda: bool(stub.heartbeats), "registration and a heartbeat")
        assert len(stub.registrations) == 1

    asyncio.run(scenario())


# ---- settings and start-up ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"node_name": "bad name"}, "node name"),
        ({"node_name": ""}, "node name"),
        ({"heartbeat_interval_s": 0}, "heartbeat interval"),
        ({"controller_url": "127.0.0.1:8080"}, "http://"),
    ],
)
def test_bad_settings_are_refused(tmp_path: Path, overrides: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        settings_for(1, tmp_path, **overrides)


def test_agent_without_gpus_or_fake_spec_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "detect", lambda node_name: None)
    agent = Agent(settings_for(free_port(), tmp_path))
    with pytest.raises(NoGpuFound, match="fake spec"):
        asyncio.run(agent.run(asyncio.Event()))


def test_fake_spec_in_settings_gives_simulated_gpus_named_after_the_node(tmp_path: Path) -> None:
    settings = settings_for(1, tmp_path, fake_spec="2xA100-40GB")
    backend = service.open_backend(settings)
    assert backend.simulated
    assert [g.uuid for g in backend.inventory()] == ["GPU-sim-node-a-0", "GPU-sim-node-a-1"]


def test_run_agent_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    """A real process: banner, an unreachable controller, then SIGTERM ends it with status 0."""
    log_path = tmp_path / "agent.log"
    code = (
        "from pathlib import Path\n"
        "from gpupool.agent.service import AgentSettings, run_agent\n"
        f"run_agent(AgentSettings(controller_url='http://127.0.0.1:{free_port()}',"
        f" node_name='proc', fake_spec='1xL4-24GB', data_dir=Path({str(tmp_path)!r}),"
        " heartbeat_interval_s=0.1, retry_max_s=0.2))\n"
    )
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=log_file, stdout=log_file)
        try:
            deadline = time.monotonic() + scaled(20)
            while "unreachable" not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=WAIT_S) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    output = log_path.read_text()
    assert "SIMULATED GPUs (fake backend): 1 x NVIDIA L4-24GB (simulated)" in output
    assert "agent proc stopped" in output


def test_changed_inventory_is_sent_by_registering_again(tmp_path: Path) -> None:
    class ShrinkingBackend(FakeBackend):
        """Loses its last GPU on demand, as when a card is pulled or hidden."""

        shrunk = False

        def inventory(self) -> list[GpuInventory]:
            gpus = super().inventory()
            return gpus[:-1] if self.shrunk else gpus

    async def scenario() -> None:
        stub, port = StubController(), free_port()
        backend = ShrinkingBackend(FakeBackend.from_spec("2xL4-24GB", node_name=NODE).inventory())
        agent = Agent(settings_for(port, tmp_path), backend)
        async with serving(stub, port), running(agent):
            await wait_until(lambda: bool(stub.heartbeats), "a heartbeat")
            backend.shrunk = True
            await wait_until(lambda: len(stub.registrations) == 2, "a second registration")
        assert [len(r.gpus) for r in stub.registrations] == [2, 1]

    asyncio.run(scenario())


def test_ready_workers_default_to_one_per_gpu_but_none_under_mps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ready worker takes its MPS share at hand-over, a path not yet measured on a GPU: by
    default GPUs under MPS start each worker for its lease, whose limits were."""
    monkeypatch.delenv("GPUPOOL_READY_WORKERS", raising=False)
    default = AgentSettings(controller_url="http://127.0.0.1:1", data_dir=tmp_path)
    assert default.ready_workers is None
    assert (default.ready_per_gpu(mps=False), default.ready_per_gpu(mps=True)) == (1, 0)
    chosen = AgentSettings(controller_url="http://127.0.0.1:1", data_dir=tmp_path, ready_workers=2)
    assert (chosen.ready_per_gpu(mps=False), chosen.ready_per_gpu(mps=True)) == (2, 2)
    monkeypatch.setenv("GPUPOOL_READY_WORKERS", "3")
    from_env = AgentSettings(controller_url="http://127.0.0.1:1", data_dir=tmp_path)
    assert from_env.ready_per_gpu(mps=True) == 3
    with pytest.raises(ValueError, match=r"0\.\.8"):
        AgentSettings(controller_url="http://127.0.0.1:1", data_dir=tmp_path, ready_workers=9)
