"""An NCCL group of world size 1 through a remote lease on a one-GPU machine (issue 24).

One CUDA worker on GPU 0 (a 4 GiB lease); the rank is a client without a GPU
(CUDA_VISIBLE_DEVICES=) that attaches as rank 0 and calls `init_process_group("nccl")`,
which forms the worker's NCCL communicator. Runs, each against the same program on the
client's CPU with gloo:
  - tests/torch/programs/collectives.py: every collective (all_reduce with each op,
    broadcast, all_gather(_into_tensor), reduce_scatter_tensor, barrier, async work);
  - tests/torch/programs/data_parallel.py ddp / fsdp: DDP and FSDP2 steps (GPU against CPU
    arithmetic: compared with a tolerance);
  - the worker's view of the group (backend, the NCCL buffers charged to the lease).
Prints one summary line per check and a JSON line `SUMMARY {...}`.

    python bench/gpu/nccl_remote.py      (bash bench/gpu/run_issue24.sh runs it)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
PROGRAMS = ROOT / "tests" / "torch" / "programs"
LEASE, TOKEN, PEER = "issue24", "issue24-token", "issue24-peer"
RANK_MAIN = """
import os, runpy, sys
import gpupool.torch
gpupool.torch.attach(workers=[os.environ["BENCH_WORKER"]], token=os.environ["BENCH_TOKEN"],
                     lease=os.environ["BENCH_LEASE"], rank=0)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
GROUP_FACTS = """
import json, torch, torch.distributed as dist
from gpupool.torch import runtime
dist.init_process_group("nccl")
t = torch.ones(1 << 20, device="cuda")
dist.all_reduce(t)
stats = runtime.stream(0).stats()
print(json.dumps({"rank": 0, "dist": stats["dist"], "sum": t[0].item(),
                  "memory_limit_bytes": stats["memory_limit_bytes"],
                  "memory_held_bytes": stats["memory_held_bytes"],
                  "worker": runtime.stream(0).name}))
dist.destroy_process_group()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_rank(argv: list[str], worker: str | None) -> dict[str, Any]:
    env = {
        **os.environ,
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }  # fmt: skip
    command = [sys.executable, *argv]
    if worker is not None:
        env |= {"BENCH_WORKER": worker, "BENCH_TOKEN": TOKEN, "BENCH_LEASE": LEASE}
        command = [sys.executable, "-c", RANK_MAIN, *argv]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=150, cwd=str(PROGRAMS)
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def max_diff(a: Any, b: Any) -> float:
    if isinstance(a, list):
        return max([max_diff(x, y) for x, y in zip(a, b, strict=True)], default=0.0)
    if isinstance(a, int | float):
        return abs(float(a) - float(b))
    return 0.0 if a == b else float("inf")


def main() -> int:
    from gpupool.protocol.v1.dataplane import (
        WorkerCredentials,
        parse_address,
        send_control,
        start_worker_process,
    )

    # BENCH_WORKER_DEVICE=cpu tries the script where there is no GPU (gloo on the worker).
    device = os.environ.get("BENCH_WORKER_DEVICE", "cuda:0")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    credentials = WorkerCredentials.generate(TOKEN, PEER)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": str(ROOT / "src")}
    proc, ready = start_worker_process(
        LEASE, credentials, env=env, device=device, memory_limit_mib=4096,
        log_file=Path(os.environ.get("OUT", "/tmp")) / "nccl_worker.log",
    )  # fmt: skip
    address = str(ready.address)
    send_control(parse_address(address), LEASE, credentials.control,
                 {"op": "peers", "endpoints": [address]})  # fmt: skip
    summary: dict[str, Any] = {}
    ok = True
    try:
        facts_program = Path(tempfile.mkdtemp(prefix="issue24-")) / "group_facts.py"
        facts_program.write_text(GROUP_FACTS)
        facts = run_rank([str(facts_program)], address)
        groups = list(facts["dist"].values())
        summary["group"] = facts
        good = facts["sum"] == 1.0 and len(groups) == 1 and groups[0]["backend"] == backend
        ok &= good
        print(f"group: {'ok' if good else 'FAILED'} {facts['worker']}, {groups}, "
              f"held {facts['memory_held_bytes'] / 2**20:.1f} MiB of "
              f"{facts['memory_limit_bytes'] / 2**20:.0f} MiB", flush=True)  # fmt: skip
        remote = run_rank([str(PROGRAMS / "collectives.py")], address)
        local = run_rank([str(PROGRAMS / "collectives.py")], None)
        strided = remote.pop("strided", None)
        remote.pop("device"), local.pop("device")
        good = remote == local and strided == [1.0] * 4
        ok &= good
        summary["collectives"] = {"remote": remote, "local": local, "equal": good}
        print(f"collectives: {'equal to gloo on the CPU' if good else 'DIFFER'}: {remote}",
              flush=True)  # fmt: skip
        for mode in ("ddp", "fsdp"):
            argv = [str(PROGRAMS / "data_parallel.py"), mode, "3"]
            remote, local = run_rank(argv, address), run_rank(argv, None)
            diff = max(max_diff(remote["losses"], local["losses"]),
                       max_diff(remote["params"], local["params"]))  # fmt: skip
            good = diff < 1e-4
            ok &= good
            summary[mode] = {"losses_remote": remote["losses"], "losses_local": local["losses"],
                             "max_abs_diff": diff, "device": remote["device"]}  # fmt: skip
            print(f"{mode}: {'ok' if good else 'DIFFER'} max |remote - local| {diff:.2e}, "
                  f"losses {remote['losses']} (local {local['losses']})", flush=True)  # fmt: skip
    except Exception as exc:
        ok = False
        summary["error"] = str(exc)[-3000:]
        print(f"FAILED: {exc}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    summary["ok"] = ok
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
