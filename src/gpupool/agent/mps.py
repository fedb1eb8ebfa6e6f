"""One MPS control daemon per virtual-mode GPU, each with private pipe and log directories.

Private directories keep our daemons apart from any other MPS on the host and from each
other: a client reaches exactly the daemon of its GPU through CUDA_MPS_PIPE_DIRECTORY.

When the workers run as the worker user, the daemon runs as that user too. A root daemon
spawns each client user's MPS server under that user, and on the H200 machine every server it
spawned for the worker user exited at once (status 0, an empty server log, also with that log
made the worker user's): the clients failed with CUDA error 805, while the same client of a
daemon run as the worker user ran (bench/gpu/mps_user_probe.sh). A daemon of the
workers' own user serves them, needs no privilege, and its pipes are that user's alone. That
user must reach the pipe directory from `/` (an MPS client connects by absolute path) while it
must not reach the agent's data dir: the daemons' directories then live under a short
root-owned runtime directory (`/run/gpupool/mps/<digest of the agent's directory>`), which
also keeps the sockets' paths inside the 108 bytes a Unix socket name may have. The daemon's
environment is the workers' allowlist: it holds no token of the agent's.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("gpupool.agent.mps")

CONTROL_BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
SHARED_BASE = Path("/run/gpupool/mps")
"""Where daemons whose clients are the worker user keep their pipes (root-owned, 0711)."""
SOCKET_PATH_MAX = 107
"""sun_path holds 108 bytes with its terminating NUL."""
LONGEST_SOCKET = "control_privileged"


class MpsError(RuntimeError):
    pass


def mps_available(binary: str = CONTROL_BINARY) -> bool:
    return shutil.which(binary) is not None


def wants_mps(mode: str, target_mode: str | None) -> bool:
    """Whether a GPU in this mode needs its daemon: virtual GPUs, and virtual ones draining."""
    if mode == "virtual":
        return True
    return mode == "draining" and target_mode in ("physical", None)


def client_env(
    pipe_dir: Path, log_dir: Path, compute_pct: int, memory_mib: int, ordinals: int = 1
) -> dict[str, str]:
    """The environment that puts a direct-access program under its lease's MPS limits."""
    limits = ",".join(f"{i}={memory_mib}M" for i in range(ordinals))
    return {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
        "CUDA_MPS_LOG_DIRECTORY": str(log_dir),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(compute_pct),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": limits,
    }


@dataclass
class MpsDaemon:
    gpu_uuid: str
    root: Path
    binary: str = CONTROL_BINARY
    client: tuple[int, int] | None = None
    """(uid, gid) of the worker user, whose workers are this daemon's clients and which runs
    the daemon (None: the agent's own user runs both)."""

    @property
    def pipe_dir(self) -> Path:
        return self.root / "pipe"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    def _env(self) -> dict[str, str]:
        # The MPS server the daemon spawns for a client runs as the client's user and inherits
        # this environment: the workers' allowlist, never the agent's tokens.
        from gpupool.agent.isolation import worker_environment

        return worker_environment(
            os.environ,
            self.root,
            {
                "CUDA_VISIBLE_DEVICES": self.gpu_uuid,
                "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
                "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
            },
        )

    def pid(self) -> int | None:
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        # A daemon that quit stays a zombie until its parent reaps it; daemonised, its
        # parent is the host's (or the container's) init, which may never do so.
        return None if _zombie(pid) else pid

    def running(self) -> bool:
        return self.pid() is not None

    def start(self, timeout_s: float = 10.0) -> None:
        if self.running():
            return
        for d in (self.pipe_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o700)
            if self.client is not None:
                # The daemon and its clients are the worker user: the pipes and logs are that
                # user's, nobody else's (the agent, as root, still reads the pid file).
                os.chown(d, *self.client)
        if self.client is not None:
            for d in (self.root, self.root.parent):
                d.chmod(d.stat().st_mode & 0o777 | 0o711)
        # The daemon keeps the descriptors it is given: a pipe here would never reach EOF.
        out_path = self.log_dir / "start.out"
        with open(out_path, "wb") as out:
            code = subprocess.call(
                [self.binary, "-d"],
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                **self._as_client(),
            )
        if code != 0:
            said = out_path.read_text(errors="replace").strip()
            raise MpsError(
                f"MPS daemon for {self.gpu_uuid} did not start: {said or code}{self._hint()}"
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.running():
                log.info("MPS daemon for %s runs (pipe %s)", self.gpu_uuid, self.pipe_dir)
                return
            time.sleep(0.05)
        raise MpsError(
            f"MPS daemon for {self.gpu_uuid} wrote no pid file in {timeout_s:.0f}s{self._hint()}"
        )

    def _as_client(self) -> dict[str, Any]:
        """subprocess arguments that run the control binary as the worker user, if any."""
        if self.client is None:
            return {}
        uid, gid = self.client
        return {"user": uid, "group": gid, "extra_groups": [], "cwd": "/"}

    def _hint(self) -> str:
        size = len(os.fsencode(self.pipe_dir / LONGEST_SOCKET))
        if size <= SOCKET_PATH_MAX:
            return ""
        return (
            f" (its socket paths are {size} bytes, over the {SOCKET_PATH_MAX} a Unix socket"
            " name may have: choose a shorter --data-dir)"
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        pid = self.pid()
        if pid is None:
            return
        try:
            subprocess.run(
                [self.binary],
                input="quit\n",
                env=self._env(),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                **self._as_client(),
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("MPS quit for %s failed: %s", self.gpu_uuid, exc)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.pid() is not None:
            time.sleep(0.05)
        if self.pid() is not None:
            log.warning("MPS daemon %d for %s ignored quit; killing it", pid, self.gpu_uuid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.info("MPS daemon for %s stopped", self.gpu_uuid)


def _zombie(pid: int) -> bool:
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last.
    return stat_line.rpartition(")")[2].split()[:1] == ["Z"]


def shared_root(private_root: Path, base: Path = SHARED_BASE) -> Path:
    """The runtime directory for the daemons of the agent whose own MPS directory is
    `private_root`: a digest of that path under `base`, every level made here, owned by the
    agent's user, mode 0711 (the worker user may pass through, list nothing).

    A level that exists but is not a directory of the agent's user (a symlink, another user's
    directory) is refused: pipes there could be read or replaced by its owner."""
    digest = hashlib.sha256(os.fsencode(private_root.resolve())).hexdigest()[:12]
    path = base / digest
    for level in (base.parent, base, path):
        with contextlib.suppress(FileExistsError):
            level.mkdir(mode=0o711)
        st = os.lstat(level)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise MpsError(
                f"{level} is not a directory of the agent's user: refusing it for MPS pipes"
            )
        os.chmod(level, 0o711)
    return path


class MpsSupervisor:
    """Keeps exactly the daemons the GPUs' modes call for.

    One daemon per virtual GPU serves every client when the workers run as the agent's own
    user. When they run as the worker user, a GPU has two: the workers' (run as that user,
    `pipe_dir`) and the direct slices' (the agent's own user, `direct_pipe_dir`). An MPS
    daemon runs one server at a time, for one user: a direct program of another user would
    wait for every worker to end (and a root daemon's servers for the worker user died on the
    H200 machine), so each kind of client gets a daemon of its own."""

    def __init__(
        self, root: Path, binary: str = CONTROL_BINARY, shared_base: Path = SHARED_BASE
    ) -> None:
        self.root = root
        self.binary = binary
        self.shared_base = shared_base
        self.enabled = mps_available(binary)
        self.daemons: dict[str, MpsDaemon] = {}
        """The workers' daemon of each GPU (the only one where workers run as the agent)."""
        self.direct_daemons: dict[str, MpsDaemon] = {}
        """The direct slices' daemon of each GPU, where the workers run as the worker user."""
        self.client: tuple[int, int] | None = None
        """(uid, gid), set by the worker supervisor when workers run as the worker user: their
        daemons run as that user, in directories under `shared_base`, which it can reach."""

    def _base(self) -> Path:
        if self.client is None:
            return self.root
        return shared_root(self.root, self.shared_base)

    def daemon(self, gpu_uuid: str) -> MpsDaemon:
        """The daemon the GPU's workers are clients of."""
        if gpu_uuid not in self.daemons:
            self.daemons[gpu_uuid] = MpsDaemon(
                gpu_uuid, self._base() / _safe(gpu_uuid), self.binary, self.client
            )
        return self.daemons[gpu_uuid]

    def direct_daemon(self, gpu_uuid: str) -> MpsDaemon:
        """The daemon the GPU's direct slices are clients of."""
        if self.client is None:
            return self.daemon(gpu_uuid)
        if gpu_uuid not in self.direct_daemons:
            self.direct_daemons[gpu_uuid] = MpsDaemon(
                gpu_uuid, self.root / _safe(gpu_uuid), self.binary
            )
        return self.direct_daemons[gpu_uuid]

    def _all(self) -> list[MpsDaemon]:
        return [*self.daemons.values(), *self.direct_daemons.values()]

    def reconcile(self, modes: Mapping[str, tuple[str, str | None]]) -> None:
        """Start and stop daemons so that each GPU has them exactly when its mode wants."""
        if not self.enabled:
            return
        for uuid, (mode, target) in modes.items():
            both = (self.daemon(uuid), self.direct_daemon(uuid))
            for daemon in both[:1] if both[0] is both[1] else both:
                try:
                    if wants_mps(mode, target):
                        daemon.start()
                    else:
                        daemon.stop()
                except (MpsError, OSError, subprocess.TimeoutExpired) as exc:
                    log.error("MPS for %s: %s", uuid, exc)
        for uuid in set(self.daemons) - set(modes):
            self.daemons[uuid].stop()
        for uuid in set(self.direct_daemons) - set(modes):
            self.direct_daemons[uuid].stop()

    def pids(self) -> set[int]:
        """The running control daemons (the MPS servers are their children)."""
        return {pid for d in self._all() if (pid := d.pid()) is not None}

    def pipe_dir(self, gpu_uuid: str) -> str | None:
        """Where the GPU's workers reach their daemon (None: no daemon runs)."""
        daemon = self.daemons.get(gpu_uuid)
        return str(daemon.pipe_dir) if daemon is not None and daemon.running() else None

    def direct_pipe_dir(self, gpu_uuid: str) -> str | None:
        """Where the GPU's direct slices reach their daemon (None: no daemon runs)."""
        if self.client is None:
            return self.pipe_dir(gpu_uuid)
        daemon = self.direct_daemons.get(gpu_uuid)
        return str(daemon.pipe_dir) if daemon is not None and daemon.running() else None

    def stop_all(self) -> None:
        for daemon in self._all():
            daemon.stop()
        if self.client is not None and self.daemons:
            # The runtime directory is this agent's alone: nothing of it outlives the agent.
            with contextlib.suppress(OSError, MpsError):
                shutil.rmtree(shared_root(self.root, self.shared_base))


def _safe(gpu_uuid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in gpu_uuid)
