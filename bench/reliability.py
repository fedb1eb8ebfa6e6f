"""Reliability report: runs the fault-injection suite and writes what each fault left behind.

The scenarios are the CI tests themselves (tests/e2e/test_faults.py, and the multi-host
tests in tests/e2e/test_multihost.py): each injects one fault into a pool spread over
network namespaces (controller, two agents, a client), checks that nothing granted or
queued was lost, granted twice or brought back, and records what survived. This script runs
them with the record directory set, and turns the records and the outcomes into a table.
Needs root (network namespaces); PostgreSQL for the PostgreSQL variant.

    sudo .venv/bin/python bench/reliability.py   → bench/results/reliability.md (+ .json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SUITE = ["tests/e2e/test_faults.py", "tests/e2e/test_multihost.py"]


def _safe(name: str) -> str:
    """The file name tests/e2e/pool_checks.FaultRecord.save gives a test's record."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def run_suite(records: Path, junit: Path, extra: list[str]) -> int:
    env = {**os.environ, "GPUPOOL_RELIABILITY_DIR": str(records)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            f"--junitxml={junit}", *SUITE, *extra]  # fmt: skip
    return subprocess.run(argv, cwd=ROOT, env=env).returncode


def outcomes(junit: Path) -> dict[str, tuple[str, str, float]]:
    """test name -> (passed/failed/skipped, message, seconds)."""
    out: dict[str, tuple[str, str, float]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "?")
        seconds = float(case.get("time", "0"))
        state, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                state = "skipped" if tag == "skipped" else "failed"
                message = (
                    (found.get("message") or "").splitlines()[0][:300]
                    if found.get("message")
                    else ""
                )
                break
        out[name] = (state, message, seconds)
    return out


def machine() -> str:
    cpus = os.cpu_count()
    with open("/proc/meminfo") as meminfo:
        mem_kib = int(meminfo.readline().split()[1])
    return (
        f"{platform.node()}: {cpus} CPUs, {mem_kib // 1024 // 1024} GiB, "
        f"Linux {platform.release()}, Python {platform.python_version()}"
    )


def render(results: list[dict[str, Any]], when: str, host: str, code: int) -> str:
    lost_total = sum(len(r["lost"]) for r in results)
    failed = [r for r in results if r["outcome"] == "failed"]
    verdict = (
        "nothing"
        if lost_total == 0 and not failed
        else f"{lost_total} item(s), {len(failed)} failed test(s)"
    )
    lines = [
        "# Reliability: faults injected, what survived, what was lost",
        "",
        f"Produced by `bench/reliability.py` on {when} ({host}); every row is one test of",
        "tests/e2e/test_faults.py or tests/e2e/test_multihost.py, run on a pool spread over",
        "network namespaces (controller, agents `gpu-a` and `gpu-b` with simulated GPUs, a",
        "client), real processes talking TCP over veth pairs and a bridge.",
        "",
        f"**Lost: {verdict}.** "
        f"{len(results)} scenarios, {sum(r['outcome'] == 'passed' for r in results)} passed, "
        f"{sum(r['outcome'] == 'skipped' for r in results)} skipped (pytest exit {code}).",
        "",
        "| fault | setup | survived | lost | outcome |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        survived = "<br>".join(f"• {s}" for s in r["survived"]) or "—"
        lost = "<br>".join(r["lost"]) or ("nothing" if r["outcome"] == "passed" else "—")
        outcome = r["outcome"] + (f": {r['message']}" if r["message"] else "")
        outcome += f" ({r['seconds']:.0f} s)"
        cells = [r["fault"], r["setup"] or "—", survived, lost, outcome]
        lines.append(
            "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
        )
    lines += [
        "",
        "What the checks mean: *lost* collects any lease answered granted or queued that is",
        "missing or went back to the queue after the fault, any request recorded twice, any",
        "released lease that came back, and any GPU whose grants exceed its capacity or differ",
        "from the controller's own count. A failed test shows its assertion instead.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", help="only the scenarios matching this pytest expression")
    parser.add_argument("--out", type=Path, default=RESULTS / "reliability.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpupool-reliability-") as tmp:
        records, junit = Path(tmp, "records"), Path(tmp, "junit.xml")
        records.mkdir()
        started = time.time()
        code = run_suite(records, junit, ["-k", args.k] if args.k else [])
        states = outcomes(junit) if junit.exists() else {}
        results = []
        for name, (state, message, seconds) in states.items():
            path = records / f"{_safe(name)}.json"
            saved = json.loads(path.read_text()) if path.exists() else {}
            results.append(
                {
                    "test": name,
                    "fault": saved.get("fault", name),
                    "setup": saved.get("setup", ""),
                    "survived": saved.get("survived", []),
                    "lost": saved.get("lost", []),
                    "outcome": state,
                    "message": message,
                    "seconds": seconds,
                }
            )
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(results, when, machine(), code))
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {"when": when, "machine": machine(), "pytest_exit": code, "scenarios": results},
            indent=1,
        )
    )
    print(f"wrote {args.out} ({len(results)} scenarios, pytest exit {code})")
    sys.exit(code)


if __name__ == "__main__":
    main()
