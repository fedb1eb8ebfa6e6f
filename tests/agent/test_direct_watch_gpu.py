"""On a machine with an NVIDIA GPU and MPS: a direct slice whose program raises its own MPS
limits and allocates past its lease with torch is stopped by the agent's watch within 2 s.

The agent runs with the NVML backend and starts the GPU's MPS control daemon itself (private
pipe directory under its data dir), so the MPS server is its own and exempt; the test process
never touches CUDA, since every process on a watched GPU that belongs to no lease is stopped.
Run on the GPU box (one command; see bench/gpu/run_direct_watch.sh):

    python3 -m pytest -q -p no:cacheprovider -rs tests/agent/test_direct_watch_gpu.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import ControllerProcess
from tests.timing import scaled

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

LEASE_MIB = 2048
STOP_WITHIN_S = 2.0

# The tenant's program: re-exports larger MPS limits for its child (MPS takes them from the
# client's environment), and the child allocates 1 GiB (within the lease), notes the time,
# then 5 GiB more (past it). The parent prints how the child ended and how long after.
PARENT = r"""
import json, os, subprocess, sys, time
env = dict(os.environ,
           CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100",
           CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=64G")
child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
line = child.stdout.readline()
code = child.wait()
print(json.dumps({"pid": child.pid, "returncode": code,
                  "after_s": time.time() - float(line) if line.strip() else None,
                  "stderr": child.stderr.read()[-2000:]}))
""".replace(
    "CHILD",
    repr("""
import sys, time, torch
held = [torch.ones(1 << 30, dtype=torch.uint8, device="cuda")]
torch.cuda.synchronize()
print(time.time(), flush=True)
held.append(torch.ones(5 << 30, dtype=torch.uint8, device="cuda"))
torch.cuda.synchronize()
print("allocated 6 GiB", file=sys.stderr, flush=True)
time.sleep(60)
"""),
)


def _wait(what: str, check: Any, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def gpu_pool(start_controller, tmp_path: Path) -> Iterator[tuple[ControllerProcess, Path, str]]:  # type: ignore[no-untyped-def]
    from gpupool.agent.backends import detect

    backend = detect("gpu-test")
    if backend is None:
        pytest.skip("no NVIDIA GPU visible through NVML")
    backend.close()
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control is not installed")
    ctl = start_controller(None, lease_ttl_s=600.0)
    # A short path of its own: the MPS daemon's sockets live under it (Unix socket paths stop
    # at 108 bytes; under pytest's tmp_path the daemon did not start), and the worker user must
    # be able to reach them.
    data_dir = Path(tempfile.mkdtemp(prefix="gp-", dir="/tmp")) / "agent"
    data_dir.parent.chmod(0o711)
    log_path = tmp_path / "agent.log"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "gpupool.cli", "--url", ctl.url, "agent",
             "--data-dir", str(data_dir), "--interval", "0.5", "--no-banner"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    daemons: list[int] = []
    try:
        with ctl.client() as client:
            try:
                gpu = _wait(
                    "the agent's GPU with its MPS daemon and attach socket",
                    lambda: next(
                        (
                            g
                            for g in client.get("/gpus").json()
                            if g["index"] == 0
                            and g["telemetry"].get("mps_pipe_dir")
                            and g["telemetry"].get("direct_socket")
                        ),
                        None,
                    ),
                )
            except AssertionError as exc:
                gpus = client.get("/gpus").json()
                raise AssertionError(
                    f"{exc}\n--- GPUs\n{gpus}\n--- agent (exit {agent.poll()})\n"
                    f"{log_path.read_text(errors='replace')[-4000:]}"
                ) from None
        pid_file = Path(gpu["telemetry"]["mps_pipe_dir"]) / "nvidia-cuda-mps-control.pid"
        daemons.append(int(pid_file.read_text()))
        yield ctl, log_path, gpu["uuid"]
    finally:
        agent.terminate()
        agent.wait(timeout=scaled(60))
    assert daemons and not any(_alive(pid) for pid in daemons), (
        "the agent stopped its MPS daemon on the way out"
    )


def _alive(pid: int) -> bool:
    """A daemon that quit stays a zombie until init reaps it (a container's init may not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_direct_program_raising_its_mps_limits_is_stopped_within_2s(gpu_pool) -> None:  # type: ignore[no-untyped-def]
    ctl, agent_log, uuid = gpu_pool
    env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "gpupool.cli", "--url", ctl.url, "run",
         "--compute", "30%", "--memory", f"{LEASE_MIB}MiB", "--node", _node(ctl), "--",
         sys.executable, "-c", PARENT],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    why = f"{done.stdout}\n{done.stderr}\n--- agent\n{agent_log.read_text()[-4000:]}"
    assert done.returncode == 0, why
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["returncode"] in (-15, -9), f"the child was not stopped: {seen}\n{why}"
    assert seen["after_s"] is not None and seen["after_s"] < STOP_WITHIN_S, f"{seen}\n{why}"
    with ctl.client() as client:
        events = client.get("/events", params={"limit": 500}).json()
    stops = [e for e in events if e["kind"] == "direct.process_stopped"]
    assert [(e["data"]["reason"], e["data"]["pid"]) for e in stops] == [
        ("over_memory", seen["pid"])
    ], f"{stops}\n{why}"
    (stop,) = stops
    assert stop["data"]["gpu_uuid"] == uuid and stop["data"]["limit_memory_mib"] == LEASE_MIB
    assert stop["data"]["used_memory_mib"] > LEASE_MIB
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100" in stop["message"], stop


def _node(ctl: ControllerProcess) -> str:
    with ctl.client() as client:
        (node,) = client.get("/nodes").json()
        return str(node["name"])
