"""`gpupool run --remote` needs no code change: the program attaches when it imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch_workers import TOKEN, WorkerHandle

import gpupool.torch

pytestmark = pytest.mark.slow
SITE = Path(gpupool.torch.__file__).parent / "site"

PROGRAM = """
import os, subprocess, sys
import torch
x = torch.arange(4.0, device="cuda")
print(torch.cuda.is_available(), torch.cuda.get_device_name(), (x * 2).sum().item())
print("token left in the environment:", "GPUPOOL_LEASE_TOKEN" in os.environ)
"""


def test_an_unchanged_program_runs_on_the_lease(
    workers: list[WorkerHandle], tmp_path: Path
) -> None:
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITE_RAN'] = '1'\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SITE), str(tmp_path)]),
        "GPUPOOL_LEASE": "lease-t",
        "GPUPOOL_WORKERS": workers[0].address,
        "GPUPOOL_LEASE_TOKEN": TOKEN,
        "OMP_NUM_THREADS": "1",
    }
    program = (
        PROGRAM + "print('shadowed sitecustomize ran:', os.environ.get('SHADOWED_SITE_RAN'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert (
        lines[0].startswith("True ") and "gpupool worker" in lines[0] and lines[0].endswith(" 12.0")
    )
    assert lines[1] == "token left in the environment: False"
    assert lines[2] == "shadowed sitecustomize ran: 1"


def test_without_a_lease_the_hook_imports_nothing() -> None:
    env = {**os.environ, "PYTHONPATH": str(SITE)}
    env.pop("GPUPOOL_WORKERS", None)
    program = "import sys; print('torch' in sys.modules, 'gpupool' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == "False False", result.stderr[-2000:]
