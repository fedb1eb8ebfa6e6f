"""The device plugin's Allocate on a real GPU: do the env and mounts it returns hold a
container to its slice?

On a GPU server: a controller, an agent on the real GPUs serving the device plugin, and the
test kubelet (tests/k8s/fake_kubelet.py, the real gRPC protocol). Two claims, 30 % and 70 %
of one GPU, are bound in turn and allocated as the kubelet would; each Allocate answer
becomes the environment of a bf16 matmul process (the mounts' container paths mapped back
to their host paths, as the container runtime would), both run at once, and the TFLOP/s
split is measured. Writes bench/results/k8s_mps_allocate.json.

    python bench/k8s_mps_allocate.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "k8s"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # fake_kubelet uses tests.timing
from _pool import GP, finish, free_port, machine, wait
from fake_kubelet import FakeKubelet

from gpupool.client.sdk import PoolClient
from gpupool.k8s.deviceplugin.v1beta1 import api_pb2 as pb
from gpupool.protocol.v1.api import LeaseCreate
from gpupool.protocol.v1.k8s import ClaimCreate

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "k8s_mps_allocate.json"
NODE = socket.gethostname()


def allocate(
    kubelet: FakeKubelet, pool: PoolClient, claim: str, pct: int, gib: int
) -> dict[str, Any]:
    """Bind a claim on this node, then Allocate one vgpu device as the kubelet does."""
    made = pool.create_claim(
        ClaimCreate(
            claim=claim,
            node=NODE,
            pod=f"bench/{claim}",
            request=LeaseCreate(compute_pct=pct, memory=f"{gib}GiB"),
        )
    )
    gpu = made.lease.slices[0].gpu_uuid
    plugin = kubelet.plugin("gpupool.io/vgpu")
    devices = kubelet.devices("gpupool.io/vgpu", lambda d: any(k.startswith(gpu) for k in d))
    answer = plugin.stub.Allocate(
        pb.AllocateRequest(
            container_requests=[
                pb.ContainerAllocateRequest(
                    devices_ids=[next(d for d in devices if d.startswith(gpu))]
                )
            ]
        ),
        timeout=30,
    )
    given = answer.container_responses[0]
    env = dict(given.envs)
    for mount in given.mounts:  # what the container runtime would do: container path → host
        for key, value in env.items():
            if value == mount.container_path:
                env[key] = mount.host_path
    return {"claim": claim, "lease": made.lease.id, "gpu": gpu, "env": env,
            "mounts": [(m.container_path, m.host_path) for m in given.mounts]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument(
        "--fake", help="simulated GPUs (e.g. 1xH100-80GB): check the plumbing up to Allocate"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpupool-k8s-"))
    kubelet_dir = Path(tempfile.mkdtemp(prefix="kubelet-"))
    kubelet = FakeKubelet(kubelet_dir)
    kubelet.start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = open(work / "pool.log", "w")  # noqa: SIM115 - closed with the processes
    ctl = subprocess.Popen(
        [*GP, "controller", "--port", str(port), "--data-dir", str(work / "ctl"),
         "--lease-ttl", "600"],
        stdout=logs, stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    agent = None
    result: dict[str, Any] = {}
    try:
        api = httpx.Client(base_url=url + "/api/v1", timeout=30)
        wait(lambda: api.get("/health").status_code == 200, 60, "controller")
        agent = subprocess.Popen(
            [*GP, "agent", "--url", url, "--node", NODE, "--interval", "1",
             "--data-dir", str(work / "agent"),
             "--device-plugin", "--kubelet-dir", str(kubelet_dir),
             *(["--fake", args.fake, "--no-banner"] if args.fake else [])],
            stdout=logs, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
        wait(lambda: len(api.get("/gpus").json()) > 0, 60, "GPUs to register")
        uuid = api.get("/gpus").json()[0]["uuid"]
        if not args.fake:
            mps = lambda: api.get(f"/gpus/{uuid}").json()["telemetry"].get("mps_pipe_dir")  # noqa: E731
            wait(mps, 60, "MPS")
        pool = PoolClient(url, actor="bench")
        small = allocate(kubelet, pool, "c-bench-small-0001", 30, 8)
        large = allocate(kubelet, pool, "c-bench-large-0001", 70, 20)
        if args.fake:
            print(json.dumps({"small": small, "large": large}, indent=2))
            return
        start_at = time.time() + 15
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "bench/gpu/matmul.py",
                    "--seconds",
                    str(args.seconds),
                    "--start-at",
                    str(start_at),
                    "--label",
                    one["claim"],
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env={
                    **{k: v for k, v in os.environ.items() if not k.startswith("CUDA_")},
                    **one["env"],
                },
            )
            for one in (small, large)
        ]
        runs = [finish(p) for p in procs]
        tflops = [r[1].get("tflops", 0.0) for r in runs]
        total = sum(tflops) or 1.0
        result = {
            "machine": machine(),
            "same_gpu": small["gpu"] == large["gpu"],
            "claims": [
                {k: one[k] for k in ("claim", "lease", "gpu", "mounts")}
                | {
                    "env": {
                        k: v for k, v in one["env"].items() if k.startswith(("CUDA_", "GPUPOOL_"))
                    },
                    "tflops": round(t, 1),
                    "share_pct": round(100 * t / total, 1),
                    "exit": run[0],
                    "stderr_tail": run[2][-300:] if run[0] else "",
                }
                for one, t, run in zip((small, large), tflops, runs, strict=True)
            ],
        }
    finally:
        for proc in (agent, ctl):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        kubelet.stop()
        logs.close()
        print("pool log tail:\n" + (work / "pool.log").read_text()[-1500:], flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
