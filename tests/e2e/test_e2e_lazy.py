"""Lazy acquisition end to end: `gpupool run --remote --lazy` holds no lease while the program
prepares data on the CPU, takes it at the first GPU op (queueing there, shown on stderr), and
trains to the same numbers as a run that held its lease from the start."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from e2e_pool import Pool, finish, gpupool_argv

from tests.timing import scaled

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

PROGRAM = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import torch

    control = Path(sys.argv[1])

    def wait(name):
        (control / f"at-{name}").write_text("")
        while not (control / f"go-{name}").exists():
            time.sleep(0.05)

    torch.manual_seed(0)  # also seeds cuda: before a lazy lease exists
    facts = [torch.cuda.is_available(), torch.cuda.device_count()]
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)) for _ in range(8)]
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    wait("cpu")  # data prepared on the CPU
    model = model.to("cuda")  # the first GPU op
    wait("gpu")
    noise = torch.randn(4, device="cuda")  # the cuda generator, seeded above
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to("cuda")), y.to("cuda"))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    weights = {k: v.detach().cpu().flatten().tolist() for k, v in model.state_dict().items()}
    print(json.dumps({"facts": facts, "noise": noise.cpu().tolist(), "losses": losses,
                      "weights": weights}))
    """
)


class Program:
    """`gpupool run --remote [--lazy] -- python program.py`, stderr in a file to read live."""

    def __init__(self, pool: Pool, workdir: Path, *options: str) -> None:
        workdir.mkdir()
        self.control = workdir
        program = workdir / "program.py"
        program.write_text(PROGRAM)
        self.stderr_path = workdir / "stderr"
        with self.stderr_path.open("w") as stderr:
            self.proc = subprocess.Popen(
                gpupool_argv(
                    "--url", pool.url, "run", "--remote", "--compute", "25%", "--memory",
                    "2GiB", *options, "--", sys.executable, str(program), str(workdir),
                ),
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )  # fmt: skip
        self.pool = pool

    def at(self, name: str, timeout_s: float = 120) -> None:
        self.pool.wait_for(
            f"the program to reach {name}",
            lambda: (self.control / f"at-{name}").exists() or self.proc.poll() is not None,
            timeout_s,
        )
        assert self.proc.poll() is None, self.output()

    def go(self, name: str) -> None:
        (self.control / f"go-{name}").write_text("")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def output(self) -> str:
        out, _ = self.proc.communicate(timeout=scaled(30))
        return out + self.stderr() + self.pool.logs()

    def result(self) -> dict[str, Any]:
        out, _ = self.proc.communicate(timeout=scaled(180))
        assert self.proc.returncode == 0, out + self.stderr() + self.pool.logs()
        return dict(json.loads(next(x for x in out.splitlines() if x.startswith("{"))))

    def stop(self) -> None:
        for name in ("cpu", "gpu"):
            self.go(name)
        finish(self.proc)


def remote_leases(pool: Pool) -> list[dict[str, Any]]:
    return [x for x in pool.json("lease", "ls") if x["access"] == "remote"]


def test_a_lazy_program_holds_no_lease_until_its_first_gpu_op_and_trains_the_same(
    pool: Pool, tmp_path: Path
) -> None:
    lazy = Program(pool, tmp_path / "lazy", "--lazy")
    try:
        lazy.at("cpu")
        assert remote_leases(pool) == [], "CPU data preparation holds no lease"
        lazy.go("cpu")
        lazy.at("gpu")
        held = remote_leases(pool)
        assert len(held) == 1 and held[0]["state"] in ("granted", "active"), held
        lazy.go("gpu")
        got = lazy.result()
    finally:
        lazy.stop()
    assert got["facts"] == [True, 1], "is_available and device_count answer before the lease"
    pool.wait_for("the lease to go back", lambda: remote_leases(pool) == [], 30)
    assert pool.lease(held[0]["id"])["state"] == "released"

    eager = Program(pool, tmp_path / "eager")
    try:
        eager.go("cpu")
        eager.go("gpu")
        expected = eager.result()
    finally:
        eager.stop()
    assert got == expected, "a lazy run computes exactly what a run holding its lease does"


def test_a_queued_lazy_program_shows_its_wait_and_goes_on_when_capacity_frees(
    pool: Pool, tmp_path: Path
) -> None:
    blockers = [
        pool.json("lease", "create", "--compute", "100%", "--memory", "80GiB")["id"]
        for _ in range(2)
    ]
    lazy = Program(pool, tmp_path / "lazy", "--lazy")
    try:
        lazy.go("cpu")
        lazy.go("gpu")
        pool.wait_for("the wait on stderr", lambda: "queued at position #1" in lazy.stderr(), 60)
        queued = [x for x in pool.json("lease", "ls") if x["state"] == "queued"]
        assert len(queued) == 1 and queued[0]["access"] == "remote", queued
        assert lazy.proc.poll() is None, lazy.output()
        pool.ok("lease", "release", blockers[0])
        got = lazy.result()
    finally:
        lazy.stop()
    assert "granted after" in lazy.stderr(), lazy.stderr()
    assert len(got["losses"]) == 8


def test_a_lazy_program_over_its_quota_gets_a_clear_error_at_its_first_gpu_op(
    pool: Pool, tmp_path: Path
) -> None:
    pool.ok("tenant", "create", "small", "--max-memory", "1GiB")
    lazy = Program(pool, tmp_path / "lazy", "--lazy", "--tenant", "small")
    try:
        lazy.at("cpu")  # it ran this far without asking
        lazy.go("cpu")
        lazy.proc.communicate(timeout=scaled(120))
    finally:
        lazy.stop()
    assert lazy.proc.returncode != 0
    err = lazy.stderr()
    assert "gpupool.torch.lazy.LeaseRefused" in err and "quota" in err, err
    assert 'model.to("cuda")' in err, "the traceback points at the first GPU op"
    assert remote_leases(pool) == []
