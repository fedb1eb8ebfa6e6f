"""`gpupool demo`, the README's first command, passes on a machine without GPUs."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_runs_two_jobs_on_one_gpu_and_releases_both() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpupool.cli", "demo", "--seconds", "4"],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "demo passed" in done.stdout
    assert "SIMULATED" in done.stdout
    assert done.stdout.count("ok: loss decreased") == 2
    assert "at the same time" in done.stdout
