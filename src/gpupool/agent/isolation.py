"""What a worker process may see and hold: its environment, its Unix user, its memory cgroup.

A worker runs the tenant's ops: whatever it can read, a hostile tenant may get it to read. So
the agent starts it with an environment built from an allowlist (no token of any kind), as a
dedicated unprivileged user when the agent runs as root (it cannot read the controller's data
dir, the agent's registry or the agent's TLS key), and, where the kernel lets the agent, in a
memory cgroup of its own sized to the lease, so that host memory the worker's accounting
misses is still bounded.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpupool.protocol.tls import CA_ENV

log = logging.getLogger("gpupool.agent.isolation")

MIB = 1 << 20

# ---- the environment -------------------------------------------------------------------

ENV_NAMES = frozenset(
    {
        "PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "LANG", "LANGUAGE", "TZ",
        "LD_LIBRARY_PATH", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED",
        "COVERAGE_PROCESS_START",
        # the worker's own settings (none of them a secret)
        "GPUPOOL_FASTPATH", "GPUPOOL_GC_THRESHOLD", CA_ENV,
    }
)  # fmt: skip
"""Variables a worker keeps by name: what Python needs to find gpupool and torch, locale."""
ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "PYTORCH_", "TORCH_", "OMP_", "MKL_", "KMP_")
"""Families a worker keeps: CUDA, the driver's and MPS's, torch's and its thread pools'."""
SECRET_WORDS = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|KEY|AUTH|COOKIE", re.IGNORECASE)
"""A name with one of these words is dropped even in a kept family (CUDA_..._KEY)."""


def worker_environment(
    source: Mapping[str, str], home: Path, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a worker: the allowlisted part of `source` (the agent's own), HOME
    and TMPDIR in the worker's directory, then `extra` (the lease's GPU and MPS limits).

    An allowlist, not a denylist: a variable the agent has for its own use (GPUPOOL_TOKEN, a
    cloud credential, an HTTP proxy password) never reaches a process a tenant drives."""
    env = {
        name: value
        for name, value in source.items()
        if (name in ENV_NAMES or name.startswith(ENV_PREFIXES)) and not SECRET_WORDS.search(name)
    }
    env["HOME"] = str(home)
    env["TMPDIR"] = str(home)
    env.update(extra or {})
    return env


# ---- the user ---------------------------------------------------------------------------

DEFAULT_WORKER_USER = "gpupool-worker"
"""Workers run as this user when the agent runs as root (`gpupool agent --worker-user`)."""
_USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")


class WorkerUserError(RuntimeError):
    """The worker user cannot be used: it does not exist and cannot be made, or it is root."""


@dataclass(frozen=True)
class WorkerUser:
    """The Unix user (and its own group, no other) the agent's workers run as."""

    name: str
    uid: int
    gid: int

    def own(self, path: Path, mode: int) -> None:
        """Make `path` this user's, with `mode` (the agent, as root, keeps access anyway)."""
        os.chown(path, self.uid, self.gid)
        os.chmod(path, mode)


def worker_user(name: str | None, create: bool = True) -> WorkerUser | None:
    """The user workers run as, or None when they run as the agent's own user.

    Only root can start a process as another user: an agent that is not root runs its workers
    as itself (and says so). As root, `name` (default gpupool-worker) must be an unprivileged
    user; a missing one is made a system user without a login shell or home (useradd), or
    refused when `create` is off. `name=""` keeps workers as root, which an operator must ask
    for explicitly."""
    if os.geteuid() != 0:
        if name:
            log.warning("the agent does not run as root: workers run as its own user, not %s", name)
        return None
    if name == "":
        log.warning("workers run as root (--worker-user ''): a tenant's worker is not confined")
        return None
    name = name or DEFAULT_WORKER_USER
    if not _USER_NAME.match(name):
        raise WorkerUserError(f"worker user {name!r} is not a valid user name")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if not create:
            raise WorkerUserError(f"worker user {name!r} does not exist") from None
        entry = _create_user(name)
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise WorkerUserError(f"worker user {name!r} has uid or gid 0: it would not be confined")
    return WorkerUser(name, entry.pw_uid, entry.pw_gid)


def check_runs_worker(user: WorkerUser, python: str | None = None) -> None:
    """Refuse, saying why, a worker user that cannot start a worker: it must be able to run
    this interpreter and find gpupool and torch (a pyenv under /root, mode 700, is not)."""
    import sys

    probe = (
        "import importlib.util as u, sys; import gpupool; "
        "sys.exit(0 if u.find_spec('torch') else 'torch is not importable')"
    )
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "VIRTUAL_ENV")}
    try:
        done = subprocess.run(
            [python or sys.executable, "-c", probe], user=user.uid, group=user.gid,
            extra_groups=[], cwd="/", env=env, capture_output=True, text=True, timeout=60,
            check=False,
        )  # fmt: skip
    except OSError as exc:
        said = f"{type(exc).__name__}: {exc.strerror or exc}"
    else:
        if done.returncode == 0:
            return
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    raise WorkerUserError(
        f"worker user {user.name} cannot run a worker ({python or sys.executable}: {said[:300]}):"
        " install gpupool where that user can read it, or choose another --worker-user"
    )


def _create_user(name: str) -> pwd.struct_passwd:
    useradd = shutil.which("useradd")
    if useradd is None:
        raise WorkerUserError(
            f"worker user {name!r} does not exist and useradd is not here to make it: "
            "create it (an unprivileged system user) or pass --worker-user"
        )
    shell = "/usr/sbin/nologin" if Path("/usr/sbin/nologin").exists() else "/bin/false"
    done = subprocess.run(
        [useradd, "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
         "--shell", shell, name],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if done.returncode not in (0, 9):  # 9: made meanwhile by another agent
        said = (done.stderr or done.stdout).strip()[:300]
        raise WorkerUserError(f"cannot create worker user {name!r}: {said}")
    log.info("created the system user %s for workers", name)
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise WorkerUserError(f"useradd made no user {name!r}") from None


# ---- the memory cgroup ------------------------------------------------------------------

WORKER_HOST_MARGIN_MIB = 3072
"""Host memory a worker needs beside its lease's: the interpreter with torch (about 0.5 GiB),
a CUDA context's host side, the shared read arena (256 MiB), staging buffers."""
CGROUP_GROUP = "gpupool-workers"
UNLIMITED = 1 << 62


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made for workers here (not root, no memory controller)."""


@dataclass(frozen=True)
class WorkerCgroup:
    """One worker's memory cgroup: made before the worker gets its credentials, removed when
    the worker has ended."""

    path: Path
    version: int
    limit_bytes: int

    def set_limit(self, limit_bytes: int) -> WorkerCgroup:
        """A new limit (a live resize): v1 wants memsw >= limit at every step."""
        if self.version == 2:
            (self.path / "memory.max").write_text(str(limit_bytes))
            return WorkerCgroup(self.path, 2, limit_bytes)
        files = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
        if limit_bytes > self.limit_bytes:
            files.reverse()
        for name in files:
            path = self.path / name
            if name.startswith("memory.memsw") and not path.exists():
                continue  # no swap accounting
            path.write_text(str(limit_bytes))
        return WorkerCgroup(self.path, 1, limit_bytes)

    def attach(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def pids(self) -> list[int]:
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def remove(self) -> None:
        """rmdir: only an empty cgroup goes (the worker has ended); a busy one stays, logged."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove the worker cgroup %s: %s", self.path, exc)


@dataclass(frozen=True)
class Cgroups:
    """Where this agent makes its workers' memory cgroups: a `gpupool-workers` group under the
    agent's own (v1: in the memory hierarchy; v2: beside the agent's, as v2 allows no process
    in a group that hands controllers down)."""

    base: Path
    version: int

    @classmethod
    def detect(
        cls, proc_self_cgroup: Path = Path("/proc/self/cgroup"),
        mountinfo: Path = Path("/proc/self/mountinfo"),
    ) -> Cgroups:  # fmt: skip
        """The memory cgroup base for workers; raises CgroupUnavailable saying why not."""
        if os.geteuid() != 0:
            raise CgroupUnavailable("the agent does not run as root")
        try:
            membership = proc_self_cgroup.read_text().splitlines()
            mounts = mountinfo.read_text().splitlines()
        except OSError as exc:
            raise CgroupUnavailable(f"cannot read the process's cgroups: {exc}") from None
        v1_memory = v2 = None
        for line in mounts:
            fields = line.split()
            if " - " not in line or len(fields) < 5:
                continue
            fstype, _, options = line.split(" - ", 1)[1].partition(" ")
            point, root = Path(fields[4]), fields[3]
            kind = fstype.split()[0] if fstype else ""
            if kind == "cgroup" and "memory" in options.split()[-1].split(","):
                v1_memory = (point, root)
            elif kind == "cgroup2":
                v2 = (point, root)
        own = {}
        for line in membership:
            number, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            own[controllers if number != "0" else ""] = path
            for name in controllers.split(","):
                own[name] = path
        if v2 is not None and "memory" in _read(v2[0] / "cgroup.controllers").split():
            return cls._v2(v2[0], v2[1], own.get("", "/"))
        if v1_memory is not None:
            return cls._v1(v1_memory[0], v1_memory[1], own.get("memory", "/"))
        raise CgroupUnavailable("no cgroup memory controller is mounted")

    @classmethod
    def _v1(cls, mount: Path, root: str, own: str) -> Cgroups:
        base = mount / _below(own, root) / CGROUP_GROUP
        _make(base)
        return cls(base, 1)

    @classmethod
    def _v2(cls, mount: Path, root: str, own: str) -> Cgroups:
        agent_group = mount / _below(own, root)
        # The agent's group holds the agent: v2 lets no group with processes delegate the
        # memory controller (except the root), so workers go beside it under its parent.
        parent = agent_group if agent_group == mount else agent_group.parent
        _enable_memory(parent)
        base = parent / CGROUP_GROUP
        _make(base)
        _enable_memory(base)
        return cls(base, 2)

    def make(self, name: str, limit_bytes: int) -> WorkerCgroup:
        """A fresh cgroup `name` with its memory limit (swap included where it can be set)."""
        path = self.base / name
        _make(path)
        try:
            if self.version == 2:
                (path / "memory.max").write_text(str(limit_bytes))
                with contextlib.suppress(OSError):  # absent without swap accounting
                    (path / "memory.swap.max").write_text("0")
                with contextlib.suppress(OSError):  # a worker killed for memory dies whole
                    (path / "memory.oom.group").write_text("1")
                return WorkerCgroup(path, 2, limit_bytes)
            # A fresh v1 group has no limit: lowered in the order v1 wants (limit first).
            return WorkerCgroup(path, 1, UNLIMITED).set_limit(limit_bytes)
        except OSError as exc:
            with contextlib.suppress(OSError):
                path.rmdir()
            raise CgroupUnavailable(f"cannot set the memory limit of {path}: {exc}") from None

    def limit_of(self, name: str) -> int | None:
        """The limit a worker cgroup has now (None: no such cgroup)."""
        path = self.base / name
        text = _read(path / ("memory.max" if self.version == 2 else "memory.limit_in_bytes"))
        return int(text) if text.strip().isdigit() else None


def host_limit_bytes(memory_mib: int, host_memory_mib: int | None = None) -> int:
    """A worker's host memory limit: its lease's memory (a CPU worker's tensors, or a CUDA
    worker's swapped-out state), the lease's host allowance, and the fixed margin."""
    return (memory_mib + (host_memory_mib or 0) + WORKER_HOST_MARGIN_MIB) * MIB


def _below(path: str, root: str) -> str:
    """`path` (from /proc/self/cgroup) relative to the mount's root, without a leading /."""
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        path = path[len(root.rstrip("/")) :]
    return path.strip("/")


def _make(path: Path) -> None:
    try:
        path.mkdir(exist_ok=True)
    except OSError as exc:
        reason = "read-only" if exc.errno == errno.EROFS else str(exc)
        raise CgroupUnavailable(f"cannot make the cgroup {path}: {reason}") from None


def _enable_memory(group: Path) -> None:
    control = group / "cgroup.subtree_control"
    if "memory" in _read(control).split():
        return
    try:
        control.write_text("+memory")
    except OSError as exc:
        raise CgroupUnavailable(f"cannot delegate memory in {group}: {exc}") from None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
