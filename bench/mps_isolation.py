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
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pool import ROOT, finish, gpu_pool, machine, wait

RESULTS = ROOT / "bench" / "results" / "mps_isolation.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result: dict[str, Any] = {}
    with gpu_pool() as pool:
        api = pool.api
        gpu = api.get("/gpus").json()[0]
        uuid = gpu["uuid"]
        result["inventory"] = {
            "node": api.get(f"/nodes/{gpu['node']}").json(),
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
        low = pool.run(["--compute", "30%", "--memory", "30GiB"], [*program, "--label", "low"])
        high = pool.run(["--compute", "70%", "--memory", "30GiB"], [*program, "--label", "high"])
        (rc_low, low_out, low_err), (rc_high, high_out, high_err) = finish(low), finish(high)
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
        other = pool.run(
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
        small_ok = pool.run(
            ["--compute", "50%", "--memory", "4GiB"], ["bench/gpu/alloc.py", "--gib", "3"]
        )
        rc_ok, ok_out, ok_err = finish(small_ok)
        oversized = pool.run(
            ["--compute", "50%", "--memory", "4GiB"], ["bench/gpu/alloc.py", "--gib", "6"]
        )
        rc_big, big_out, big_err = finish(oversized)
        rc_other, other_out, other_err = finish(other)
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
        phys = pool.run(["--physical"], ["bench/gpu/physical_check.py"])
        rc_phys, phys_out, phys_err = finish(phys)
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
    result["machine"] = machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
