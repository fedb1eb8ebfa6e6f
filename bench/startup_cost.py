"""CPU a process spends importing what it needs, with and without the cyclic collector.

Every lease start runs a worker (torch), every `gpupool run --remote` program imports torch,
and every controller imports FastAPI, SQLAlchemy and pydantic. gpupool/startup.py turns the
cyclic collector off while they import; this measures what that saves, in fresh interpreters
(user + system CPU of the child, median of --repeat runs, alternating the two variants):

    python bench/startup_cost.py [--repeat 7] [--out bench/results/startup_cost.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

IMPORTS = {
    "worker (torch)": "import gpupool.worker.server",
    "client program (torch + gpupool.torch)": "import torch, gpupool.torch",
    "controller": "import gpupool.controller.server",
    "cli": "import gpupool.cli.main",
}
WITHOUT_GC = "from gpupool.startup import imports_without_gc\nwith imports_without_gc():\n    {}"


def child_cpu(code: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("bench/results/startup_cost.json"))
    args = parser.parse_args()
    child_cpu("import gpupool.worker.server, gpupool.controller.server, gpupool.cli.main")  # warm
    rows = []
    for name, code in IMPORTS.items():
        default, quiet = [], []
        for _ in range(args.repeat):
            default.append(child_cpu(code))
            quiet.append(child_cpu(WITHOUT_GC.format(code)))
        machine = f"{platform.node()} ({platform.machine()}, Python {platform.python_version()})"
        row = {
            "process": name,
            "import_cpu_s": round(statistics.median(default), 3),
            "import_cpu_s_without_gc": round(statistics.median(quiet), 3),
            "saved_pct": round(100 * (1 - statistics.median(quiet) / statistics.median(default))),
            "machine": machine,
        }
        rows.append(row)
        print(json.dumps(row))
    args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
