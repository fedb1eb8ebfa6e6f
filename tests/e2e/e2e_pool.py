"""A real pool on loopback for end-to-end tests: `gpupool controller` and `gpupool agent --fake`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import AUTH

FAKE_SPEC = "2xH100-80GB"
ACTOR = "admin:bootstrap"
"""Who the e2e commands act as: the admin token every test controller installs."""
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def gpupool_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpupool.cli", *args]


@dataclass
class Pool:
    url: str
    workdir: Path
    controller: subprocess.Popen[bytes]
    agent: subprocess.Popen[bytes]

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run `gpupool --url URL ARGS` as a user would, in a shell of its own."""
        env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_URL"}
        return subprocess.run(
            gpupool_argv("--url", self.url, *args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )

    def ok(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        done = self.cli(*args, timeout=timeout)
        assert done.returncode == 0, f"{args}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done

    def json(self, *args: str) -> Any:
        return json.loads(self.ok(*args, "-o", "json").stdout)

    def spawn(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            gpupool_argv("--url", self.url, *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def lease(self, lease_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.json("lease", "show", lease_id)
        return result

    def wait_for(self, what: str, check: Any, timeout_s: float = 20) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
            for log in sorted(self.workdir.glob("*.log"))
        )


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/api/v1/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def gpu_count(url: str) -> int:
    try:
        return len(httpx.get(url + "/api/v1/gpus", timeout=2, headers=AUTH).json())
    except (httpx.HTTPError, ValueError):
        return 0


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
