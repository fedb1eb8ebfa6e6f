"""The MPS supervisor runs one daemon per virtual GPU, in private directories, and stops it.

The real `nvidia-cuda-mps-control` needs a GPU; here a stand-in with the same command-line
interface (`-d` to daemonise and write its pid file, `quit` on stdin to stop) runs instead.
The real binary is exercised on the GPU machine (bench/mps_isolation.py).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpupool.agent.isolation import WorkerUser, worker_user
from gpupool.agent.mps import (
    MpsDaemon,
    MpsError,
    MpsSupervisor,
    client_env,
    shared_root,
    wants_mps,
)
from tests.timing import scaled

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
            with open(os.path.join(pipe, "environ"), "w") as f:
                f.write(chr(10).join(sorted(os.environ)))
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
        assert sup.direct_pipe_dir("G0") == sup.pipe_dir("G0"), "one daemon for every client"
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


def test_the_daemon_gets_no_token_of_the_agent(
    tmp_path: Path, fake_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MPS server the daemon spawns runs as the workers' user, which can read its
    environment: the agent's credentials must not be in it."""
    monkeypatch.setenv("GPUPOOL_TOKEN", "agent-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret")
    daemon = MpsDaemon("GPU-sim-a-0", tmp_path / "mps" / "a0", fake_binary)
    daemon.start()
    try:
        names = (daemon.pipe_dir / "environ").read_text().split()
    finally:
        daemon.stop()
    assert "CUDA_MPS_PIPE_DIRECTORY" in names and "PATH" in names
    assert "GPUPOOL_TOKEN" not in names and "AWS_SECRET_ACCESS_KEY" not in names


def test_a_daemon_that_quit_but_was_never_reaped_is_not_running(
    tmp_path: Path, fake_binary: str
) -> None:
    daemon = MpsDaemon("GPU-sim-a-0", tmp_path / "mps" / "a0", fake_binary)
    daemon.pipe_dir.mkdir(parents=True)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        stat_file = Path(f"/proc/{child.pid}/stat")
        deadline = time.monotonic() + scaled(60)
        while stat_file.read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        (daemon.pipe_dir / "nvidia-cuda-mps-control.pid").write_text(str(child.pid))
        assert not daemon.running()
        daemon.stop()  # returns at once: nothing to quit
    finally:
        child.wait()


@pytest.fixture
def user() -> WorkerUser:
    if os.geteuid() != 0:
        pytest.skip("needs root: the worker user's processes are started as another user")
    found = worker_user(None)
    assert found is not None
    return found


def _as_user(user: WorkerUser, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], user=user.uid, group=user.gid, extra_groups=[],
        cwd="/", capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_the_worker_user_reaches_the_pipes_but_not_the_agents_directory(
    tmp_path: Path, fake_binary: str, user: WorkerUser, request: pytest.FixtureRequest
) -> None:
    """An MPS client connects to the daemon by absolute path: the worker user must pass
    through every level above the pipe directory, while the agent's own directory (its
    registry, its key) stays closed to it. The daemon is that user's too: a root daemon's
    servers for the worker user died at once on the GPU machine (CUDA error 805)."""
    private = tmp_path / "agent"
    private.mkdir(mode=0o700)
    run = Path(tempfile.mkdtemp(prefix="gpupool-run-", dir="/tmp"))  # as /run: 0711 from /
    run.chmod(0o711)
    request.addfinalizer(lambda: shutil.rmtree(run, ignore_errors=True))
    binary = run / "nvidia-cuda-mps-control"  # the daemon runs as the worker user: reachable
    shutil.copy(fake_binary, binary)
    binary.chmod(0o755)
    sup = MpsSupervisor(private / "mps", str(binary), shared_base=run / "gpupool" / "mps")
    sup.client = (user.uid, user.gid)
    try:
        sup.reconcile({"GPU-4e3a410b-c041-7f34-e692-bdddd68b7e21": ("virtual", None)})
        pipe = sup.pipe_dir("GPU-4e3a410b-c041-7f34-e692-bdddd68b7e21")
        assert pipe is not None and not pipe.startswith(str(private))
        daemon = sup.daemons["GPU-4e3a410b-c041-7f34-e692-bdddd68b7e21"]
        pid = daemon.pid()
        assert pid is not None and os.stat(f"/proc/{pid}").st_uid == user.uid, (
            "the daemon runs as the workers' user"
        )
        assert os.stat(pipe).st_uid == user.uid and stat.S_IMODE(os.stat(pipe).st_mode) == 0o700
        # Direct slices (programs of other users) get a daemon of the agent's own user.
        direct = sup.direct_pipe_dir("GPU-4e3a410b-c041-7f34-e692-bdddd68b7e21")
        assert direct is not None and direct != pipe and direct.startswith(str(private))
        direct_pid = sup.direct_daemons["GPU-4e3a410b-c041-7f34-e692-bdddd68b7e21"].pid()
        assert direct_pid is not None and os.stat(f"/proc/{direct_pid}").st_uid == os.geteuid()
        assert sup.pids() == {pid, direct_pid}
        probe = "import os, sys; os.listdir(sys.argv[1]); open(sys.argv[1] + '/probe', 'w')"
        reached = _as_user(user, probe, pipe)
        assert reached.returncode == 0, reached.stderr
        closed = _as_user(user, "import os, sys; os.listdir(sys.argv[1])", str(private))
        assert closed.returncode != 0 and "Permission" in closed.stderr
    finally:
        sup.stop_all()
    assert os.listdir(run / "gpupool" / "mps") == [], "the agent's runtime directory is gone"
    assert sup.pids() == set()


def test_a_runtime_directory_someone_else_planted_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "gpupool" / "mps"
    base.parent.mkdir()
    base.symlink_to(tmp_path)
    with pytest.raises(MpsError, match="not a directory of the agent's user"):
        shared_root(tmp_path / "agent" / "mps", base)
