"""`gpupool run --remote`: an unchanged PyTorch program uses GPUs through workers the agent starts."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest
from e2e_pool import Pool

from tests.timing import scaled

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

PROGRAM = textwrap.dedent(
    """
    import json, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 8).to("cuda"), torch.randn(64, 1).cuda()
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    moved = torch.ones(4, device="cuda:0").to(f"cuda:{torch.cuda.device_count() - 1}") * 3
    print(json.dumps({"available": torch.cuda.is_available(), "count": torch.cuda.device_count(),
                      "first": losses[0], "last": losses[-1], "moved": moved.sum().item(),
                      "param_device": str(next(model.parameters()).device)}))
    """
)


def _result(stdout: str) -> dict[str, object]:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("{")))


@pytest.mark.parametrize("gpus", [1, 2])
def test_remote_run_trains_on_leased_workers_and_gives_them_back(pool: Pool, tmp_path: Path, gpus: int) -> None:
    program = tmp_path / "train.py"
    program.write_text(PROGRAM)
    import sys

    done = pool.cli(
        "run", "--remote", "--gpus", str(gpus), "--compute", "25%", "--memory", "2GiB", "--",
        sys.executable, str(program), timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = _result(done.stdout)
    assert result["available"] is True and result["count"] == gpus
    assert result["param_device"] == "cuda:0"
    assert result["moved"] == 12.0
    assert result["last"] < result["first"]
    leases = pool.json("lease", "ls", "--all")
    remote = [lease for lease in leases if lease["access"] == "remote"]
    assert remote and all(lease["state"] == "released" for lease in remote)
    assert all(piece["endpoint"] for piece in remote[0]["slices"])
    assert "token" not in remote[0] or remote[0]["token"] is None, "the token is never shown again"


def test_workers_stop_when_the_lease_ends(pool: Pool, tmp_path: Path) -> None:
    import subprocess

    program = tmp_path / "sleep.py"
    program.write_text("import torch, time\ntorch.ones(1, device='cuda').sum().item()\ntime.sleep(60)\n")
    import sys

    run = pool.spawn("run", "--remote", "--compute", "10%", "--memory", "1GiB", "--", sys.executable, str(program))
    try:
        deadline = time.monotonic() + scaled(90)
        lease = None
        while time.monotonic() < deadline:
            live = [x for x in pool.json("lease", "ls") if x["access"] == "remote"]
            if live and live[0]["slices"] and live[0]["slices"][0]["endpoint"]:
                lease = live[0]
                break
            time.sleep(0.3)
        assert lease is not None, "the worker never started"
        pool.ok("lease", "release", "--operator", lease["id"])
        assert run.wait(timeout=scaled(60)) != 0, "the program lost its lease and was stopped"
        deadline = time.monotonic() + scaled(30)
        while time.monotonic() < deadline:
            ps = subprocess.run(["pgrep", "-f", f"gpupool.worker --lease {lease['id']}"], capture_output=True)
            if ps.returncode != 0:
                break
            time.sleep(0.3)
        else:
            raise AssertionError("the worker outlived its lease")
    finally:
        if run.poll() is None:
            run.kill()
