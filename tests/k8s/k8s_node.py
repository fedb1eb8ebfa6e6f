"""A GPU node as the Kubernetes tests see it: controller URL, node name, fake kubelet, SDK client."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from fake_kubelet import FakeKubelet

from gpupool.client.sdk import PoolClient
from tests.timing import scaled

START_TIMEOUT_S = 60.0


def gpupool_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpupool.cli", *args]


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=scaled(10))
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
            gpupool_argv("--url", self.url, *args),
            capture_output=True,
            text=True,
            timeout=scaled(60),
        )
        assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
        return done

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.workdir.glob("*.log"))
        )
