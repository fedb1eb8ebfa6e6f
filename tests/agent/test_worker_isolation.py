"""An agent's worker runs with least privilege: a scrubbed environment without any token, as the
unprivileged worker user (it cannot open the controller's admin.token nor the agent's registry)
and in a memory cgroup of its own sized to its lease, removed when the worker ends; and its
client still connects with the lease's token."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool.agent.isolation import (
    Cgroups,
    CgroupUnavailable,
    WorkerUser,
    host_limit_bytes,
    worker_environment,
    worker_user,
)
from gpupool.agent.mps import MpsSupervisor
from gpupool.agent.workers import WorkerSupervisor
from gpupool.protocol.v1.api import RemoteLease, RemoteSlice
from gpupool.protocol.v1.dataplane import ErrorKind, RemoteError, Role, parse_address

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="only root starts workers as another user")
CLIENT_TOKEN = "client-token-of-l-iso"
PEER_SECRET = "peer-secret-of-l-iso"
MEMORY_MIB = 64


def _lease(memory_mib: int = MEMORY_MIB, peers: list[str | None] | None = None) -> RemoteLease:
    return RemoteLease(
        token=CLIENT_TOKEN,
        peer_secret=PEER_SECRET,
        peers=peers or [],
        slices=[
            RemoteSlice(gpu_uuid="GPU-iso", gpu_index=0, compute_pct=10, memory_mib=memory_mib)
        ],
    )


def _cgroups() -> Cgroups | CgroupUnavailable:
    try:
        return Cgroups.detect()
    except CgroupUnavailable as exc:
        return exc


@pytest.fixture
def user() -> WorkerUser:
    if os.geteuid() != 0:
        pytest.skip("only root starts workers as another user")
    found = worker_user("gpupool-worker")  # made as a system user if missing
    assert found is not None and found.uid != 0
    return found


@pytest.fixture
def supervisor(
    tmp_path: Path, user: WorkerUser, monkeypatch: pytest.MonkeyPatch
) -> Iterator[WorkerSupervisor]:
    # The agent's own secrets, as an operator's environment holds them.
    monkeypatch.setenv("GPUPOOL_TOKEN", "agent-token-never-for-workers")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret-never-for-workers")
    monkeypatch.setenv("CUDA_CACHE_KEY", "not-a-secret-but-named-like-one")
    mps = MpsSupervisor(tmp_path / "mps")
    mps.enabled = False
    # pytest's temporary directories are mode 700: the worker user cannot reach its directory
    # from /, only work inside it, as an agent's data dir under a private parent would be.
    started = WorkerSupervisor(
        tmp_path / "workers", mps, simulated=True, simulated_gpus={"GPU-iso": 1024},
        user=user, cgroups=_cgroups(),
    )  # fmt: skip
    yield started
    started.reconcile({})


def _worker_pid(supervisor: WorkerSupervisor) -> int:
    (worker,) = supervisor.workers.values()
    return worker.proc.pid


def _as_user(user: WorkerUser, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], user=user.uid, group=user.gid, extra_groups=[],
        capture_output=True, text=True, timeout=60, check=False, cwd="/",
        env={"PATH": os.environ.get("PATH", "")},
    )  # fmt: skip


@AS_ROOT
def test_the_worker_runs_as_the_worker_user_without_any_token_in_its_environment(
    supervisor: WorkerSupervisor, user: WorkerUser
) -> None:
    supervisor.reconcile({"l-iso": _lease()})
    pid = _worker_pid(supervisor)
    status = Path(f"/proc/{pid}/status").read_text()
    uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    gids = next(line for line in status.splitlines() if line.startswith("Gid:")).split()[1:]
    groups = next(line for line in status.splitlines() if line.startswith("Groups:")).split()[1:]
    assert set(uids) == {str(user.uid)} and set(gids) == {str(user.gid)}
    assert groups in ([], [str(user.gid)])
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    names = {entry.split(b"=", 1)[0] for entry in environ.split(b"\0") if entry}
    assert b"GPUPOOL_TOKEN" not in names and b"GPUPOOL_WORKER_TOKEN" not in names
    assert b"AWS_SECRET_ACCESS_KEY" not in names and b"CUDA_CACHE_KEY" not in names
    for secret in (CLIENT_TOKEN, PEER_SECRET, "agent-token-never-for-workers"):
        assert secret.encode() not in environ
        assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert b"HOME=" + str(supervisor.root / "l-iso").encode() in environ


@AS_ROOT
def test_the_worker_user_cannot_open_admin_token_nor_the_agent_registry(
    supervisor: WorkerSupervisor, user: WorkerUser, tmp_path: Path
) -> None:
    """What a tenant who took the worker over could read: the controller's data dir and the
    agent's registry (control secrets) stay closed to the worker's uid."""
    supervisor.reconcile({"l-iso": _lease()})
    controller = tmp_path / "controller"
    controller.mkdir(mode=0o700)
    admin = controller / "admin.token"
    admin.write_text("gp_admin_secret")
    admin.chmod(0o600)
    os.chmod(tmp_path, 0o755)  # reachable: only the files' own modes keep the worker out
    for path in (admin, supervisor.registry, supervisor.logs):
        probe = _as_user(
            user,
            f"import os; os.listdir({str(path)!r}) if os.path.isdir({str(path)!r}) else open({str(path)!r}).read()",
        )
        assert probe.returncode != 0 and "PermissionError" in probe.stderr, (path, probe.stderr)
    assert "control_token" in supervisor.registry.read_text()
    assert CLIENT_TOKEN not in supervisor.registry.read_text()


@AS_ROOT
def test_the_client_still_connects_and_only_as_a_client(supervisor: WorkerSupervisor) -> None:
    import socket

    from gpupool.protocol.v1.dataplane import role_handshake

    supervisor.reconcile({"l-iso": _lease()})
    (worker,) = supervisor.workers.values()
    address = parse_address(worker.endpoint)
    with socket.create_connection((address.host, address.port), timeout=10) as sock:
        role_handshake(sock, "l-iso", CLIENT_TOKEN, Role.CLIENT)
    with socket.create_connection((address.host, address.port), timeout=10) as sock:
        with pytest.raises(RemoteError) as refused:
            role_handshake(sock, "l-iso", CLIENT_TOKEN, Role.CONTROL)
        assert refused.value.body.kind == ErrorKind.AUTH
    # The agent's control secret still works: a resize goes through, the limit follows.
    supervisor.reconcile({"l-iso": _lease(memory_mib=96)})
    assert worker.memory_mib == 96


@AS_ROOT
def test_the_agent_names_the_lease_peers_to_its_worker(supervisor: WorkerSupervisor) -> None:
    from gpupool.protocol.v1.dataplane import send_control

    supervisor.reconcile({"l-iso": _lease()})
    (worker,) = supervisor.workers.values()
    peers: list[str | None] = [worker.endpoint, "tcp://127.0.0.9:7000", None]
    supervisor.reconcile({"l-iso": _lease(peers=peers)})
    assert worker.peers_named == tuple(peers)
    named = send_control(
        parse_address(worker.endpoint), "l-iso", worker.control_token,
        {"op": "peers", "endpoints": peers},
    )  # fmt: skip
    assert named["peers"] == sorted([worker.endpoint, "tcp://127.0.0.9:7000"])


@AS_ROOT
def test_each_worker_gets_a_memory_cgroup_sized_to_its_lease_and_removed_after(
    supervisor: WorkerSupervisor,
) -> None:
    if supervisor.cgroups is None:
        pytest.skip(f"no memory cgroup can be made here: {supervisor.cgroup_problem}")
    supervisor.reconcile({"l-iso": _lease()})
    (worker,) = supervisor.workers.values()
    assert worker.cgroup is not None
    assert worker.proc.pid in worker.cgroup.pids()
    assert supervisor.cgroups.limit_of(worker.cgroup.path.name) == host_limit_bytes(MEMORY_MIB)
    supervisor.reconcile({"l-iso": _lease(memory_mib=128)})  # a live resize moves it too
    assert supervisor.cgroups.limit_of(worker.cgroup.path.name) == host_limit_bytes(128)
    assert f'"cgroup": ["{worker.cgroup.path}"' in supervisor.registry.read_text()
    supervisor.reconcile({})
    assert not worker.cgroup.path.exists()
    said = supervisor.confinement()
    assert said["worker_user"] == "gpupool-worker"
    assert (
        said["worker_cgroups"] == f"v1 under {supervisor.cgroups.base}"
        or said["worker_cgroups"] == f"v2 under {supervisor.cgroups.base}"
    )


def test_the_environment_is_an_allowlist(tmp_path: Path) -> None:
    source = {
        "PATH": "/usr/bin", "PYTHONPATH": "/src", "LANG": "C.UTF-8", "LC_ALL": "C",
        "CUDA_MODULE_LOADING": "LAZY", "NVIDIA_VISIBLE_DEVICES": "all",
        "GPUPOOL_FASTPATH": "0", "GPUPOOL_TOKEN": "x", "GPUPOOL_WORKER_TOKEN": "x",
        "GPUPOOL_ADMIN_TOKEN": "x", "GPUPOOL_URL": "http://c", "HOME": "/root",
        "AWS_SECRET_ACCESS_KEY": "x", "HTTPS_PROXY": "http://u:p@proxy", "SSH_AUTH_SOCK": "/s",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_AUTH_KEY": "x",
    }  # fmt: skip
    env = worker_environment(source, tmp_path, {"CUDA_VISIBLE_DEVICES": "GPU-1"})
    assert env == {
        "PATH": "/usr/bin", "PYTHONPATH": "/src", "LANG": "C.UTF-8", "LC_ALL": "C",
        "CUDA_MODULE_LOADING": "LAZY", "NVIDIA_VISIBLE_DEVICES": "all", "GPUPOOL_FASTPATH": "0",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "HOME": str(tmp_path), "TMPDIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": "GPU-1",
    }  # fmt: skip


def test_a_root_or_malformed_worker_user_is_refused() -> None:
    from gpupool.agent.isolation import WorkerUserError

    if os.geteuid() != 0:
        assert worker_user("gpupool-worker") is None  # not root: workers run as the agent
        return
    with pytest.raises(WorkerUserError, match="uid or gid 0"):
        worker_user("root")
    with pytest.raises(WorkerUserError, match="not a valid user name"):
        worker_user("../etc")
    with pytest.raises(WorkerUserError, match="does not exist"):
        worker_user("gpupool-no-such-user", create=False)
    assert worker_user("") is None  # asked for explicitly: as root


def test_cgroup_v2_is_found_and_the_memory_controller_handed_down(tmp_path: Path) -> None:
    """A v2 host (most production ones), on a stand-in of its cgroupfs: the workers' group
    goes beside the agent's (v2 lets no group with processes delegate), with memory.max."""
    if os.geteuid() != 0:
        pytest.skip("detection wants root")
    mount = tmp_path / "cgroup"
    agent = mount / "system.slice" / "gpupool-agent.service"
    agent.mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("cpu io memory pids\n")
    for group in (mount, mount / "system.slice"):
        (group / "cgroup.subtree_control").write_text("")
    own = tmp_path / "self-cgroup"
    own.write_text("0::/system.slice/gpupool-agent.service\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"30 1 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    cgroups = Cgroups.detect(own, mountinfo)
    assert cgroups.version == 2 and cgroups.base == mount / "system.slice" / "gpupool-workers"
    assert (mount / "system.slice" / "cgroup.subtree_control").read_text() == "+memory"
    made = cgroups.make("l.0.g0", 5 << 30)
    assert (made.path / "memory.max").read_text() == str(5 << 30)
    assert (made.path / "memory.swap.max").read_text() == "0"
    assert made.set_limit(6 << 30).limit_bytes == 6 << 30
    assert (made.path / "memory.max").read_text() == str(6 << 30)


def test_no_memory_controller_is_said_not_hidden(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("detection wants root")
    mount = tmp_path / "unified"
    mount.mkdir()
    (mount / "cgroup.controllers").write_text("hugetlb\n")
    own = tmp_path / "self-cgroup"
    own.write_text("0::/\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"30 1 0:26 / {mount} rw - cgroup2 cgroup2 rw\n")
    with pytest.raises(CgroupUnavailable, match="no cgroup memory controller"):
        Cgroups.detect(own, mountinfo)


@AS_ROOT
def test_a_worker_user_that_cannot_run_the_interpreter_is_refused_with_the_reason(
    user: WorkerUser, tmp_path: Path
) -> None:
    from gpupool.agent.isolation import WorkerUserError, check_runs_worker

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "python").symlink_to(sys.executable)
    check_runs_worker(user)  # the interpreter the agent runs is the worker's
    with pytest.raises(WorkerUserError, match=r"cannot run a worker .*Permission"):
        check_runs_worker(user, str(private / "python"))


def test_a_node_whose_workers_get_no_cgroup_says_why(tmp_path: Path) -> None:
    mps = MpsSupervisor(tmp_path / "mps")
    mps.enabled = False
    supervisor = WorkerSupervisor(
        tmp_path / "workers", mps, simulated=True,
        cgroups=CgroupUnavailable("no cgroup memory controller is mounted"),
    )  # fmt: skip
    assert supervisor.confinement() == {
        "worker_user": None,
        "worker_cgroups": "none: no cgroup memory controller is mounted",
    }


@AS_ROOT
def test_a_tls_worker_as_the_worker_user_serves_with_a_copy_of_the_key_it_may_read(
    tmp_path: Path, user: WorkerUser, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's key stays root's (mode 600); the worker gets its own copy, in its own
    directory, and serves TLS clients with it."""
    import torch

    import gpupool.torch
    from gpupool.protocol.tls import CA_ENV

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    key.chmod(0o600)
    mps = MpsSupervisor(tmp_path / "mps")
    mps.enabled = False
    supervisor = WorkerSupervisor(
        tmp_path / "workers", mps, simulated=True, tls=(cert, key), user=user
    )
    try:
        supervisor.reconcile({"l-tls": _lease()})
        (worker,) = supervisor.workers.values()
        assert worker.endpoint.startswith("tls://127.0.0.1:")
        copy = supervisor.root / "l-tls" / "tls.key"
        assert copy.stat().st_uid == user.uid and copy.stat().st_mode & 0o777 == 0o600
        assert key.stat().st_uid == 0
        monkeypatch.setenv(CA_ENV, str(cert))
        gpupool.torch.attach(workers=[worker.endpoint], token=CLIENT_TOKEN, lease="l-tls")
        try:
            assert torch.ones(3, device="cuda").sum().item() == 3.0
        finally:
            gpupool.torch.detach()
    finally:
        supervisor.reconcile({})
