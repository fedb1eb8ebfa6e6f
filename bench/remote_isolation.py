"""Remote leases on a real GPU keep their limits whatever their program's environment says.

Two remote leases (30 % and 70 %, 4 GiB and 20 GiB) run programs that set CUDA_MPS_*,
CUDA_VISIBLE_DEVICES, LD_PRELOAD and LD_LIBRARY_PATH themselves; the 4 GiB one also tries to
allocate 6 GiB. The worker the agent started holds the real CUDA context under the lease's
limits, so neither variable reaches it. Writes bench/results/remote_isolation.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pool import ROOT, finish, gpu_pool, machine

RESULTS = ROOT / "bench" / "results" / "remote_isolation.json"


def main() -> None:
    result: dict[str, object] = {}
    with gpu_pool() as pool:
        start_at = time.time() + 45
        program = ["bench/gpu/remote_alloc.py", "--seconds", "15", "--start-at", str(start_at)]
        # Set before the program starts, too: what a tenant would try against LD_PRELOAD-style
        # limiters. The CLI passes them through; the worker never sees them.
        escape = {
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=140G",
            "LD_PRELOAD": "/tmp/not-a-limiter.so",
            "LD_LIBRARY_PATH": "/tmp/not-the-driver",
        }
        low = pool.run(
            ["--remote", "--compute", "30%", "--memory", "4GiB"], [*program, "--alloc"], escape
        )
        high = pool.run(["--remote", "--compute", "70%", "--memory", "20GiB"], program, escape)
        (rc_low, low_out, low_err), (rc_high, high_out, high_err) = finish(low), finish(high)
        result["exit_codes"] = [rc_low, rc_high]
        result["low"], result["high"] = low_out, high_out
        if low_out.get("tflops") and high_out.get("tflops"):
            share = 100 * low_out["tflops"] / (low_out["tflops"] + high_out["tflops"])
            result["share_low_pct"] = round(share, 1)
        result["memory_limit_held"] = bool(low_out.get("alloc_6gib_refused"))
        result["stderr"] = (low_err + high_err)[-2000:] if (rc_low or rc_high) else ""
        result["events"] = [
            f"{e['kind']} {e['subject']}: {e['message']}"
            for e in pool.api.get("/events", params={"limit": 30}).json()
        ]
    result["machine"] = machine()
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "events"}, indent=1))


if __name__ == "__main__":
    main()
