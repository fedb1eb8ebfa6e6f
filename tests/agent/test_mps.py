"""The MPS supervisor runs one daemon per virtual GPU, in private directories, and stops it.

The real `nvidia-cuda-mps-control` needs a GPU; here a stand-in with the same command-line
interface (`-d` to daemonise and write its pid file, `quit` on stdin to stop) runs instead.
The real binary is exercised on the GPU machine (bench/mps_isolation.py).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from gpupool.agent.mps import MpsDaemon, MpsSupervisor, client_env, wants_mps

FAKE_CONTROL = """#!{python}
# Stand-in for nvidia-cuda-mps-control with its command-line interface (tests only).
import os, signal, sys, time
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
pidfile = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
if sys.argv[1:] == ["-d"]:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open(pidfile, "w") as f:
                f.write(str(os.getpid()))
            with open(os.path.join(pipe, "visible"), "w") as f:
                f.write(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
            signal.signal(signal.SIGTERM, lambda *a: (os.unlink(pidfile), os._exit(0)))
            while True:
                time.sleep(1)
        os._exit(0)
    sys.exit(0)
if sys.stdin.read().strip() == "quit":
    os.kill(int(open(pidfile).read()), signal.SIGTERM)
"""


@pytest.fixture
def fake_binary(tmp_path: Path) -> str:
    path = tmp_path / "nvidia-cuda-mps-control"
    path.write_text(FAKE_CONTROL.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_daemon_starts_in_private_directories_and_stops(tmp_path: Path, fake_binary: str) -> None:
    daemon = MpsDaemon("GPU-sim-a-0", tmp_path / "mps" / "a0", fake_binary)
    daemon.start()
    try:
        assert daemon.running()
        assert (daemon.pipe_dir / "visible").read_text() == "GPU-sim-a-0"
        assert stat.S_IMODE(os.stat(daemon.pipe_dir).st_mode) == 0o700
    finally:
        daemon.stop()
    assert not daemon.running()


def test_supervisor_follows_gpu_modes(tmp_path: Path, fake_binary: str) -> None:
    sup = MpsSupervisor(tmp_path / "mps", fake_binary)
    assert sup.enabled
    try:
        sup.reconcile({"G0": ("virtual", None), "G1": ("physical", None)})
        assert sup.pipe_dir("G0") is not None
        assert sup.pipe_dir("G1") is None
        sup.reconcile({"G0": ("draining", "physical"), "G1": ("physical", None)})
        assert sup.pipe_dir("G0") is not None, "clients of a draining GPU keep their daemon"
        sup.reconcile({"G0": ("physical", None), "G1": ("virtual", None)})
        assert sup.pipe_dir("G0") is None
        assert sup.pipe_dir("G1") is not None
    finally:
        sup.stop_all()
    assert all(not d.running() for d in sup.daemons.values())


def test_supervisor_is_off_without_the_mps_binary(tmp_path: Path) -> None:
    sup = MpsSupervisor(tmp_path, "no-such-mps-control-binary")
    assert not sup.enabled
    sup.reconcile({"G0": ("virtual", None)})
    assert sup.pipe_dir("G0") is None


@pytest.mark.parametrize(
    ("mode", "target", "wanted"),
    [
        ("virtual", None, True),
        ("physical", None, False),
        ("draining", "physical", True),
        ("draining", "virtual", False),
        ("isolated", "virtual", False),
    ],
)
def test_which_modes_want_a_daemon(mode: str, target: str | None, wanted: bool) -> None:
    assert wants_mps(mode, target) is wanted


def test_client_env_caps_compute_and_memory(tmp_path: Path) -> None:
    env = client_env(tmp_path / "p", tmp_path / "l", compute_pct=30, memory_mib=4096)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "p")
