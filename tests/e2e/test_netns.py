"""The namespace harness cleans up after itself, and after runs that were killed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import NAME_PREFIX, Fabric, sweep_orphans, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_namespaces_of_a_killed_run_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = f"{NAME_PREFIX}{dead.pid}-test-x"
    subprocess.run(["ip", "netns", "add", orphan], check=True)
    fabric = Fabric(tmp_path)  # sweeps first
    try:
        fabric.add_host("a")
        assert orphan not in _namespaces()
        assert sweep_orphans() == [], "this run's namespaces are its own"
        assert {fabric.switch, fabric.hosts["a"].netns} <= _namespaces()
    finally:
        fabric.close()
        subprocess.run(["ip", "netns", "del", orphan], capture_output=True)
    assert not {n for n in _namespaces() if n.startswith(fabric.prefix)}


def test_cut_host_is_unreachable_until_healed(tmp_path: Path) -> None:
    fabric = Fabric(tmp_path)
    try:
        a, b = fabric.add_host("a"), fabric.add_host("b")
        server = b.popen(
            [sys.executable, "-m", "http.server", "--bind", b.address, "8000"], tmp_path / "s.log"
        )
        probe = [sys.executable, "-c",
                 f"import socket; socket.create_connection(('{b.address}', 8000), timeout=2)"]  # fmt: skip
        for _ in range(100):
            if a.run(probe).returncode == 0:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("b never reachable from a")
        b.cut()
        assert a.run(probe).returncode != 0
        b.heal()
        assert a.run(probe).returncode == 0
        assert server.poll() is None
    finally:
        fabric.close()
