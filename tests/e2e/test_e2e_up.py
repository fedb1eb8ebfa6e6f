"""`gpupool up` runs a controller and its own local agent, and stops both on Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
from e2e_pool import free_port, gpu_count, gpupool_argv

from tests.conftest import AUTH
from tests.timing import scaled

pytestmark = pytest.mark.slow


def test_up_starts_a_local_agent_and_stops_it_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = gpupool_argv(
        "up", "--port", str(port), "--data-dir", str(tmp_path), "--fake", "2xA100-40GB"
    )
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + scaled(60)
        while gpu_count(url) < 2:
            assert up.poll() is None, up.communicate()[0]
            assert time.monotonic() < deadline, "no GPUs registered"
            time.sleep(0.2)
        gpus = httpx.get(url + "/api/v1/gpus", timeout=5, headers=AUTH).json()
        assert {g["simulated"] for g in gpus} == {True}
        agents = psutil.Process(up.pid).children()
        assert agents, "the agent runs as a child of `gpupool up`"
        up.send_signal(signal.SIGINT)
        output, _ = up.communicate(timeout=scaled(30))
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert "SIMULATED GPUs" in output
    assert output.count("SIMULATED GPUs: ") == 1, output
    assert "Traceback" not in output
    _gone, alive = psutil.wait_procs(agents, timeout=10)
    assert not alive
