"""MPS-enforced slices on a real GPU: compute split, memory limit, and physical leases.

Runs on a GPU server: starts a controller and an agent (NVML backend, which starts one MPS
control daemon per virtual GPU), then uses `gpupool run` as a user would:
  - two direct leases of 30 % and 70 % run bf16 matrix products at the same time;
  - a 4 GiB lease tries to allocate 6 GiB while another lease's program keeps computing;
  - the GPU is switched to physical and a physical lease checks it sees the whole GPU, no MPS.
Writes bench/results/mps_isolation.json.

    python bench/mps_isolation.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _pool import AUTH, GP, ROOT, finish, free_port, wait

RESULTS = ROOT / "bench" / "results" / "mps_isolation.json"
NODE = socket.gethostname()


def run_leased(url: str, lease_args: list[str], program: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, GPUPOOL_URL=url)
    return subprocess.Popen(
        [*GP, "run", *lease_args, "--", sys.executable, *program],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpupool-mps-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = open(work / "pool.log", "w")  # noqa: SIM115 - closed at exit with the processes
    ctl = subprocess.Popen(
        [
            *GP,
            "controller",
            "--port",
            str(port),
            "--data-dir",
            str(work / "ctl"),
            "--lease-ttl",
            "120",
        ],
        stdout=logs,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    agent = None
    result: dict[str, Any] = {}
    try:
        api = httpx.Client(base_url=url + "/api/v1", timeout=30, headers=AUTH)
        wait(lambda: api.get("/health").status_code == 200, 60, "controller")
        agent = subprocess.Popen(
            [
                *GP,
                "agent",
                "--url",
                url,
                "--node",
                NODE,
                "--interval",
                "1",
                "--data-dir",
                str(work / "agent"),
            ],
            stdout=logs,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        wait(lambda: len(api.get("/gpus").json()) > 0, 60, "GPUs to register")
        gpu = api.get("/gpus").json()[0]
        uuid = gpu["uuid"]
        wait(
            lambda: api.get(f"/gpus/{uuid}").json()["telemetry"].get("mps_pipe_dir"),
            60,
            "MPS daemon",
        )
        result["inventory"] = {
            "node": api.get(f"/nodes/{NODE}").json(),
            "gpus": api.get("/gpus").json(),
        }
        print("inventory:", json.dumps(result["inventory"]["gpus"][0])[:400], flush=True)

        # 1. Compute split: 30 % and 70 % at the same time.
        start_at = time.time() + 20
        program = [
            "bench/gpu/matmul.py",
            "--seconds",
            str(args.seconds),
            "--start-at",
            str(start_at),
        ]
        low = run_leased(
            url, ["--compute", "30%", "--memory", "30GiB"], [*program, "--label", "low"]
        )
        high = run_leased(
            url, ["--compute", "70%", "--memory", "30GiB"], [*program, "--label", "high"]
        )
        rc_low, low_out, low_err = finish(low, 180)
        rc_high, high_out, high_err = finish(high, 180)
        if rc_low or rc_high:
            raise RuntimeError(f"split runs failed: {rc_low} {low_err} / {rc_high} {high_err}")
        share_low = 100 * low_out["tflops"] / (low_out["tflops"] + high_out["tflops"])
        result["split"] = {
            "low_pct": 30,
            "high_pct": 70,
            "low_tflops": round(low_out["tflops"], 1),
            "high_tflops": round(high_out["tflops"], 1),
            "share_low_pct": round(share_low, 1),
            "within_5_points": abs(share_low - 30) <= 5,
            "low_per_second": low_out["per_second"],
            "high_per_second": high_out["per_second"],
            "seconds": args.seconds,
        }
        print("split:", json.dumps(result["split"]), flush=True)

        # 2. Memory limit: a 4 GiB lease asks for 6 GiB while another lease keeps computing.
        start_at = time.time() + 15
        other = run_leased(
            url,
            ["--compute", "50%", "--memory", "20GiB"],
            [
                "bench/gpu/matmul.py",
                "--seconds",
                "20",
                "--start-at",
                str(start_at),
                "--label",
                "other",
            ],
        )
        time.sleep(max(0.0, start_at + 5 - time.time()))
        small_ok = run_leased(
            url, ["--compute", "50%", "--memory", "4GiB"], ["bench/gpu/alloc.py", "--gib", "3"]
        )
        rc_ok, ok_out, ok_err = finish(small_ok, 180)
        oversized = run_leased(
            url, ["--compute", "50%", "--memory", "4GiB"], ["bench/gpu/alloc.py", "--gib", "6"]
        )
        rc_big, big_out, big_err = finish(oversized, 180)
        rc_other, other_out, other_err = finish(other, 180)
        per_second = other_out.get("per_second", [])
        steady = statistics.median(per_second) if per_second else 0.0
        result["memory_limit"] = {
            "limit_gib": 4,
            "asked_gib": 6,
            "oversized_alloc_failed": bool(big_out.get("oom")) and rc_big == 3,
            "oversized_error": big_out.get("error"),
            "within_limit_3gib_ok": rc_ok == 0 and ok_out.get("oom") is False,
            "seen_free_gib": big_out.get("free_gib"),
            "seen_total_gib": big_out.get("total_gib"),
            "other_exit_code": rc_other,
            "other_per_second": per_second,
            "other_min_over_median": round(min(per_second) / steady, 2) if per_second else None,
            "stderr": (big_err + ok_err + other_err)[-1500:]
            if (rc_other or rc_ok or rc_big != 3)
            else "",
        }
        result["oversized_alloc_failed"] = result["memory_limit"]["oversized_alloc_failed"]
        result["other_unaffected"] = bool(
            rc_other == 0 and per_second and min(per_second) >= 0.8 * steady
        )
        print("memory:", json.dumps(result["memory_limit"])[:600], flush=True)

        # 3. Physical: the GPU leaves the virtual pool, its MPS daemon stops, a lease gets it whole.
        mode = api.post(f"/gpus/{uuid}/mode", json={"mode": "physical"}).json()["mode"]
        wait(lambda: api.get(f"/gpus/{uuid}").json()["mode"] == "physical", 60, "physical mode")
        wait(
            lambda: not api.get(f"/gpus/{uuid}").json()["telemetry"].get("mps_pipe_dir"),
            30,
            "MPS to stop",
        )
        phys = run_leased(url, ["--physical"], ["bench/gpu/physical_check.py"])
        rc_phys, phys_out, phys_err = finish(phys, 180)
        result["physical"] = {
            "mode_after_switch": mode,
            "exit_code": rc_phys,
            **phys_out,
            "whole_gpu": bool(phys_out)
            and phys_out["total_gib"] >= 0.99 * phys_out["nvml_total_gib"],
            "no_mps": bool(phys_out)
            and not phys_out["mps_env"]
            and not phys_out["this_process_is_mps_client"],
            "stderr": phys_err if rc_phys else "",
        }
        print("physical:", json.dumps(result["physical"]), flush=True)
        api.post(f"/gpus/{uuid}/mode", json={"mode": "virtual"})
        result["events"] = [
            f"{e['kind']} {e['subject']}: {e['message']}"
            for e in api.get("/events", params={"limit": 60}).json()
        ]
    finally:
        for proc in (agent, ctl):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        logs.close()
        result["log_tail"] = (work / "pool.log").read_text()[-3000:]
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    import torch

    result["machine"] = (
        f"{smi}; torch {torch.__version__}; {platform.node()}, {os.cpu_count()} CPUs"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
