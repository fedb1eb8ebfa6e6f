#!/usr/bin/env python3
"""Record what NVML answers on this GPU machine to a JSON fixture that the agent's tests replay."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpupool.agent.backends.nvml import NvmlBackend, NvmlError, ReplayNvml, record_fixture

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "tests/agent/fixtures/nvml_h200.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH)
    parser.add_argument(
        "--event-wait-ms",
        type=int,
        default=1000,
        help="how long to wait for NVML events (Xid, ECC) while recording",
    )
    parser.add_argument("--note", default="", help="free text stored in the fixture")
    args = parser.parse_args(argv)
    try:
        fixture = record_fixture(args.path, event_wait_ms=args.event_wait_ms, note=args.note)
    except ImportError:
        print("nvidia-ml-py is not installed (pip install nvidia-ml-py)", file=sys.stderr)
        return 2
    except NvmlError as exc:
        print(f"NVML failed: {exc.message}", file=sys.stderr)
        return 1
    calls = fixture["calls"]
    print(f"recorded {len(calls) if isinstance(calls, dict) else 0} NVML answers to {args.path}")
    # Prove at once that the fixture replays into the same inventory.
    backend = NvmlBackend(api=ReplayNvml.load(args.path))
    for gpu in backend.inventory():
        print(f"  GPU {gpu.index}: {gpu.model}, {gpu.memory_mib} MiB, {gpu.uuid}, {gpu.pci_bus_id}")
    print(f"  driver {backend.driver_version()}, CUDA {backend.cuda_version()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
