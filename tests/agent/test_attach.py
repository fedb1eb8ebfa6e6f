"""The agent's attach socket: the kernel names the process, the token proves the lease, and
hostile bytes get a reason and change nothing."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from gpupool.agent.attach import AttachServer
from gpupool.agent.watch import DirectWatch, WatchMode
from gpupool.protocol.v1.api import DirectLease, DirectSlice
from gpupool.protocol.v1.attach import MAX_LINE_BYTES, AttachRefused, attach, token_sha256

TOKEN = "the-lease-token"
LEASE = DirectLease(
    token_sha256=token_sha256(TOKEN),
    slices=[DirectSlice(gpu_uuid="GPU-0", compute_pct=30, memory_mib=1024)],
)


class Learner:
    """Stands in for the agent's early heartbeat: the controller names the lease on the
    first call."""

    def __init__(self, watch: DirectWatch, leases: dict[str, DirectLease]) -> None:
        self.watch, self.leases, self.calls = watch, leases, 0

    async def __call__(self) -> None:
        self.calls += 1
        self.watch.set_leases(self.leases)


Scenario = Callable[[AttachServer, Learner, Path], Awaitable[None]]


def served(tmp_path: Path, scenario: Scenario) -> None:
    """Run `scenario` against a real attach server on a Unix socket, in its own loop."""

    async def main() -> None:
        watch = DirectWatch(WatchMode.ENFORCE, set)
        watch.set_leases({})
        learner = Learner(watch, {"l-a": LEASE})
        path = tmp_path / "direct.sock"
        server = AttachServer(path, watch, learner)
        await server.start()
        try:
            await scenario(server, learner, path)
        finally:
            await server.stop()

    asyncio.run(main())


async def raw(path: Path, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(payload)
    await writer.drain()
    answer = await reader.readline()
    writer.close()
    return answer


def test_the_connecting_process_is_attached_once_the_lease_is_learned(tmp_path: Path) -> None:
    async def scenario(server: AttachServer, learner: Learner, path: Path) -> None:
        pid = await asyncio.to_thread(attach, path, "l-a", TOKEN)
        assert pid == os.getpid(), "the kernel's pid, whatever the message says"
        assert learner.calls == 1, "an unknown lease makes the agent ask the controller first"
        assert [(r.pid, r.lease_id) for r in server.watch.roots()] == [(os.getpid(), "l-a")]
        assert os.stat(path).st_mode & 0o777 == 0o666

    served(tmp_path, scenario)


def test_another_process_attaches_itself_not_its_caller(tmp_path: Path) -> None:
    async def scenario(server: AttachServer, _: Learner, path: Path) -> None:
        code = (
            "from pathlib import Path; from gpupool.protocol.v1.attach import attach; "
            f"print(attach(Path({str(path)!r}), 'l-a', {TOKEN!r}))"
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdout=subprocess.PIPE
        )
        out, _err = await proc.communicate()
        assert int(out) == proc.pid
        assert {r.pid for r in server.watch.roots()} == {proc.pid}, "itself, not the agent"
        assert server.attached == 1

    served(tmp_path, scenario)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"not json\n", "bad attach request"),
        (b'{"lease_id": "l-a"}\n', "token"),
        (b'{"lease_id": "l-a", "token": "x", "pid": 1}\n', "pid"),
        (b'{"lease_id": "../../etc", "token": "x"}\n', "lease_id"),
        (b'{"lease_id": "l-a", "token": "' + b"x" * (MAX_LINE_BYTES + 10) + b'"}\n', "longer"),
        (b'{"lease_id": "l-a", "token": "guessed"}\n', "wrong token"),
        (b'{"lease_id": "l-other", "token": "the-lease-token"}\n', "no direct slice"),
    ],
)
def test_hostile_requests_are_refused_with_a_reason_and_attach_nothing(
    tmp_path: Path, payload: bytes, reason: str
) -> None:
    async def scenario(server: AttachServer, _: Learner, path: Path) -> None:
        answer = await raw(path, payload)
        assert b'"ok":false' in answer and reason.encode() in answer, answer
        assert server.watch.roots() == []
        assert (server.refused, server.attached) == (1, 0)

    served(tmp_path, scenario)


def test_a_silent_client_does_not_hold_the_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpupool.agent.attach as module

    monkeypatch.setattr(module, "READ_TIMEOUT_S", 0.2)

    async def scenario(_server: AttachServer, _: Learner, path: Path) -> None:
        reader, writer = await asyncio.open_unix_connection(str(path))
        answer = await reader.readline()
        writer.close()
        assert b"no request within" in answer
        assert await asyncio.to_thread(attach, path, "l-a", TOKEN) == os.getpid()

    served(tmp_path, scenario)


def test_the_client_says_why_it_was_refused(tmp_path: Path) -> None:
    async def scenario(_server: AttachServer, _: Learner, path: Path) -> None:
        with pytest.raises(AttachRefused, match="wrong token"):
            await asyncio.to_thread(attach, path, "l-a", "nope")

    served(tmp_path, scenario)


def test_a_socket_path_longer_than_sockaddr_un_still_works(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)

    async def scenario(_server: AttachServer, _: Learner, path: Path) -> None:
        assert len(str(path)) > 108 and await asyncio.to_thread(path.is_socket)
        assert await asyncio.to_thread(attach, path, "l-a", TOKEN) == os.getpid()

    served(deep, scenario)
    assert not (deep / "direct.sock").exists()


def test_the_client_refuses_an_answer_that_is_not_one(tmp_path: Path) -> None:
    path = tmp_path / "liar.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def answer() -> None:
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\n")
        conn.close()

    import threading

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with pytest.raises(AttachRefused, match="something else"):
            attach(path, "l-a", TOKEN, timeout_s=5)
    finally:
        thread.join()
        listener.close()
