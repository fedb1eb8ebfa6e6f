"""Fixtures of the Kubernetes tests: a real controller (tests/conftest.py's start_controller)
and a fake-GPU agent serving the device plugin to a fake kubelet that speaks the real gRPC
protocol."""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_kubelet import FakeKubelet
from k8s_node import START_TIMEOUT_S, K8sNode, gpupool_argv, stop

from gpupool.client.sdk import PoolClient
from tests.timing import scaled


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
        deadline = time.monotonic() + scaled(START_TIMEOUT_S)
        args = ["agent", "--url", url, "--node", "k8s-node-1", "--fake", "2xH100-80GB"]
        args += ["--interval", "0.3", "--data-dir", str(tmp_path / "agent"), "--no-banner"]
        # No API server here: the fake kubelet calls Allocate for pods it does not list.
        args += ["--device-plugin", "--kubelet-dir", str(kubelet_dir), "--vgpu-slots", "4"]
        args += ["--insecure-no-pod-check"]
        with (tmp_path / "agent.log").open("wb") as log:
            agent = subprocess.Popen(gpupool_argv(*args), stdout=log, stderr=subprocess.STDOUT)
        while len(client.gpus()) < 2:
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()
            assert time.monotonic() < deadline, "agent did not register"
            time.sleep(0.1)
        yield K8sNode(url, "k8s-node-1", kubelet, client, tmp_path)
    finally:
        if agent is not None:
            stop(agent)
        client.close()
        kubelet.stop()
        for path in kubelet_dir.glob("*"):
            path.unlink()
        kubelet_dir.rmdir()
