"""torch.distributed on remote devices: ranks in processes of their own, one worker each (real
CPU workers on loopback); the workers run the collectives among themselves, with the results
of the same program on the CPU with gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch_workers import PEER_SECRET, TOKEN, WorkerHandle, introduce

from gpupool.protocol.v1.dataplane import (
    Connection,
    Kind,
    RemoteError,
    Role,
    connect,
    parse_address,
    role_handshake,
)
from tests.ports import free_port as _free_port
from tests.timing import scaled

LEASE = "lease-dist"
PROGRAMS = Path(__file__).resolve().parent / "programs"
SRC = Path(__file__).resolve().parents[2] / "src"
RANK_MAIN = """
import os, runpy, sys
import gpupool.torch
gpupool.torch.attach(workers=os.environ["TEST_WORKERS"].split(","), token=os.environ["TEST_TOKEN"],
                     lease=os.environ["TEST_LEASE"], rank=int(os.environ["RANK"]))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_ranks(
    ranks: int, program: Path, *args: str, workers: list[WorkerHandle] | None = None
) -> dict[int, dict[str, Any]]:
    """Start `ranks` processes of `program` as torchrun would (RANK, WORLD_SIZE, a store on
    loopback); with `workers`, each attaches to its rank's worker first. Their JSON lines."""
    env = {
        **os.environ,
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, str(program), *args]
    if workers is not None:
        env |= {
            "TEST_WORKERS": ",".join(w.address for w in workers),
            "TEST_TOKEN": TOKEN,
            "TEST_LEASE": LEASE,
        }
        argv = [sys.executable, "-c", RANK_MAIN, str(program), *args]
    procs = [
        subprocess.Popen(
            argv,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(PROGRAMS),
        )
        for r in range(ranks)
    ]
    found: dict[int, dict[str, Any]] = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=scaled(180))
            assert proc.returncode == 0, err[-4000:]
            record = json.loads(out.strip().splitlines()[-1])
            found[record["rank"]] = record
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return found


def lease_workers(
    factory: Callable[..., WorkerHandle], count: int, **options: Any
) -> list[WorkerHandle]:
    workers = [factory(LEASE, **options) for _ in range(count)]
    introduce(workers)
    return workers


def test_every_collective_runs_worker_to_worker_with_the_results_of_gloo(
    worker_factory: Callable[..., WorkerHandle],
) -> None:
    workers = lease_workers(worker_factory, 2)
    remote = run_ranks(2, PROGRAMS / "collectives.py", workers=workers)
    local = run_ranks(2, PROGRAMS / "collectives.py")
    assert [remote[r].pop("device") for r in (0, 1)] == ["cuda:0", "cuda:1"]
    assert [local[r].pop("device") for r in (0, 1)] == ["cpu", "cpu"]
    # A view that is not contiguous goes through a dense copy on the worker: the sum of
    # every rank's (rank + 1) in each of its elements.
    assert [remote[r].pop("strided") for r in (0, 1)] == [[3.0] * 4] * 2
    # recv without a source: gloo says who sent; on remote GPUs it is refused, naming why
    assert local[1].pop("recv_any") == 0
    assert "src=" in remote[1].pop("recv_any")
    # lists that do not fit the group, refused at the call and naming the collective
    refusals = [
        "all_to_all takes 2 inputs and 2 outputs, one per rank",
        "gather: the root's tensors are torch.float32 of shape [2], as the rank's own; one is "
        "torch.float32 of shape [3]",
        "scatter: the root takes 2 tensors, one per rank, not 1",
    ]
    assert [remote[r].pop("refused") for r in (0, 1)] == [refusals, refusals]
    assert remote == local
    assert remote[1]["recv"] == [42.0, 43.0] and remote[0]["all_reduce"] == [0.0, 3.0, 6.0, 9.0]
    assert remote[1]["reduce"] == [0.0, 3.0, 6.0] and remote[0]["reduce_avg"] == [1.5, 2.5, 3.5]
    assert remote[1]["gather"] == [[20.0, 20.0], [21.0, 21.0]] and "gather" not in remote[0]
    assert [remote[r]["scatter"] for r in (0, 1)] == [[30.0, 30.0], [31.0, 31.0]]
    assert remote[1]["all_to_all"] == [[1.0, 1.0], [101.0, 101.0]]
    assert remote[0]["host_gather"] == [[1.0] * 3, [2.0] * 3]


def test_collective_buffers_count_against_the_lease_memory(
    worker_factory: Callable[..., WorkerHandle],
) -> None:
    """A 24 MiB tensor fits a 40 MiB lease, but not with gloo's buffers for reducing it."""
    workers = lease_workers(worker_factory, 2, memory_limit_mib=40)
    results = run_ranks(2, PROGRAMS / "collectives.py", "24", workers=workers)
    for rank, result in results.items():
        assert "OutOfMemoryError" in result["error"], result
        assert "buffers of all_reduce" in result["error"] and LEASE in result["error"], result
        assert rank in (0, 1)
    fits = run_ranks(2, PROGRAMS / "collectives.py", "8", workers=workers)
    assert [fits[r]["sum"] for r in (0, 1)] == [2.0, 2.0]


def _store_request(address: str, token: str, frames: list[list[Any]]) -> list[list[Any]]:
    sock = connect(parse_address(address))
    try:
        sock.settimeout(scaled(10))
        role_handshake(sock, LEASE, token, Role.PEER)
        conn = Connection(sock)
        answers = []
        for frame in frames:
            conn.send(frame)
            answers.append(conn.recv().head())
        return answers
    finally:
        sock.close()


def test_a_group_store_opens_only_to_the_workers_of_the_lease(
    worker_factory: Callable[..., WorkerHandle],
) -> None:
    """The rendezvous store is on the peer path: the tenant's own token does not open it;
    the lease's worker secret (which only agents hand to workers) does."""
    worker = lease_workers(worker_factory, 1)[0]
    with pytest.raises(RemoteError, match="no valid token"):
        _store_request(worker.address, TOKEN, [[Kind.STORE, 1, "g1", "set", "k", b"v"]])
    answers = _store_request(
        worker.address,
        PEER_SECRET,
        [
            [Kind.STORE, 1, "g1", "set", "k", b"v"],
            [Kind.STORE, 2, "g1", "get", "k", 5.0],
            [Kind.STORE, 3, "g1", "add", "n", 3],
        ],
    )
    assert answers == [[Kind.RESULT, 1, None], [Kind.RESULT, 2, b"v"], [Kind.RESULT, 3, 3]]


def test_the_ddp_benchmark_runs_tiny_on_cpu_workers_and_trains_as_locally(tmp_path: Path) -> None:
    """bench/ddp_remote.py (two GPUs in earnest) in its tiny CPU configuration: both phases
    run, and the remote ranks' losses are the local ones."""
    out = tmp_path / "ddp_remote.json"
    bench = Path(__file__).resolve().parents[2] / "bench" / "ddp_remote.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
         "--out", str(out)],
        env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert sorted(report["models"]) == ["gpt2", "resnet50"]
    for result in report["models"].values():
        assert result["remote"]["losses"] == result["local"]["losses"]
        assert result["remote"]["device"] == "cuda:0" and result["local"]["device"] == "cpu"
        assert len(result["remote"]["steps_ms"]) == 2 and result["remote_over_local"] > 0


def test_a_launcher_rank_takes_its_gpu_and_ranks_that_do_not_match_the_lease_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gpupool.torch

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert gpupool.torch.rank_from_environment(2) is None  # no launcher: every GPU, as before
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert gpupool.torch.rank_from_environment(4) == (3, 1)  # one lease for every rank
    assert gpupool.torch.rank_from_environment(2) == (1, 1)  # a lease per host
    with pytest.raises(gpupool.torch.AttachError, match="one rank per GPU"):
        gpupool.torch.rank_from_environment(3)


def test_a_rooted_collective_is_not_sent_to_a_worker_too_old_to_know_it() -> None:
    """A worker of DIST version 1 would drop the stream on "gather" as an unknown action: the
    client says what is missing instead, before anything is sent."""
    from gpupool.torch.distributed import RemoteGroup

    def group(version: int) -> Any:
        return SimpleNamespace(stream=SimpleNamespace(welcome={"dist": version}, device="cuda:1"))

    with pytest.raises(RuntimeError, match=r"gather: the worker of cuda:1 .* version 1.*upgrade"):
        RemoteGroup._needs_rooted(group(1), "gather")
    RemoteGroup._needs_rooted(group(2), "gather")
