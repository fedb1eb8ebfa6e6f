"""Faults injected into a real agent's simulated GPUs isolate them in the real controller."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ControllerProcess
from tests.timing import scaled

pytestmark = pytest.mark.slow


def _wait(predicate, timeout_s: float) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while time.monotonic() - start < scaled(timeout_s):
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {scaled(timeout_s):.1f}s")


@pytest.fixture
def pool(start_controller, tmp_path: Path) -> Iterator[tuple[ControllerProcess, str]]:
    ctl = start_controller(None, lease_ttl_s=600.0)
    code = (
        "from pathlib import Path\n"
        "from gpupool.agent.service import AgentSettings, run_agent\n"
        f"run_agent(AgentSettings(controller_url={ctl.url!r}, data_dir=Path({str(tmp_path / 'agent')!r}),"
        " node_name='sim-node', fake_spec='4xH100-80GB', heartbeat_interval_s=0.5))\n"
    )
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115
    agent = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
    try:
        with ctl.client() as client:
            _wait(lambda: len(client.get("/gpus").json()) == 4, 30)
            _wait(lambda: client.get("/nodes/sim-node").json()["agent_url"] is not None, 30)
            agent_url = client.get("/nodes/sim-node").json()["agent_url"]
        yield ctl, agent_url
    finally:
        agent.terminate()
        agent.wait(timeout=scaled(15))
        log.close()


@pytest.mark.parametrize(
    ("fault", "index"),
    [
        ({"kind": "xid", "value": 79}, 0),
        ({"kind": "xid", "value": 48}, 1),
        ({"kind": "ecc"}, 2),
        ({"kind": "overheat", "value": 97}, 3),
    ],
)
def test_injected_fault_isolates_the_gpu_within_five_seconds(
    pool, fault: dict[str, object], index: int
) -> None:
    ctl, agent_url = pool
    with ctl.client() as client:
        uuid = f"GPU-sim-sim-node-{index}"
        lease = client.post(
            "/leases", json={"compute_pct": 100, "memory": "1GiB", "node": "sim-node"}
        ).json()
        victim = lease["slices"][0]["gpu_uuid"]
        injected = httpx.post(f"{agent_url}/agent/v1/faults", json={"index": index, **fault}).json()
        assert injected["gpu_uuid"] == uuid
        took = _wait(lambda: client.get(f"/gpus/{uuid}").json()["mode"] == "isolated", 5.0)
        assert took < scaled(5.0)
        gpu = client.get(f"/gpus/{uuid}").json()
        assert gpu["healthy"] is False and gpu["isolation_reason"]
        if victim == uuid:
            after = client.get(f"/leases/{lease['id']}").json()
            assert (after["state"], after["release_reason"]) == ("released", "its GPU failed")
        for _ in range(6):
            new = client.post("/leases", json={"compute_pct": 50, "memory": "1GiB"}).json()
            assert all(s["gpu_uuid"] != uuid for s in new["slices"])


def test_lost_gpu_is_isolated_and_an_operator_clears_it(pool) -> None:
    ctl, agent_url = pool
    with ctl.client() as client:
        uuid = "GPU-sim-sim-node-0"
        httpx.post(f"{agent_url}/agent/v1/faults", json={"index": 0, "kind": "lost"})
        _wait(lambda: client.get(f"/gpus/{uuid}").json()["mode"] == "isolated", 5.0)
        # The operator clears only after the agent's report has been answered: a report still
        # in flight would isolate the GPU again, as it should.
        _wait(lambda: httpx.get(f"{agent_url}/agent/v1/status").json()["faults_reported"] >= 1, 5.0)
        httpx.post(f"{agent_url}/agent/v1/faults", json={"index": 0, "kind": "clear"})
        assert client.post(f"/gpus/{uuid}/clear").json()["mode"] == "virtual"
        kinds = [e["kind"] for e in client.get("/events", params={"subject": uuid}).json()]
        assert kinds[-2:] == ["gpu.isolated", "gpu.cleared"]


def test_application_xid_does_not_isolate(pool) -> None:
    ctl, agent_url = pool
    with ctl.client() as client:
        httpx.post(f"{agent_url}/agent/v1/faults", json={"index": 1, "kind": "xid", "value": 13})
        time.sleep(scaled(2.0))  # the agent's reports, none of which may isolate
        assert client.get("/gpus/GPU-sim-sim-node-1").json()["mode"] == "virtual"
