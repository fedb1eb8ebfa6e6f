"""One MPS control daemon per virtual-mode GPU, each with private pipe and log directories.

Private directories keep our daemons apart from any other MPS on the host and from each
other: a client reaches exactly the daemon of its GPU through CUDA_MPS_PIPE_DIRECTORY.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("gpupool.agent.mps")

CONTROL_BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"


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
    client_gid: int | None = None
    """The group of the worker user, whose workers are this daemon's clients (None: the
    agent's own user runs them)."""

    @property
    def pipe_dir(self) -> Path:
        return self.root / "pipe"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            CUDA_VISIBLE_DEVICES=self.gpu_uuid,
            CUDA_MPS_PIPE_DIRECTORY=str(self.pipe_dir),
            CUDA_MPS_LOG_DIRECTORY=str(self.log_dir),
        )
        return env

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
        return pid

    def running(self) -> bool:
        return self.pid() is not None

    def start(self, timeout_s: float = 10.0) -> None:
        if self.running():
            return
        for d in (self.pipe_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o700)
            if self.client_gid is not None:
                # The workers run as the worker user: its group reaches the daemon's pipes
                # (and the MPS server it runs as writes its log); nobody else does.
                os.chown(d, -1, self.client_gid)
                d.chmod(0o770)
        if self.client_gid is not None:
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
            )
        if code != 0:
            said = out_path.read_text(errors="replace").strip()
            raise MpsError(f"MPS daemon for {self.gpu_uuid} did not start: {said or code}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.running():
                log.info("MPS daemon for %s runs (pipe %s)", self.gpu_uuid, self.pipe_dir)
                return
            time.sleep(0.05)
        raise MpsError(f"MPS daemon for {self.gpu_uuid} wrote no pid file in {timeout_s:.0f}s")

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


class MpsSupervisor:
    """Keeps exactly the daemons the GPUs' modes call for."""

    def __init__(self, root: Path, binary: str = CONTROL_BINARY) -> None:
        self.root = root
        self.binary = binary
        self.enabled = mps_available(binary)
        self.daemons: dict[str, MpsDaemon] = {}
        self.client_gid: int | None = None
        """Set by the worker supervisor when workers run as the worker user."""

    def daemon(self, gpu_uuid: str) -> MpsDaemon:
        if gpu_uuid not in self.daemons:
            safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in gpu_uuid)
            self.daemons[gpu_uuid] = MpsDaemon(
                gpu_uuid, self.root / safe, self.binary, self.client_gid
            )
        return self.daemons[gpu_uuid]

    def reconcile(self, modes: Mapping[str, tuple[str, str | None]]) -> None:
        """Start and stop daemons so that each GPU has one exactly when its mode wants it."""
        if not self.enabled:
            return
        for uuid, (mode, target) in modes.items():
            daemon = self.daemon(uuid)
            try:
                if wants_mps(mode, target):
                    daemon.start()
                else:
                    daemon.stop()
            except (MpsError, OSError, subprocess.TimeoutExpired) as exc:
                log.error("MPS for %s: %s", uuid, exc)
        for uuid in set(self.daemons) - set(modes):
            self.daemons[uuid].stop()

    def pids(self) -> set[int]:
        """The running control daemons (the MPS servers are their children)."""
        return {pid for d in list(self.daemons.values()) if (pid := d.pid()) is not None}

    def pipe_dir(self, gpu_uuid: str) -> str | None:
        daemon = self.daemons.get(gpu_uuid)
        return str(daemon.pipe_dir) if daemon is not None and daemon.running() else None

    def stop_all(self) -> None:
        for daemon in self.daemons.values():
            daemon.stop()
