"""A simulated day (here a working week) of the team workload with idle release off and on:
pooled GPUs needed for a 60 s p95 slice wait, and the waits, written to
bench/results/sim_idle_release.json. Pure simulation (the controller's scheduler code).

    .venv/bin/python bench/sim_idle_release.py --team 55 --days 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from gpupool.sim import team

RESULTS = Path(__file__).parent / "results" / "sim_idle_release.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--team", type=int, default=55)
    parser.add_argument("--days", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-release", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for idle in (None, args.idle_release):
        started = time.perf_counter()
        report = team.report(args.team, args.days, args.seed, idle_release_s=idle)
        report.pop("tried", None)
        report["sim_seconds"] = round(time.perf_counter() - started, 1)
        rows.append(report)
        print(
            f"idle release {idle or 'off'}: {report['pooled_gpus']} GPUs "
            f"(p95 slice wait {report['p95_slice_wait_s']} s, "
            f"utilisation {report['pooled_utilisation_pct']} %) vs {report['dedicated_gpus']} "
            "dedicated",
            flush=True,
        )
    args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
