"""A real worker process: ready line, one client at a time, activity for the agent, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gpupool.torch
from gpupool.protocol.v1.dataplane import (
    VERSION,
    ErrorKind,
    Kind,
    connect,
    parse_address,
    recv_handshake,
    send_handshake,
    start_worker_process,
)
from tests.timing import scaled

pytestmark = pytest.mark.slow
TOKEN = "worker-test-token"


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    status = tmp_path_factory.mktemp("status") / "worker.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc, ready = start_worker_process("lease-w", TOKEN, env=env, threads=1, status_file=status)
    assert ready.lease == "lease-w" and ready.device == "cpu" and ready.pid == proc.pid
    yield proc, str(ready.address), status
    proc.terminate()
    proc.wait(timeout=scaled(10))


def hello(
    address: str, token: str = TOKEN, lease: str = "lease-w"
) -> tuple[socket.socket, list[object]]:
    sock = connect(parse_address(address))
    send_handshake(sock, [Kind.HELLO, {"v": VERSION, "lease": lease, "token": token, "shm": False}])
    return sock, recv_handshake(sock).head


def wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_status_file_tells_the_agent_last_op_time_and_memory_held(
    worker: tuple[subprocess.Popen[str], str, Path],
) -> None:
    _, address, status = worker
    read = lambda: json.loads(status.read_text())  # noqa: E731
    assert read()["client_connected"] is False and read()["lease_id"] == "lease-w"
    gpupool.torch.attach(workers=[address], token=TOKEN, lease="lease-w")
    try:
        x = torch.ones(256, 1024, device="cuda")
        torch.cuda.synchronize()
        wait_for(lambda: read()["client_connected"] and read()["memory_held_bytes"] == 1 << 20)
        started = read()["last_op_at"]
        assert started is not None and abs(started - time.time()) < 30
        del x
    finally:
        gpupool.torch.detach()
    wait_for(lambda: not read()["client_connected"] and read()["memory_held_bytes"] == 0)
    assert read()["ops_total"] > 0


def test_one_client_at_a_time(worker: tuple[subprocess.Popen[str], str, Path]) -> None:
    _, address, _ = worker
    gpupool.torch.attach(workers=[address], token=TOKEN, lease="lease-w")
    try:
        sock, head = hello(address)
        sock.close()
        assert head[0] == Kind.ERROR and head[2]["kind"] == ErrorKind.BUSY  # type: ignore[index]
        assert torch.ones(2, device="cuda").sum().item() == 2.0
    finally:
        gpupool.torch.detach()
    gpupool.torch.attach(workers=[address], token=TOKEN, lease="lease-w")
    gpupool.torch.detach()


def test_a_new_client_waits_for_the_last_call_of_a_client_that_was_killed(
    worker: tuple[subprocess.Popen[str], str, Path],
) -> None:
    """A killed program leaves its worker running what it queued (here seconds of matmuls; in
    CI it was a GPT-2 Inductor compile). The next client learns the worker is finishing for a
    client that has gone and waits for it, instead of failing after the few seconds a live
    client's reconnect needs (one timeout then failed every later test on that worker)."""
    _, address, status = worker
    program = f"""
import os, threading, torch, gpupool.torch
gpupool.torch.attach(workers=[{address!r}], token={TOKEN!r}, lease="lease-w")
x = torch.randn(2048, 2048, device="cuda")
y = x
for _ in range(50):
    y = (y @ x) * 0.01
threading.Timer(0.5, lambda: os._exit(0)).start()
y.sum().item()
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", program], env=env, timeout=scaled(60))
    assert killed.returncode == 0, "the program ends while its last call still runs"
    connected = json.loads(status.read_text())["client_connected"]
    assert connected, "the worker is still busy with the killed program's matmuls"
    sock, head = hello(address)
    sock.close()
    assert head[0] == Kind.ERROR and head[2]["kind"] == ErrorKind.BUSY  # type: ignore[index]
    assert head[2].get("gone") is True, head  # type: ignore[index]
    gpupool.torch.attach(workers=[address], token=TOKEN, lease="lease-w")
    try:
        assert torch.ones(2, device="cuda").sum().item() == 2.0
    finally:
        gpupool.torch.detach()


def test_a_connection_without_the_lease_token_is_refused(
    worker: tuple[subprocess.Popen[str], str, Path],
) -> None:
    _, address, _ = worker
    for token, lease in (("wrong", "lease-w"), (TOKEN, "another-lease")):
        sock, head = hello(address, token=token, lease=lease)
        assert head[0] == Kind.ERROR and head[2]["kind"] == ErrorKind.AUTH  # type: ignore[index]
        assert sock.recv(1) == b"", "the worker closes a refused connection"
        sock.close()
    with pytest.raises(gpupool.torch.AttachError, match="no valid token"):
        gpupool.torch.attach(workers=[address], token="wrong", lease="lease-w")


def test_worker_stops_on_sigterm_and_removes_its_socket(tmp_path: Path) -> None:
    path = tmp_path / "w.sock"
    proc, ready = start_worker_process("lease-s", TOKEN, listen=f"unix:{path}", threads=1)
    assert ready.address.path == str(path) and path.exists()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=scaled(10)) == 0
    assert not path.exists()


def test_a_worker_whose_device_broke_says_so_after_its_client_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sticky CUDA error (a device-side assert) fails every call after it: the reset after
    the client left reports it (the worker then ends with WORKER_EXIT_DEVICE_BROKEN) instead
    of raising inside the connection's cleanup and leaving the worker busy for good."""
    from gpupool.worker.server import Worker, WorkerConfig

    worker = Worker(WorkerConfig(lease_id="lease-broken", token="t", device="cpu"))

    def broken_reset() -> None:
        raise RuntimeError("CUDA error: device-side assert triggered\nmore detail")

    assert worker._reset_after_client() is None
    monkeypatch.setattr(worker.executor, "reset", broken_reset)
    assert worker._reset_after_client() == "CUDA error: device-side assert triggered"


def test_the_agent_names_a_worker_that_ended_on_a_broken_device() -> None:
    from gpupool.agent.workers import Worker as AgentWorker
    from gpupool.protocol.v1.dataplane import WORKER_EXIT_DEVICE_BROKEN

    proc = subprocess.Popen(
        [sys.executable, "-c", f"raise SystemExit({WORKER_EXIT_DEVICE_BROKEN})"]
    )
    proc.wait()
    text = AgentWorker._exit_text(type("W", (), {"proc": proc})())  # type: ignore[arg-type]
    assert "GPU context unusable" in text


def _allowed_cpus(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of the process."""
    lists = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists.add(line.split(":", 1)[1].strip())
    return lists


def test_cpus_confines_every_thread_of_the_worker() -> None:
    last = max(os.sched_getaffinity(0))
    proc, ready = start_worker_process("lease-c", TOKEN, threads=1, cpus=str(last))
    try:
        gpupool.torch.attach(workers=[str(ready.address)], token=TOKEN, lease="lease-c")
        # Ops ran, so the serving threads exist; all of them stay on that CPU.
        assert (torch.ones(64, device="cuda") * 2).sum().item() == 128.0
        assert _allowed_cpus(proc.pid) == {str(last)}
    finally:
        gpupool.torch.detach()
        proc.terminate()
        proc.wait(timeout=scaled(10))


@pytest.mark.parametrize(
    ("cpus", "reason"),
    [("x", "not a CPU number"), ("3-1", "not a CPU number"), ("100000", "not available")],
)
def test_bad_cpus_fail_in_one_line(
    cpus: str, reason: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpupool.worker.__main__ import parse_args

    monkeypatch.setenv("GPUPOOL_WORKER_TOKEN", "t")
    with pytest.raises(SystemExit) as exited:
        parse_args(["--lease", "l", "--cpus", cpus])
    assert exited.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--cpus" in errors[0] and reason in errors[0]
