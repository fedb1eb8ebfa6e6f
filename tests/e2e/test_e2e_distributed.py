"""torch.distributed across the GPUs of a remote lease: `gpupool run --remote --gpus N --
torchrun --nproc-per-node N` on a client host, one worker per GPU on two GPU hosts (network
namespaces, real TCP), against the same program run locally with gloo on the CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from netpool import NetPool
from pool_checks import FaultRecord

from gpupool.protocol.v1.api import LeaseCreate
from tests.timing import scaled

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

PROGRAMS = Path(__file__).resolve().parents[1] / "torch" / "programs"
DATA_PARALLEL = PROGRAMS / "data_parallel.py"
STEPS = "3"


def torchrun(ranks: int, *program: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(ranks), *program,
    ]  # fmt: skip


def rank_lines(output: str) -> dict[int, dict[str, Any]]:
    """Each rank's JSON line, by rank."""
    found = {}
    for line in output.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            found[record["rank"]] = record
    return found


def local_run(mode: str, ranks: int) -> dict[int, dict[str, Any]]:
    """The same program on this host's CPU: gloo, no gpupool."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for name in ("GPUPOOL_WORKERS", "GPUPOOL_LAZY"):
        env.pop(name, None)
    done = subprocess.run(
        torchrun(ranks, str(DATA_PARALLEL), mode, STEPS),
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(240),
        cwd=str(PROGRAMS),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return rank_lines(done.stdout)


def assert_same_training(
    remote: dict[int, dict[str, Any]], local: dict[int, dict[str, Any]]
) -> None:
    """The op order is the same on both sides (gloo sums the same way on the client and on the
    workers), so losses and parameters are equal, not only close."""
    assert sorted(remote) == sorted(local)
    for rank, mine in remote.items():
        theirs = local[rank]
        assert mine["losses"] == theirs["losses"], (rank, mine["losses"], theirs["losses"])
        assert len(mine["params"]) == len(theirs["params"])
        for got, want in zip(mine["params"], theirs["params"], strict=True):
            assert got == want
        assert theirs["device"] == "cpu" and mine["device"] != "cpu"


def remote_run(netpool: NetPool, mode: str, ranks: int) -> dict[int, dict[str, Any]]:
    done = netpool.cli(
        "run", "--remote", "--gpus", str(ranks), "--compute", "25%", "--memory", "1GiB", "--",
        *torchrun(ranks, str(DATA_PARALLEL), mode, STEPS), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr + netpool.logs()
    return rank_lines(done.stdout)


def two_hosts(netpool: NetPool, fake: str = "1xH100-80GB") -> None:
    netpool.start_controller()
    netpool.start_agent("gpu-a", fake)
    netpool.start_agent("gpu-b", fake)
    netpool.wait_nodes_up("gpu-a", "gpu-b")


def assert_released_and_stopped(netpool: NetPool) -> None:
    leases = netpool.call(lambda api: api.leases(state="all"))
    assert all(lease.state == "released" for lease in leases if lease.access == "remote")
    netpool.wait_for(
        "the workers to stop with their lease",
        lambda: not netpool.worker_pids("gpu-a") and not netpool.worker_pids("gpu-b"),
    )


def test_ddp_on_two_remote_gpus_of_two_hosts_equals_the_local_run(
    netpool: NetPool, record: FaultRecord
) -> None:
    record.fault = "none (distributed baseline): DDP, 2 ranks, one GPU on each of two hosts"
    two_hosts(netpool)
    remote = remote_run(netpool, "ddp", 2)
    leases = netpool.call(lambda api: api.leases(state="all"))
    assert {piece.node for piece in leases[0].slices} == {"gpu-a", "gpu-b"}
    assert [remote[r]["device"] for r in (0, 1)] == ["cuda:0", "cuda:1"]
    assert_same_training(remote, local_run("ddp", 2))
    assert_released_and_stopped(netpool)
    record.survived.append("DDP (small buckets, no_sync accumulation) equal to the local run")


def test_fsdp2_on_two_remote_gpus_of_two_hosts_equals_the_local_run(
    netpool: NetPool, record: FaultRecord
) -> None:
    record.fault = "none (distributed baseline): FSDP2 fully_shard, 2 ranks on two hosts"
    two_hosts(netpool)
    assert_same_training(remote_run(netpool, "fsdp", 2), local_run("fsdp", 2))
    assert_released_and_stopped(netpool)
    record.survived.append("FSDP2 (per-layer fully_shard, accumulation) equal to the local run")


def test_a_four_gpu_lease_waits_whole_then_trains_four_ranks_as_locally(
    netpool: NetPool, record: FaultRecord
) -> None:
    """Gang placement: with one of the four GPUs full, the four-GPU lease takes none of the
    other three and starts no worker; once the GPU is free it gets all four, on both hosts."""
    record.fault = "a four-rank lease that does not fit at first (one GPU full)"
    two_hosts(netpool, "2xH100-80GB")
    gpu = netpool.call(lambda api: api.gpus(node="gpu-b"))[0]
    blocker = netpool.call(
        lambda api: api.create_lease(
            LeaseCreate(gpus=1, node="gpu-b", compute_pct=100, memory=f"{gpu.memory_mib}MiB")
        )
    )
    assert blocker.state == "granted"
    run = netpool.spawn(
        "run", "--remote", "--gpus", "4", "--compute", "25%", "--memory", "1GiB", "--",
        *torchrun(4, str(DATA_PARALLEL), "ddp", STEPS), log="run4.log",
    )  # fmt: skip
    try:
        queued = netpool.wait_for(
            "the four-GPU lease to queue",
            lambda: [x for x in netpool.call(lambda api: api.leases()) if x.gpus == 4],
        )[0]
        assert queued.state == "queued" and not queued.slices
        assert not netpool.worker_pids("gpu-a") and not netpool.worker_pids("gpu-b")
        netpool.call(lambda api: api.release_lease(blocker.id))
        code = run.wait(timeout=scaled(300))
    finally:
        if run.poll() is None:
            run.kill()
    output = (netpool.workdir / "run4.log").read_text()
    assert code == 0, output + netpool.logs()
    lease = netpool.call(lambda api: api.lease(queued.id))
    assert len({piece.gpu_uuid for piece in lease.slices}) == 4
    assert {piece.node for piece in lease.slices} == {"gpu-a", "gpu-b"}
    assert_same_training(rank_lines(output), local_run("ddp", 4))
    assert_released_and_stopped(netpool)
    record.survived.append("queued whole, then four ranks on four GPUs of two hosts, as locally")


def test_a_worker_that_dies_fails_every_rank_naming_the_lease_and_rank(
    netpool: NetPool, record: FaultRecord
) -> None:
    record.fault = "SIGKILL of one worker of a two-rank lease in the middle of all-reduces"
    two_hosts(netpool)
    run = netpool.spawn(
        "run", "--remote", "--gpus", "2", "--compute", "25%", "--memory", "1GiB", "--",
        *torchrun(2, str(PROGRAMS / "collective_loop.py")), log="loop.log",
    )  # fmt: skip
    log = netpool.workdir / "loop.log"
    try:
        netpool.wait_for(
            "both ranks to all-reduce",
            lambda: len([r for r in rank_lines(log.read_text()).values() if r.get("ready")]) == 2,
            timeout_s=180,
        )
        lease = netpool.call(lambda api: api.leases())[0]
        victim = netpool.worker_pids("gpu-b")
        assert len(victim) == 1
        killed_at = time.monotonic()
        os.kill(victim[0], signal.SIGKILL)
        code = run.wait(timeout=scaled(120))
        took_s = time.monotonic() - killed_at
    finally:
        if run.poll() is None:
            run.kill()
    output = log.read_text()
    assert code != 0, output
    errors = {rank: r["error"] for rank, r in rank_lines(output).items() if "error" in r}
    assert sorted(errors) == [0, 1], output + netpool.logs()
    for rank, message in errors.items():
        assert lease.id in message and f"rank {rank}" in message, (rank, message)
    assert took_s < scaled(60)
    assert_released_and_stopped(netpool)
    record.survived.append(
        f"both ranks failed within {took_s:.1f} s naming the lease and their rank; the lease "
        "was released and the other worker stopped"
    )
