"""A real pool on this machine for GPU benchmarks: a controller and an agent on its GPUs."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gpupool.protocol.v1.tokens import new_token

ROOT = Path(__file__).resolve().parent.parent
GP = [sys.executable, "-m", "gpupool.cli"]

# The controllers a benchmark starts install this admin token ($GPUPOOL_ADMIN_TOKEN), and every
# client it starts or makes sends it ($GPUPOOL_TOKEN).
os.environ.setdefault("GPUPOOL_ADMIN_TOKEN", new_token()[2])
os.environ.setdefault("GPUPOOL_TOKEN", os.environ["GPUPOOL_ADMIN_TOKEN"])
AUTH = {"Authorization": f"Bearer {os.environ['GPUPOOL_TOKEN']}"}

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


@dataclass
class GpuPool:
    url: str
    api: httpx.Client
    work: Path

    def run(
        self, lease_args: list[str], program: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """`gpupool run LEASE_ARGS -- python PROGRAM`, as a user would type it."""
        return subprocess.Popen(
            [*GP, "run", *lease_args, "--", sys.executable, *program],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "GPUPOOL_URL": self.url, **(env or {})},
            cwd=ROOT,
        )


def finish(proc: subprocess.Popen[str], timeout_s: float = 300) -> tuple[int, dict[str, Any], str]:
    """Exit code, the last JSON line the program printed, and the end of its stderr."""
    out, err = proc.communicate(timeout=timeout_s)
    data: dict[str, Any] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            data = json.loads(line)
    return proc.returncode, data, err[-2000:]


@contextlib.contextmanager
def gpu_pool(ttl_s: int = 120) -> Iterator[GpuPool]:
    work = Path(tempfile.mkdtemp(prefix="gpupool-bench-"))
    # mkdtemp makes it 0700: the agent's workers run as the worker user and must reach the MPS
    # pipe directory under it (without that, CUDA runs them outside MPS, at no share at all).
    work.chmod(0o711)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = open(work / "pool.log", "w")  # noqa: SIM115 - closed with the processes
    ctl = subprocess.Popen(
        [*GP, "controller", "--port", str(port), "--data-dir", str(work / "ctl"),
         "--lease-ttl", str(ttl_s)],
        stdout=logs, stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    agent = None
    try:
        api = httpx.Client(base_url=url + "/api/v1", timeout=30, headers=AUTH)
        wait(lambda: api.get("/health").status_code == 200, 60, "controller")
        agent = subprocess.Popen(
            [*GP, "agent", "--url", url, "--interval", "1", "--data-dir", str(work / "agent")],
            stdout=logs, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
        wait(lambda: len(api.get("/gpus").json()) > 0, 60, "GPUs to register")
        uuid = api.get("/gpus").json()[0]["uuid"]
        wait(lambda: api.get(f"/gpus/{uuid}").json()["telemetry"].get("mps_pipe_dir"), 60, "MPS")
        yield GpuPool(url, api, work)
    finally:
        for proc in (agent, ctl):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        logs.close()
        print("pool log tail:\n" + (work / "pool.log").read_text()[-1500:], flush=True)


def machine() -> str:
    import platform

    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    import torch

    return f"{smi}; torch {torch.__version__}; {platform.node()}, {os.cpu_count()} CPUs"
