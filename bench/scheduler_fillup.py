"""Fill-up curves of every placement policy on generated traces.

Each trace is a synthetic cluster and pod list shaped like public production GPU traces
(`gpupool sim generate`); each policy replays it under the fill-up protocol of
`gpupool sim fillup`. Summaries: allocated GPU % when 100 % and 130 % of capacity has
arrived, and the mean allocated % over arrived 1..130 % (the ideal is 61.9).

    .venv/bin/python bench/scheduler_fillup.py   → bench/results/scheduler_fillup.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from gpupool.core.placement import DEFAULT_POLICY, POLICY_NAMES
from gpupool.sim import generate
from gpupool.sim.fillup import run_fillup

RESULTS = Path(__file__).parent / "results" / "scheduler_fillup.json"
TRACES = {
    "openb-like": ("openb", 300, 2500),
    "sharing-heavy": ("sharing", 200, 2500),
    "multi-gpu-heavy": ("multi", 300, 1500),
    "model-constrained": ("constrained", 300, 2500),
}
IDEAL_MEAN = (sum(range(1, 101)) + 30 * 100) / 130


def summarise(curve: list[dict[str, float]]) -> dict[str, float]:
    def at(pct: int) -> float:
        return next(p["allocated_pct"] for p in curve if p["arrived_pct"] >= pct)

    window = [p["allocated_pct"] for p in curve if p["arrived_pct"] <= 130]
    frag90 = next(p["frag_pct"] for p in curve if p["arrived_pct"] >= 90)
    return {
        "allocated_at_90": at(90),
        "allocated_at_100": at(100),
        "allocated_at_130": at(130),
        "mean_allocated_1_130": round(sum(window) / len(window), 3),
        "frag_at_90": frag90,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.time()
    traces: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    for t_index, (name, (mix, servers, pods_n)) in enumerate(TRACES.items()):
        nodes = generate.cluster(servers, 100 + t_index)
        pods = generate.pods(pods_n, mix, 200 + t_index)
        traces[name] = {
            "mix": mix,
            "servers": servers,
            "gpus": sum(n.gpus for n in nodes),
            "pods": pods_n,
            "regenerate": f"gpupool sim generate DIR --servers {servers} --pods {pods_n} "
            f"--mix {mix} --seed {100 + t_index}  (pods use seed+1; "
            "here the pod seed is " + str(200 + t_index) + ")",
        }
        for policy in POLICY_NAMES:
            for seed in args.seeds:
                began = time.time()
                result = run_fillup(nodes, pods, policy, seed)
                curve = result["curve"]
                runs.append(
                    {
                        "trace": name,
                        "policy": policy,
                        "seed": seed,
                        "capacity_gpus": result["capacity_gpus"],
                        "seconds": round(time.time() - began, 2),
                        "summary": summarise(curve),
                        "curve": {
                            key: [p[key] for p in curve]
                            for key in ("arrived_pct", "allocated_pct", "frag_pct")
                        },
                    }
                )
                s = runs[-1]["summary"]
                print(
                    f"{name:18} {policy:12} seed {seed}: at 100% {s['allocated_at_100']:6.2f}  "
                    f"at 130% {s['allocated_at_130']:6.2f}  mean {s['mean_allocated_1_130']:6.2f}"
                    f"  ({runs[-1]['seconds']} s)",
                    flush=True,
                )
    ranking: dict[str, list[dict[str, Any]]] = {}
    for name in TRACES:
        rows = []
        for policy in POLICY_NAMES:
            mine = [r["summary"] for r in runs if r["trace"] == name and r["policy"] == policy]
            rows.append(
                {
                    "policy": policy,
                    **{key: round(sum(m[key] for m in mine) / len(mine), 3) for key in mine[0]},
                }
            )
        rows.sort(key=lambda r: -r["mean_allocated_1_130"])
        ranking[name] = rows
    out = {
        "default_policy": DEFAULT_POLICY,
        "ideal_mean_allocated_1_130": round(IDEAL_MEAN, 3),
        "seeds": args.seeds,
        "machine": f"{platform.machine()}, CPython {platform.python_version()}",
        "seconds": round(time.time() - started, 1),
        "traces": traces,
        "ranking": ranking,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out) + "\n")
    print(json.dumps(ranking, indent=1))


if __name__ == "__main__":
    main()
