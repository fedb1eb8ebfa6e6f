"""Workers started ahead of their leases (`gpupool agent --ready-workers`), with real worker
processes: a ready worker refuses every HELLO until its agent hands it a lease; a new lease is
served by one, under that lease's limits and credentials (a memory limit refused at the
lease's size, not the default); the pool refills after each hand-over and replaces a ready
worker that died; a ready worker is never reused: each lease gets a fresh process, which ends
with the lease; with none kept, a lease's worker starts cold."""

from __future__ import annotations

import os
import signal
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpupool.agent.mps import MpsSupervisor
from gpupool.agent.workers import Worker, WorkerSupervisor
from gpupool.protocol.v1.api import RemoteLease, RemoteSlice
from gpupool.protocol.v1.dataplane import (
    VERSION,
    Connection,
    ErrorKind,
    Handover,
    Kind,
    ProtocolError,
    Rec,
    RemoteError,
    Role,
    WorkerCredentials,
    connect,
    pack_records,
    parse_address,
    recv_handshake,
    role_handshake,
    send_handshake,
)
from gpupool.protocol.v1.tensors import DTYPE_EXT, REMOTE_DEVICE_EXT, handle_ext
from tests.timing import scaled, wait_until

pytestmark = pytest.mark.slow

GPU = "GPU-ready"
TOKEN = "client-token-of-the-lease"
MEMORY_MIB = 64
MiB = 1 << 20
F32 = DTYPE_EXT[torch.float32]
READY_S = 90.0
"""How long a ready worker may take to start on an idle machine (torch's import), unscaled."""


def _lease(memory_mib: int = MEMORY_MIB, token: str = TOKEN) -> RemoteLease:
    return RemoteLease(
        token=token,
        peer_secret="peer-secret",
        peers=[],
        slices=[RemoteSlice(gpu_uuid=GPU, gpu_index=0, compute_pct=25, memory_mib=memory_mib)],
    )


def _supervisor(tmp_path: Path, per_gpu: int) -> WorkerSupervisor:
    mps = MpsSupervisor(tmp_path / "mps")
    mps.enabled = False
    supervisor = WorkerSupervisor(
        tmp_path / "workers", mps, simulated=True, simulated_gpus={GPU: 1024},
        ready_per_gpu=per_gpu,
    )  # fmt: skip
    supervisor.ready.set_gpus([GPU])
    return supervisor


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[WorkerSupervisor]:
    started = _supervisor(tmp_path, per_gpu=1)
    yield started
    started.stop_all()


def _ready_pids(supervisor: WorkerSupervisor) -> set[int]:
    return {w.pid for w in supervisor.ready._ready.get(GPU, []) if w.standby.alive()}


def _wait_ready(supervisor: WorkerSupervisor, not_pids: frozenset[int] = frozenset()) -> int:
    """The pid of a ready worker of GPU once there is one (other than `not_pids`)."""
    pids = wait_until(
        lambda: _ready_pids(supervisor) - not_pids, "a ready worker", timeout_s=READY_S
    )
    return int(next(iter(pids)))


def _only_worker(supervisor: WorkerSupervisor) -> Worker:
    (worker,) = supervisor.workers.values()
    return worker


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


class Client:
    """A lease's client over raw data-plane frames: ones(n) and a sync."""

    def __init__(self, endpoint: str, lease: str, token: str = TOKEN) -> None:
        sock = connect(parse_address(endpoint))
        send_handshake(sock, [Kind.HELLO, {"v": VERSION, "lease": lease, "token": token}])
        reply = recv_handshake(sock).head
        if reply[0] == Kind.ERROR:
            sock.close()
            raise AssertionError(f"refused: {reply}")
        self.welcome: dict[str, Any] = reply[1]
        sock.settimeout(scaled(60))
        self.conn = Connection(sock)
        self.req = 0
        self.conn.send_body(pack_records([Kind.BATCH], [[Rec.DEF, 1, "aten::ones"]]))

    def ones(self, floats: int, handle: int) -> None:
        record = [Rec.OP, 1, [[floats]], {"dtype": F32, "device": REMOTE_DEVICE_EXT}, [handle]]
        self.conn.send_body(pack_records([Kind.BATCH], [record]))

    def sync(self) -> list[Any]:
        self.req += 1
        self.conn.send_body(pack_records([Kind.BATCH], [[Rec.SYNC, self.req]]))
        while True:
            head = self.conn.recv().head()
            if head[0] != Kind.NOTICE and head[1] == self.req:
                return head

    def read_first(self, handle: int) -> float:
        self.req += 1
        self.conn.send_body(pack_records([Kind.BATCH], [[Rec.READ, self.req, handle_ext(handle)]]))
        while True:
            frame = self.conn.recv()
            head = frame.head()
            tail = self.conn.read_tail() if frame.tail_len else b""
            if head[0] != Kind.NOTICE and head[1] == self.req:
                assert head[0] == Kind.DATA, head
                return float(struct.unpack_from("<f", tail)[0])

    def close(self) -> None:
        self.conn.close()


def _hello(endpoint: str, lease: str, token: str, role: str) -> ErrorKind | None:
    """HELLO in `role`: None if admitted, else the refusal's kind."""
    with connect(parse_address(endpoint)) as sock:
        try:
            role_handshake(sock, lease, token, role)
        except RemoteError as refused:
            return ErrorKind(refused.body.kind)
    return None


def test_a_ready_worker_refuses_every_hello_before_its_hand_over(
    supervisor: WorkerSupervisor,
) -> None:
    pid = _wait_ready(supervisor)
    (ready,) = supervisor.ready._ready[GPU]
    endpoint = str(ready.standby.address)
    # Whatever lease, role and token: nothing is open before the agent names the lease.
    for role, token in ((Role.CLIENT, TOKEN), (Role.CONTROL, TOKEN), (Role.PEER, "peer-secret"),
                        (Role.SUCCESSOR, ""), (Role.CLIENT, "")):  # fmt: skip
        assert _hello(endpoint, "l-ready", token, role) == ErrorKind.AUTH, role
    assert _alive(pid) and ready.standby.alive(), "refusing leaves it ready"
    supervisor.reconcile({"l-ready": _lease()})
    worker = _only_worker(supervisor)
    assert worker.proc.pid == pid and worker.endpoint == endpoint
    assert _hello(endpoint, "l-ready", TOKEN, Role.CLIENT) is None
    assert _hello(endpoint, "l-ready", TOKEN, Role.CONTROL) == ErrorKind.AUTH
    assert _hello(endpoint, "l-ready", worker.control_token, Role.CONTROL) is None


def test_a_new_lease_is_served_by_a_ready_worker_under_the_leases_limits(
    supervisor: WorkerSupervisor,
) -> None:
    pid = _wait_ready(supervisor)
    supervisor.reconcile({"l-ready": _lease()})
    worker = _only_worker(supervisor)
    assert worker.ready and worker.proc.pid == pid and worker.memory_mib == MEMORY_MIB
    (report,) = supervisor.reports()
    assert report.alive and report.endpoint == worker.endpoint and report.error is None
    client = Client(worker.endpoint, "l-ready")
    try:
        assert client.welcome["memory_limit_bytes"] == MEMORY_MIB * MiB
        client.ones(12 * MiB // 4, 10)  # 12 MiB of floats: fits the 64 MiB lease
        client.ones(40 * MiB // 4, 11)  # 40 MiB more: 52 MiB, still fits
        assert client.sync()[0] == Kind.RESULT
        client.ones(16 * MiB // 4, 12)  # 68 MiB: over the lease's limit, not a default's
        refused = client.sync()
        assert refused[0] == Kind.ERROR and refused[2]["kind"] == ErrorKind.OUT_OF_MEMORY
        assert "gpupool lease l-ready is out of GPU memory" in refused[2]["message"]
        assert client.read_first(11) == 1.0
    finally:
        client.close()
    # The agent's control secret reaches it: a live resize, as for a cold worker.
    supervisor.reconcile({"l-ready": _lease(memory_mib=128)})
    assert worker.memory_mib == 128
    # Its activity for the agent, in the worker's own directory, as the lease's status file.
    assert worker.directory is not None and worker.status_file.parent == worker.directory
    assert wait_until(lambda: supervisor.reports()[0].memory_mib is not None, "a status file")


def test_the_pool_refills_and_never_hands_out_a_worker_twice(
    supervisor: WorkerSupervisor,
) -> None:
    first = _wait_ready(supervisor)
    supervisor.reconcile({"l-one": _lease()})
    assert _only_worker(supervisor).proc.pid == first
    second = _wait_ready(supervisor, not_pids=frozenset({first}))  # refilled in the background
    assert first not in supervisor.ready.pids()
    directory = _only_worker(supervisor).directory
    supervisor.reconcile({})  # the lease ends: its worker ends with it, not back to the pool
    assert not _alive(first)
    assert directory is not None and not directory.exists()
    assert supervisor.ready.pids() == {second}
    supervisor.reconcile({"l-two": _lease(token="token-of-l-two")})
    worker = _only_worker(supervisor)
    assert worker.proc.pid == second != first
    assert _hello(worker.endpoint, "l-one", TOKEN, Role.CLIENT) == ErrorKind.AUTH
    assert _hello(worker.endpoint, "l-two", "token-of-l-two", Role.CLIENT) is None
    assert supervisor.ready.handed_over == 2


def test_a_ready_worker_that_dies_is_replaced(supervisor: WorkerSupervisor) -> None:
    dead = _wait_ready(supervisor)
    os.kill(dead, signal.SIGKILL)
    fresh = _wait_ready(supervisor, not_pids=frozenset({dead}))
    assert fresh != dead and dead not in supervisor.ready.pids()
    assert supervisor.ready.replaced == 1
    supervisor.reconcile({"l-after": _lease()})
    assert _only_worker(supervisor).proc.pid == fresh


def test_without_ready_workers_a_lease_starts_its_worker_cold(tmp_path: Path) -> None:
    supervisor = _supervisor(tmp_path, per_gpu=0)
    try:
        assert supervisor.ready.counts() == {} and supervisor.ready.wanted == 0
        supervisor.reconcile({"l-cold": _lease()})
        worker = _only_worker(supervisor)
        assert not worker.ready and worker.directory is None
        client = Client(worker.endpoint, "l-cold")
        client.close()
        assert client.welcome["memory_limit_bytes"] == MEMORY_MIB * MiB
        assert supervisor.ready_facts()["ready_workers_per_gpu"] == 0
    finally:
        supervisor.stop_all()


def test_a_ready_worker_leaves_when_its_agent_closes_the_hand_over_pipe(
    supervisor: WorkerSupervisor,
) -> None:
    """An agent that dies closes the pipe: its ready workers do not outlive it."""
    pid = _wait_ready(supervisor)
    (ready,) = supervisor.ready._ready[GPU]
    ready.standby._stdin.close()
    ready.standby.proc.wait(timeout=scaled(30))
    assert ready.standby.proc.returncode == 0 and not _alive(pid)


def test_a_hand_over_line_is_checked_before_the_worker_acts_on_it() -> None:
    good = Handover("l", WorkerCredentials("c", "k", "p"), memory_limit_mib=64,
                    mps_env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"})  # fmt: skip
    assert Handover.from_line(good.to_line()) == good
    for bad, said in (
        (b"not json\n", "not JSON"),
        (b'{"lease": ""}\n', "names no lease"),
        (b'{"lease": "l", "credentials": {"client": ""}}\n', "no client token"),
        (b'{"lease": "l", "credentials": {"client": "c"}, "memory_limit_mib": -1}\n', "positive"),
        (b'{"lease": "l", "credentials": {"client": "c"}, "mps_env": {"LD_PRELOAD": "x"}}\n',
         "not LD_PRELOAD"),
    ):  # fmt: skip
        with pytest.raises(ProtocolError, match=said):
            Handover.from_line(bad)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--standby", "--lease", "l", "--ready-fd", "3"], "drop --lease"),
        (["--standby", "--memory-limit-mib", "64", "--ready-fd", "3"], "drop --memory-limit-mib"),
        (["--standby", "--credentials-stdin", "--ready-fd", "3"], "drop --credentials-stdin"),
        (["--standby"], "--standby needs --ready-fd"),
        (["--standby", "--ready-fd", "3", "--context-ahead"], "for a CUDA worker"),
        (["--lease", "l", "--context-ahead"], "for a ready worker"),
        ([], "--lease is required (or --standby"),
    ],
)
def test_a_ready_worker_takes_nothing_of_a_lease_from_its_command_line(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpupool.worker.__main__ import parse_args

    monkeypatch.setenv("GPUPOOL_WORKER_TOKEN", "t")
    with pytest.raises(SystemExit) as refused:
        parse_args(argv)
    assert refused.value.code == 2 and said in capsys.readouterr().err


def test_a_ready_worker_stays_the_agents_own_through_its_hand_over(
    supervisor: WorkerSupervisor,
) -> None:
    """Under MPS a ready worker makes its CUDA context while it is handed over; the direct-slice
    watch, which stops GPU processes the agent does not count as its own, stopped it there in
    about half of the hand-overs on the H200 machine (the lease then waited for a cold start).
    From the moment the pool hands it out until it is the lease's worker, pids() has it."""
    pid = _wait_ready(supervisor)
    (ready,) = supervisor.ready._ready[GPU]
    hand_over = ready.standby.hand_over
    seen: list[tuple[str, bool]] = []

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(("before", pid in supervisor.pids()))
        answer = hand_over(*args, **kwargs)  # the worker makes its context in here
        seen.append(("after", pid in supervisor.pids()))
        return answer

    ready.standby.hand_over = watched  # type: ignore[method-assign]
    supervisor.reconcile({"l-watched": _lease()})
    assert _only_worker(supervisor).proc.pid == pid
    assert seen == [("before", True), ("after", True)]
    assert pid in supervisor.pids() and pid not in supervisor.ready.pids()
