"""Elastic remote leases end to end: a training program keeps running, with the same weights,
while its lease is migrated, resized, swapped out when idle, and moved off a drained node."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_pool import FAKE_SPEC, Pool, finish, gpupool_argv, stop

from tests.timing import scaled

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

PROGRAM = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import torch

    def train(device, pauses, control):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g))
                for _ in range(12)]
        losses = []
        for step, (x, y) in enumerate(data):
            if step in pauses:
                (control / f"paused-{step}").write_text("")
                while not (control / f"go-{step}").exists():
                    time.sleep(0.05)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        weights = {k: v.detach().cpu().flatten().tolist() for k, v in model.state_dict().items()}
        return {"losses": losses, "weights": weights}

    if __name__ == "__main__":
        control = Path(sys.argv[1])
        pauses = {int(p) for p in sys.argv[2].split(",") if p}
        print(json.dumps(train("cuda", pauses, control)))
    """
)


def reference(tmp_path: Path) -> dict[str, Any]:
    """The same program, uninterrupted, on this process's CPU."""
    namespace: dict[str, Any] = {"__name__": "reference"}
    exec(compile(PROGRAM, "program", "exec"), namespace)
    result: dict[str, Any] = namespace["train"]("cpu", set(), tmp_path)
    return result


def assert_same_training(got: dict[str, Any], expected: dict[str, Any]) -> None:
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6
    )
    for key, values in expected["weights"].items():
        torch.testing.assert_close(
            torch.tensor(got["weights"][key]), torch.tensor(values), rtol=1e-5, atol=1e-6
        )


class Run:
    """`gpupool run --remote -- python program.py` with pauses the test releases."""

    def __init__(self, pool: Pool, tmp_path: Path, pauses: list[int], *options: str) -> None:
        self.pool = pool
        self.control = tmp_path / "control"
        self.control.mkdir()
        program = tmp_path / "train.py"
        program.write_text(PROGRAM)
        self.proc = pool.spawn(
            "run", "--remote", "--compute", "25%", "--memory", "2GiB", *options, "--",
            sys.executable, str(program), str(self.control), ",".join(map(str, pauses)),
        )  # fmt: skip

    def paused(self, step: int, timeout_s: float = 120) -> None:
        self.pool.wait_for(
            f"the program to pause at step {step}",
            lambda: (self.control / f"paused-{step}").exists() or self._died(),
            timeout_s,
        )
        assert self.proc.poll() is None, self.output()

    def go(self, step: int) -> None:
        (self.control / f"go-{step}").write_text("")

    def lease(self) -> dict[str, Any]:
        live = [x for x in self.pool.json("lease", "ls") if x["access"] == "remote"]
        assert len(live) == 1, live
        return live[0]

    def result(self) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=scaled(180))
        assert self.proc.returncode == 0, out + err + self.pool.logs()
        return json.loads(next(line for line in out.splitlines() if line.startswith("{")))

    def _died(self) -> bool:
        return self.proc.poll() is not None

    def output(self) -> str:
        out, err = self.proc.communicate(timeout=scaled(10))
        return out + err + self.pool.logs()

    def kill(self) -> None:
        """After a failure: let the program run out (it waits for go files), then stop it."""
        for step in range(64):
            self.go(step)
        finish(self.proc)


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for run in started:
        run.kill()


def test_migration_and_resizes_mid_training_give_the_same_weights(
    pool: Pool, tmp_path: Path, runs: list[Run]
) -> None:
    run = Run(pool, tmp_path, [3, 6, 9])
    runs.append(run)
    run.paused(3)
    lease = run.lease()
    first_gpu = lease["slices"][0]["gpu_uuid"]
    moved = pool.json("lease", "migrate", lease["id"])
    assert moved["state"] == "active"
    assert moved["slices"][0]["gpu_uuid"] != first_gpu
    run.go(3)
    run.paused(6)
    grown = pool.json("lease", "resize", lease["id"], "--memory", "3GiB")
    assert grown["state"] != "migrating" and grown["slices"][0]["memory_mib"] == 3072
    run.go(6)
    run.paused(9)
    pool.json("lease", "resize", lease["id"], "--compute", "50%")
    pool.wait_for("the resize to a fresh worker", lambda: run.lease()["state"] == "active", 120)
    assert run.lease()["slices"][0]["compute_pct"] == 50
    run.go(9)
    assert_same_training(run.result(), reference(tmp_path))


def test_an_idle_lease_is_swapped_out_and_restored_at_its_next_op(
    pool: Pool, tmp_path: Path, runs: list[Run]
) -> None:
    run = Run(pool, tmp_path, [4], "--idle-timeout", "1")
    runs.append(run)
    run.paused(4)
    lease = run.lease()
    pool.wait_for("the idle lease to be swapped out", lambda: run.lease()["state"] == "swapped", 60)
    gpus = pool.json("gpus")
    assert all(lease["id"] not in gpu["leases"] for gpu in gpus), "the slice is back in the pool"
    run.go(4)
    assert_same_training(run.result(), reference(tmp_path))
    ended = pool.lease(lease["id"])
    assert ended["state"] == "released"


@pytest.fixture
def second_agent(pool: Pool) -> Iterator[subprocess.Popen[bytes]]:
    args = ["--url", pool.url, "--fake", FAKE_SPEC, "--interval", "0.3", "--node", "node-b"]
    args += ["--data-dir", str(pool.workdir / "agent-b")]
    with (pool.workdir / "agent-b.log").open("wb") as log:
        agent = subprocess.Popen(gpupool_argv("agent", *args), stdout=log, stderr=subprocess.STDOUT)
    try:
        pool.wait_for("node-b's GPUs", lambda: len(pool.json("gpus")) >= 4, 60)
        yield agent
    finally:
        stop(agent)


def test_node_drain_moves_a_running_program_away_and_undrain_returns_the_node(
    pool: Pool, tmp_path: Path, runs: list[Run], second_agent: subprocess.Popen[bytes]
) -> None:
    run = Run(pool, tmp_path, [4])
    runs.append(run)
    run.paused(4)
    node = run.lease()["slices"][0]["node"]
    started = time.monotonic()
    drained = pool.ok("node", "drain", node, "--timeout", "120", timeout=180)
    assert "is empty" in drained.stdout, drained.stdout
    after = run.lease()
    assert after["slices"][0]["node"] != node and after["state"] == "active"
    assert all(g["mode"] == "draining" or g["mode"] == "virtual" for g in pool.json("gpus"))
    run.go(4)
    assert_same_training(run.result(), reference(tmp_path))
    pool.ok("node", "undrain", node)
    modes = {g["uuid"]: g["mode"] for g in pool.json("gpus") if g["node"] == node}
    assert set(modes.values()) == {"virtual"}, modes
    assert time.monotonic() - started < scaled(300)


def test_switching_a_gpu_to_physical_moves_its_remote_lease_away_and_the_gpu_switches(
    pool: Pool, tmp_path: Path, runs: list[Run]
) -> None:
    run = Run(pool, tmp_path, [5])
    runs.append(run)
    run.paused(5)
    gpu = run.lease()["slices"][0]["gpu_uuid"]
    pool.ok("gpu", "mode", gpu, "physical")
    pool.wait_for(
        "the GPU to empty and switch",
        lambda: pool.json("gpu", "show", gpu)["mode"] == "physical",
        120,
    )
    assert run.lease()["slices"][0]["gpu_uuid"] != gpu and run.lease()["state"] == "active"
    run.go(5)
    assert_same_training(run.result(), reference(tmp_path))
