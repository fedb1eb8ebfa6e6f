"""Each role of a real worker process opens with its own secret only: the lease's client token
(all a tenant has) is refused as the agent, a successor and a peer, and a SEND reaches only the
workers its agent named. Each attack is seen refused and changes nothing."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gpupool.torch
from gpupool.cli.local import stop_process
from gpupool.protocol.v1.dataplane import (
    VERSION,
    Connection,
    ConnectionClosed,
    ErrorKind,
    Kind,
    Rec,
    RemoteError,
    Role,
    WorkerCredentials,
    WorkerReady,
    parse_address,
    recv_handshake,
    role_handshake,
    send_control,
    send_handshake,
    start_worker_process,
)

TOKEN = "client-token-of-lease-r"
LEASE = "lease-r"
LIMIT_MIB = 64


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerReady]:
    log = tmp_path_factory.mktemp("roles") / "worker.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc, ready = start_worker_process(
        LEASE, TOKEN, env=env, threads=1, memory_limit_mib=LIMIT_MIB, log_file=log,
        peer_wait_s=0.5,
    )  # fmt: skip
    yield ready
    stop_process(proc)


def _control(ready: WorkerReady, body: dict[str, object]) -> dict[str, object]:
    assert ready.credentials is not None
    return send_control(ready.address, LEASE, ready.credentials.control, body)


def _hello(ready: WorkerReady, role: str, token: str) -> None:
    """HELLO as `role` with `token`; raises RemoteError with the worker's refusal."""
    sock = socket.create_connection((ready.address.host, ready.address.port), timeout=10)
    try:
        role_handshake(sock, LEASE, token, role)
        if role == Role.CONTROL:  # let in: what it may do is what the attack wants
            conn = Connection(sock)
            conn.send([Kind.CONTROL, 1, {"op": "limits", "memory_limit_mib": None}])
            conn.recv()
    finally:
        sock.close()


@pytest.mark.parametrize("role", [Role.CONTROL, Role.SUCCESSOR, Role.PEER])
def test_the_client_token_opens_no_other_role_and_the_limit_still_holds(
    worker: WorkerReady, role: str
) -> None:
    with pytest.raises(RemoteError) as refused:
        _hello(worker, role, TOKEN)
    assert refused.value.body.kind == ErrorKind.AUTH
    status = _control(worker, {"op": "status"})
    assert status["memory_limit_bytes"] == LIMIT_MIB << 20
    assert status["swapped"] is False


def test_a_secret_opens_its_own_role_only(worker: WorkerReady) -> None:
    credentials = worker.credentials
    assert credentials is not None
    for role, token in [
        (Role.CLIENT, credentials.control),
        (Role.CLIENT, credentials.peer),
        (Role.CONTROL, credentials.peer),
        (Role.PEER, credentials.control),
        (Role.SUCCESSOR, credentials.control),
        ("admin", TOKEN),
    ]:
        with pytest.raises(RemoteError):
            _hello(worker, role, token)
    assert _control(worker, {"op": "status"})["memory_limit_bytes"] == LIMIT_MIB << 20


def test_the_agent_changes_the_limit_with_its_control_secret(worker: WorkerReady) -> None:
    assert _control(worker, {"op": "limits", "memory_limit_mib": 32})["memory_limit_bytes"] == (
        32 << 20
    )
    assert _control(worker, {"op": "limits", "memory_limit_mib": LIMIT_MIB})[
        "memory_limit_bytes"
    ] == (LIMIT_MIB << 20)


def test_a_peer_transfer_with_the_client_token_is_refused_before_any_byte(
    worker: WorkerReady,
) -> None:
    """The 30-byte TRANSFER head that made a worker allocate 256 GiB never gets read."""
    import psutil

    before = psutil.Process(worker.pid).memory_info().rss
    sock = socket.create_connection((worker.address.host, worker.address.port), timeout=10)
    with sock:
        hello = {"v": VERSION, "lease": LEASE, "token": TOKEN, "role": Role.PEER}
        head = Connection(sock)
        send_handshake(sock, [Kind.HELLO, hello])
        with contextlib.suppress(OSError, ConnectionClosed):  # it may close first
            head.send([Kind.TRANSFER, 1, "float32", [1 << 36], 1 << 38])
        reply = recv_handshake(sock)
        assert reply.head[0] == Kind.ERROR
        # closed: nothing after the HELLO was taken (a reset if our bytes were left unread)
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(1) == b""
    assert psutil.Process(worker.pid).memory_info().rss < before + (64 << 20)


def test_the_worker_environment_and_argv_hold_no_token(worker: WorkerReady) -> None:
    environ = Path(f"/proc/{worker.pid}/environ").read_bytes()
    cmdline = Path(f"/proc/{worker.pid}/cmdline").read_bytes()
    credentials = worker.credentials
    assert credentials is not None
    for secret in (TOKEN, credentials.control, credentials.peer):
        assert secret.encode() not in environ
        assert secret.encode() not in cmdline
    assert b"GPUPOOL_WORKER_TOKEN=" not in environ


def test_the_worker_output_goes_to_its_log_not_to_a_pipe(worker: WorkerReady) -> None:
    for fd in (1, 2):
        target = os.readlink(f"/proc/{worker.pid}/fd/{fd}")
        assert not target.startswith("pipe:"), target
        assert target.endswith("worker.log")
    assert os.readlink(f"/proc/{worker.pid}/fd/0") == "/dev/null"


@pytest.fixture
def attached(worker: WorkerReady) -> Iterator[None]:
    torch.set_num_threads(1)
    gpupool.torch.attach(workers=[str(worker.address)], token=TOKEN, lease=LEASE)
    yield
    gpupool.torch.detach()


def test_a_send_to_an_address_the_agent_did_not_name_is_refused_and_connects_nowhere(
    worker: WorkerReady, attached: None
) -> None:
    from gpupool.torch import runtime

    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(8)
        trap.setblocking(False)
        host, port = trap.getsockname()
        _control(worker, {"op": "peers", "endpoints": [str(worker.address)]})
        source = torch.arange(4.0, device="cuda:0")
        stream = runtime.stream(0)
        stream.emit([Rec.SEND, 77, source._gp.ext, f"tcp://{host}:{port}"])  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match="not a worker of lease"):
            source.cpu()
        with pytest.raises(BlockingIOError):  # nobody ever connected to it
            trap.accept()
    gpupool.torch.detach()
    gpupool.torch.attach(workers=[str(worker.address)], token=TOKEN, lease=LEASE)
    assert torch.equal(torch.ones(3, device="cuda:0").cpu(), torch.ones(3))


def test_a_peer_list_that_is_not_addresses_is_refused(worker: WorkerReady) -> None:
    for endpoints in ("tcp://127.0.0.1:1", [1, 2], ["nowhere"] * 100):
        with pytest.raises(RemoteError):
            _control(worker, {"op": "peers", "endpoints": endpoints})


def test_credentials_come_on_stdin_and_a_worker_without_them_does_not_start(
    tmp_path: Path,
) -> None:
    from gpupool.protocol.v1.dataplane import worker_argv

    env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_WORKER_TOKEN"}
    done = subprocess.run(
        worker_argv("lease-none", credentials_stdin=True, threads=1),
        input=b"not json\n", capture_output=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert b"credentials" in done.stderr.splitlines()[-1]


def test_credentials_line_round_trips_and_rejects_bad_shapes() -> None:
    credentials = WorkerCredentials.generate("c", "p")
    assert WorkerCredentials.from_line(credentials.to_line()) == credentials
    assert credentials.admits(Role.PEER, "p") and credentials.admits(Role.SUCCESSOR, "p")
    assert not credentials.admits(Role.CONTROL, "c") and not credentials.admits(Role.PEER, "c")
    assert not WorkerCredentials("c").admits(Role.PEER, "")
    for bad in (b"[]", b'{"client": 5}', b'{"control": "x"}', b"\xff"):
        with pytest.raises(Exception, match="credentials"):
            WorkerCredentials.from_line(bad)


def test_the_address_in_the_peer_list_is_compared_in_one_spelling() -> None:
    from gpupool.worker.transfer import PeerLinks, PeerNotNamed

    links = PeerLinks("l", "secret", wait_s=0)
    assert links.name(["tcp://127.0.0.1:5000", None]) == [
        str(parse_address("tcp://127.0.0.1:5000"))
    ]
    with pytest.raises(PeerNotNamed):
        links.check_named("tcp://127.0.0.2:5000")
    assert links.check_named("tcp://127.0.0.1:5000")
    with pytest.raises(PeerNotNamed, match="peer secret"):
        PeerLinks("l", "", wait_s=0).check_named("tcp://127.0.0.1:5000")
