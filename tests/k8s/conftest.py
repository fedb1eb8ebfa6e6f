"""Fixtures of the Kubernetes tests: a real controller (tests/conftest.py's start_controller)
and a fake-GPU agent serving the device plugin to a fake kubelet that speaks the real gRPC
protocol."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fake_kubelet import FakeKubelet

from gpupool.client.sdk import PoolClient

START_TIMEOUT_S = 60.0


def _gpupool(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpupool.cli", *args]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class K8sNode:
    url: str
    node: str
    kubelet: FakeKubelet
    client: PoolClient
    workdir: Path

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            _gpupool("--url", self.url, *args), capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
        return done

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.workdir.glob("*.log"))
        )


@pytest.fixture
def k8s_node(start_controller: Any, tmp_path: Path) -> Iterator[K8sNode]:
    """Controller + agent (2 fake H100s, device plugin on) + fake kubelet, all real processes.

    The kubelet directory lives in a short /tmp path: Unix socket paths are limited to 107 bytes.
    """
    kubelet_dir = Path(tempfile.mkdtemp(prefix="kubelet-"))
    kubelet = FakeKubelet(kubelet_dir)
    kubelet.start()
    ctl = start_controller(None)
    url = ctl.url
    client = PoolClient(url, actor="k8s-test")
    agent: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        args = ["agent", "--url", url, "--node", "k8s-node-1", "--fake", "2xH100-80GB"]
        args += ["--interval", "0.3", "--data-dir", str(tmp_path / "agent"), "--no-banner"]
        args += ["--device-plugin", "--kubelet-dir", str(kubelet_dir), "--vgpu-slots", "4"]
        with (tmp_path / "agent.log").open("wb") as log:
            agent = subprocess.Popen(_gpupool(*args), stdout=log, stderr=subprocess.STDOUT)
        while len(client.gpus()) < 2:
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()
            assert time.monotonic() < deadline, "agent did not register"
            time.sleep(0.1)
        yield K8sNode(url, "k8s-node-1", kubelet, client, tmp_path)
    finally:
        if agent is not None:
            _stop(agent)
        client.close()
        kubelet.stop()
        for path in kubelet_dir.glob("*"):
            path.unlink()
        kubelet_dir.rmdir()
