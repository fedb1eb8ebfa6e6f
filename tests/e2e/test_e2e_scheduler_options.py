"""`gpupool controller` takes the scheduler's settings and starts with them."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest
from e2e_pool import free_port, gpupool_argv

from tests.timing import scaled

pytestmark = pytest.mark.slow


def test_controller_starts_with_scheduler_settings(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        gpupool_argv(
            "controller", "--port", str(port), "--data-dir", str(tmp_path),
            "--policy", "spread", "--fifo", "--max-queue-wait", "60",
            "--no-preemption", "--preempt-grace", "5", "--physical-ready", "1",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + scaled(60)
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise AssertionError("controller did not start with the scheduler options")
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(20))
