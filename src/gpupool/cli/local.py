"""A pool run on this machine (`gpupool up`, `gpupool demo`): its port, its pid file, its GPUs
(real or simulated), its processes, their stop."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from gpupool.cli.errors import BadInput
from gpupool.client.sdk import ApiError, ControllerUnreachable, PoolClient

PID_FILE = "up.pid"
LOG_FILE = "up.log"
DOWN_GRACE_S = 60.0
"""How long `gpupool down` lets `gpupool up` stop its agent and workers (each has its own
10 s grace) before it kills what is left."""
KILL_GRACE_S = 5.0
STOP_GRACE_S = 10.0
DEFAULT_FAKE_SPEC = "4xH100-80GB"


def check_port_free(host: str, port: int) -> None:
    """Fail in one line when the controller could not listen on host:port, before anything
    (database, token, process) is made; SO_REUSEADDR as uvicorn binds, so a port in TIME_WAIT
    after a stopped pool counts as free."""
    if not 1 <= port <= 65535:
        raise BadInput(f"--port must be 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise BadInput(f"--host {host!r} is not an address or a name this machine knows") from None
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise BadInput(_bind_problem(host, port, exc)) from None


def _bind_problem(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use; stop what listens there "
            f"(`gpupool down` for a pool started here) or choose another with --port"
        )
    if exc.errno == errno.EACCES:
        return f"no permission to listen on {host}:{port}; choose a port above 1023 with --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host} is not an address of this machine"
    return f"cannot listen on {host}:{port}: {exc.strerror}"


@dataclass(frozen=True, slots=True)
class UpProcess:
    """The `gpupool up` process of a data dir, as its pid file names it; the start time guards
    against a pid the system has given to another process since."""

    pid: int
    started: float

    def running(self) -> psutil.Process | None:
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.started) > 1.0:
                return None
            return proc if proc.status() != psutil.STATUS_ZOMBIE else None
        except psutil.Error:
            return None


def read_pid_file(data_dir: Path) -> UpProcess | None:
    try:
        words = (data_dir / PID_FILE).read_text().split()
        return UpProcess(pid=int(words[0]), started=float(words[1]))
    except (OSError, ValueError, IndexError):
        return None


def running_up(data_dir: Path) -> psutil.Process | None:
    """The live `gpupool up` of this data dir, if any."""
    recorded = read_pid_file(data_dir)
    return recorded.running() if recorded is not None else None


def refuse_second_pool(data_dir: Path) -> None:
    """Two controllers on one SQLite file would fight over it: one `gpupool up` per data dir."""
    proc = running_up(data_dir)
    if proc is not None:
        raise BadInput(
            f"a pool already runs from {data_dir} (gpupool up, pid {proc.pid}); "
            "stop it with `gpupool down` or give another --data-dir"
        )


def write_pid_file(data_dir: Path) -> Path:
    me = psutil.Process()
    path = data_dir / PID_FILE
    path.write_text(f"{me.pid} {me.create_time()}\n")
    return path


def remove_pid_file(data_dir: Path) -> None:
    """Remove the pid file if it is still ours (a later `gpupool up` may have written its own)."""
    recorded = read_pid_file(data_dir)
    if recorded is not None and recorded.pid == os.getpid():
        (data_dir / PID_FILE).unlink(missing_ok=True)


def descendants(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return list(proc.children(recursive=True))
    except psutil.Error:
        return []


def stop_tree(processes: list[psutil.Process], grace_s: float = KILL_GRACE_S) -> list[int]:
    """TERM every process still alive, KILL those alive after the grace; their pids."""
    alive = []
    for proc in processes:
        try:
            proc.send_signal(signal.SIGTERM)
            alive.append(proc)
        except psutil.Error:
            continue
    _gone, left = psutil.wait_procs(alive, timeout=grace_s)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=grace_s)
    return [p.pid for p in alive]


@dataclass(frozen=True, slots=True)
class Stopped:
    up_pid: int
    others: int
    killed: bool


def stop_up(proc: psutil.Process, grace_s: float = DOWN_GRACE_S) -> Stopped:
    """SIGTERM to `gpupool up`, which stops its agent and the agent's workers; whatever of its
    process tree (taken before, so that orphans are found too) outlives the grace is killed."""
    tree = descendants(proc)
    try:
        proc.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        return Stopped(up_pid=proc.pid, others=0, killed=False)
    killed = False
    try:
        proc.wait(timeout=grace_s)
    except psutil.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=KILL_GRACE_S)
        killed = True
    except psutil.Error:
        pass
    left = [p for p in tree if _alive(p)]
    if left:
        stop_tree(left)
    return Stopped(up_pid=proc.pid, others=len(tree), killed=killed or bool(left))


def _alive(proc: psutil.Process) -> bool:
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def wait_for(
    check: Callable[[], bool], timeout_s: float, alive: psutil.Process | None = None
) -> bool:
    """Poll `check()` until it is true, the process `alive` ends, or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        if alive is not None and not _alive(alive):
            return False
        time.sleep(0.2)
    return False


def log_tail(path: Path, lines: int = 5) -> str:
    """The last lines of a log, for a one-line failure that says where to read more."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(kept[-lines:])


# ---- GPUs, real or simulated ----------------------------------------------------------------


def check_fake_spec(spec: str) -> None:
    from gpupool.agent.backends import parse_spec

    try:
        parse_spec(spec)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def real_gpus_found(node_name: str | None = None) -> bool:
    """Whether NVML sees an NVIDIA GPU on this machine."""
    from gpupool.agent.backends import detect

    backend = detect(node_name or socket.gethostname())
    if backend is None:
        return False
    backend.close()
    return True


def choose_fake_spec(fake: str | None, default: str = DEFAULT_FAKE_SPEC) -> tuple[str | None, str]:
    """The fake backend's spec to use (None: real GPUs), and why, for the banner."""
    if fake is not None:
        check_fake_spec(fake)
        return fake, "--fake was given"
    if real_gpus_found():
        return None, "NVML found GPUs"
    return default, "no NVIDIA GPU found on this machine"


# ---- the pool's processes ------------------------------------------------------------------


def agent_command(
    url: str,
    data_dir: Path,
    fake_spec: str | None,
    node: str | None = None,
    interval_s: float | None = None,
) -> list[str]:
    cmd = [sys.executable, "-m", "gpupool.cli", "agent", "--url", url, "--data-dir", str(data_dir)]
    cmd.append("--no-banner")  # the parent has shown it
    if fake_spec is not None:
        cmd += ["--fake", fake_spec]
    if node is not None:
        cmd += ["--node", node]
    if interval_s is not None:
        cmd += ["--interval", f"{interval_s:g}"]
    return cmd


def local_node_name() -> str:
    """The node name an agent started here without --node registers (AgentSettings')."""
    return socket.gethostname()


def controller_healthy(url: str) -> bool:
    try:
        with PoolClient(url, timeout=2) as client:
            return client.health().get("status") == "ok"
    except (ApiError, ControllerUnreachable):
        return False


def wait_until_healthy(
    url: str, timeout_s: float, alive: subprocess.Popen[bytes] | None = None
) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if controller_healthy(url):
            return True
        if alive is not None and alive.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def stop_process(proc: subprocess.Popen[Any], grace_s: float = STOP_GRACE_S) -> None:
    """TERM, then KILL after the grace period."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
