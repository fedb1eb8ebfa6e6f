"""One OpInfo sweep report from the reports of its shards (`bench/opinfo_sweep.py --shard K/N`).

bench/gpu/run_issue21_gpu.sh runs the H200 sweep as parts side by side; this adds their
counts up per pass, recomputes the pass % and the commonest causes, keeps every failure
named, and prints the same summary lines a single run prints.

    python bench/opinfo_sweep_merge.py --label NAME --out bench/results/opinfo_sweep.json \
        part1.json part2.json ...
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

COUNTS = ("samples", "tried", "passed", "mismatches", "errors", "skipped", "ops_not_run")


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' reports as one: counts summed, failures and skips joined."""
    report: dict[str, Any] = {}
    passes = [p for p in ("fp32_forward", "bf16_forward", "fp32_backward") if p in parts[0]]
    for which in passes:
        got = [part[which] for part in parts if which in part]
        merged: dict[str, Any] = {key: sum(g.get(key, 0) for g in got) for key in COUNTS}
        merged["pass_pct"] = round(
            100.0 * merged["passed"] / merged["tried"] if merged["tried"] else 100.0, 3
        )
        merged["seconds"] = max(g["seconds"] for g in got)
        merged["failures"] = [f for g in got for f in g["failures"]]
        causes = Counter(
            f"{f['result']}: {re.sub(r'[0-9]+', 'N', f['cause'])[:160]}" for f in merged["failures"]
        )
        merged["causes"] = [{"cause": c, "samples": n} for c, n in causes.most_common()]
        merged["skips"] = sorted({s for g in got for s in g.get("skips", [])})
        report[which] = merged
    report["sessions_lost"] = sum(part.get("sessions_lost", 0) for part in parts)
    report["machine"] = parts[0].get("machine", "")
    report["settings"] = {
        **{k: v for k, v in parts[0].get("settings", {}).items() if k != "shard"},
        "ops": sum(part.get("settings", {}).get("ops", 0) for part in parts),
        "shards": len(parts),
    }
    return report


def show(report: dict[str, Any]) -> None:
    for which, summary in report.items():
        if not isinstance(summary, dict) or "pass_pct" not in summary:
            continue
        print(f"{which}: {summary['pass_pct']:.2f} % of {summary['tried']} samples pass, "
              f"{summary['mismatches']} mismatches, {summary['errors']} errors, "
              f"{summary['ops_not_run']} ops left out by the deadline")  # fmt: skip
        for failure in summary["failures"]:
            if failure["result"] == "mismatch":
                print(f"  MISMATCH {failure['op']}[{failure['sample']}]: {failure['cause'][:200]}")
        for cause in summary["causes"][:8]:
            print(f"  {cause['samples']:3d} x {cause['cause'][:150]}")
    print(f"sessions lost: {report['sessions_lost']}; {report['machine']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("parts", nargs="+", type=Path)
    options = parser.parse_args()
    parts = []
    for path in options.parts:
        stored = json.loads(path.read_text())
        parts.extend(stored.values())
    if not parts:
        raise SystemExit("no reports to merge")
    report = merge(parts)
    show(report)
    out = Path(options.out)
    stored = json.loads(out.read_text()) if out.exists() else {}
    stored[options.label] = report
    out.write_text(json.dumps(stored, indent=1) + "\n")
    print(f"written to {out} under {options.label!r}")


if __name__ == "__main__":
    main()
