"""A worker the agent starts for a remote lease (real controller, agent and worker processes):
it holds none of the pool's tokens, runs as the worker user in its memory cgroup, cannot read
the controller's data dir, and the lease's token opens its client role only."""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from e2e_pool import Pool

from gpupool.client.sdk import PoolClient
from gpupool.protocol.v1.api import LeaseCreate
from gpupool.protocol.v1.dataplane import (
    VERSION,
    ErrorKind,
    Kind,
    RemoteError,
    Role,
    parse_address,
    recv_handshake,
    role_handshake,
    send_handshake,
)
from tests.conftest import ADMIN_TOKEN
from tests.timing import scaled

pytest.importorskip("torch")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the agent confines workers when it is root"),
]
MEMORY_MIB = 256


def _worker_of(lease_id: str) -> psutil.Process:
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "gpupool.worker" in cmdline and lease_id in cmdline:
            return proc
    raise AssertionError(f"no worker process for lease {lease_id}")


def _welcome_limit(endpoint: str, lease_id: str, token: str) -> int:
    address = parse_address(endpoint)
    with socket.create_connection((address.host, address.port), timeout=10) as sock:
        send_handshake(sock, [Kind.HELLO, {"v": VERSION, "lease": lease_id, "token": token}])
        reply = recv_handshake(sock)
        assert reply.head[0] == Kind.WELCOME, reply.head
        return int(reply.head[1]["memory_limit_bytes"])


def test_an_agents_worker_holds_no_token_runs_confined_and_admits_its_token_as_client_only(
    pool: Pool,
) -> None:
    with PoolClient(pool.url, token=ADMIN_TOKEN) as api:
        made = api.create_lease(
            LeaseCreate(access="remote", compute_pct=10, memory=f"{MEMORY_MIB}MiB", ttl_s=120)
        )
        token = made.token
        assert token
        lease = api.wait_for_workers(made.id)
        endpoint = lease.slices[0].endpoint
        assert endpoint is not None
        worker = _worker_of(lease.id)

        # The agent runs with the admin token in $GPUPOOL_TOKEN (tests/conftest.py): the worker
        # has neither it nor the lease's token in its environment or argv.
        environ = Path(f"/proc/{worker.pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{worker.pid}/cmdline").read_bytes()
        assert b"GPUPOOL_TOKEN=" not in environ and b"GPUPOOL_WORKER_TOKEN=" not in environ
        for secret in (ADMIN_TOKEN, token):
            assert secret.encode() not in environ and secret.encode() not in cmdline

        # As the worker user, in a memory cgroup sized to the lease.
        user = pwd.getpwnam("gpupool-worker")
        assert worker.uids().real == worker.uids().effective == user.pw_uid
        cgroups = Path(f"/proc/{worker.pid}/cgroup").read_text()
        memory = next((line for line in cgroups.splitlines() if ":memory:" in line), None)
        group: Path | None = None
        if memory is not None:  # a cgroup v1 host, as this one: the agent must have made it
            assert "gpupool-workers" in memory, (pool.workdir / "agent.log").read_text()[-2000:]
            group = Path("/sys/fs/cgroup/memory") / memory.split(":", 2)[2].lstrip("/")
            limit = int((group / "memory.limit_in_bytes").read_text())
            assert limit == (MEMORY_MIB + 3072) << 20

        # The controller's data dir (its database holds every lease's tokens) is closed to it.
        ctl = pool.workdir / "ctl"
        os.chmod(pool.workdir, 0o755)  # reachable: only the controller's own modes keep it out
        probe = subprocess.run(
            [sys.executable, "-c", f"import os; os.listdir({str(ctl)!r})"],
            user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/",
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe.stderr

        # The lease's token: refused as the agent, a successor and a peer; the limit holds.
        address = parse_address(endpoint)
        for role in (Role.CONTROL, Role.SUCCESSOR, Role.PEER):
            with socket.create_connection((address.host, address.port), timeout=10) as sock:
                with pytest.raises(RemoteError) as refused:
                    role_handshake(sock, lease.id, token, role)
                assert refused.value.body.kind == ErrorKind.AUTH
        assert _welcome_limit(endpoint, lease.id, token) == MEMORY_MIB << 20

        api.release_lease(lease.id)
    worker.wait(timeout=scaled(60))
    if group is not None:  # the agent removes the cgroup once the worker is gone
        deadline = time.monotonic() + scaled(30)
        while group.exists():
            assert time.monotonic() < deadline, f"{group} is still there"
            time.sleep(0.2)
