"""The team report: how many pooled GPUs keep the p95 wait for a slice under 60 s, against
dedicating 1.5 GPUs to each engineer (`gpupool sim --team N`).

    .venv/bin/python bench/scheduler_team.py   → bench/results/scheduler_team.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from gpupool.sim import team

RESULTS = Path(__file__).parent / "results" / "scheduler_team.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teams", type=int, nargs="+", default=[20, 55, 100])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--days", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.time()
    reports = []
    for size in args.teams:
        for seed in args.seeds:
            report = team.report(size, args.days, seed)
            reports.append(report)
            print(
                f"{size:4} engineers seed {seed}: {report['pooled_gpus']:3} pooled GPUs "
                f"(p95 slice wait {report['p95_slice_wait_s']:.0f} s) vs "
                f"{report['dedicated_gpus']} dedicated",
                flush=True,
            )
    out = {
        "machine": f"{platform.machine()}, CPython {platform.python_version()}",
        "seconds": round(time.time() - started, 1),
        "summary": [
            {
                "engineers": size,
                "dedicated_gpus": next(
                    r["dedicated_gpus"] for r in reports if r["engineers"] == size
                ),
                "pooled_gpus_by_seed": [
                    r["pooled_gpus"] for r in reports if r["engineers"] == size
                ],
            }
            for size in args.teams
        ],
        "reports": reports,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
