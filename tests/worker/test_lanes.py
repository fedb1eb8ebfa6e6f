"""A client's lanes (extra TCP connections for its large puts' bytes) against hostile use:
only the current session's key opens one, each index once; a lane that sends what the put did
not announce ends that session with a protocol error, and the worker serves the next client."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpupool.protocol.v1.dataplane import (
    LANE_CHUNK_BYTES,
    PUT_LANES,
    VERSION,
    Connection,
    ConnectionClosed,
    ErrorKind,
    Ext,
    Kind,
    Rec,
    Role,
    connect,
    pack_records,
    parse_address,
    recv_handshake,
    send_handshake,
)
from tests.timing import scaled
from tests.worker.raw_frames import (
    Raw,
    Worker,
    authenticate_to,
    ext,
    framed,
    start_worker,
    tensor,
)

TOKEN = "lane-token-0123456789abcdef"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    log = tmp_path_factory.mktemp("logs") / "lanes.log"
    worker = start_worker("lease-lanes", TOKEN, log)
    yield worker
    worker.stop()


def _session(worker: Worker) -> tuple[Raw, dict[str, Any]]:
    sock, welcome = authenticate_to(worker.address, worker.lease, worker.token)
    assert welcome["lanes"]["count"] == 4, welcome
    return Raw(sock), welcome["lanes"]


def _lane(worker: Worker, key: Any, index: Any, token: str = TOKEN) -> socket.socket:
    sock = connect(parse_address(worker.address))
    sock.settimeout(scaled(10))
    hello = {"v": VERSION, "lease": worker.lease, "token": token, "role": Role.LANE,
             "key": key, "lane": index}  # fmt: skip
    send_handshake(sock, [Kind.HELLO, hello])
    head = recv_handshake(sock).head
    if head[0] != Kind.WELCOME:
        sock.close()
        raise PermissionError(head[2])
    return sock


def _tensor(client: Raw, handle: int, nbytes: int) -> None:
    client.run("aten::empty.memory_format", [[nbytes // 4]],
               {"dtype": ext(Ext.DTYPE, "float32")}, [handle])  # fmt: skip
    assert client.sync()[0] == Kind.RESULT


def test_only_the_sessions_key_opens_a_lane_and_each_index_once(worker: Worker) -> None:
    client, offer = _session(worker)
    for key, index, token in [
        ("0" * 32, 0, TOKEN),  # another key
        (offer["key"], 4, TOKEN),  # beyond the offer
        (offer["key"], -1, TOKEN),
        (offer["key"], True, TOKEN),
        (offer["key"], 0, "not-the-token"),
        (None, 0, TOKEN),
    ]:
        with pytest.raises(PermissionError) as refused:
            _lane(worker, key, index, token)
        assert refused.value.args[0]["kind"] == ErrorKind.AUTH
    first = _lane(worker, offer["key"], 0)
    with pytest.raises(PermissionError):
        _lane(worker, offer["key"], 0)  # index 0 is taken
    assert client.sync()[0] == Kind.RESULT, "the session goes on"
    client.close()
    first.close()
    # The key dies with its session: a later client's lanes need that client's key.
    later, later_offer = _session(worker)
    assert later_offer["key"] != offer["key"]
    with pytest.raises(PermissionError):
        _lane(worker, offer["key"], 1)
    later.close()


@pytest.mark.parametrize(
    "lie",
    ["offset", "handle", "short", "kind"],
)
def test_a_lane_that_sends_what_the_put_did_not_announce_ends_the_session(
    worker: Worker, lie: str
) -> None:
    client, offer = _session(worker)
    lanes = [Connection(_lane(worker, offer["key"], i)) for i in range(offer["count"])]
    nbytes = 4 * LANE_CHUNK_BYTES
    _tensor(client, 7, nbytes)
    client.send([[Rec.PUT, 7, "float32", [nbytes // 4], None, nbytes, None, PUT_LANES]])
    chunk = b"\0" * LANE_CHUNK_BYTES
    for i, lane in enumerate(lanes):
        head: list[Any] = [Kind.PUT, 7, i * LANE_CHUNK_BYTES]
        tail = chunk
        if i == 2:
            if lie == "offset":
                head[2] += 8
            elif lie == "handle":
                head[1] = 8
            elif lie == "short":
                tail = chunk[:-4]
            else:
                head[0] = Kind.BATCH
        with contextlib.suppress(ConnectionClosed):  # the worker may have closed it already
            lane.send(head, tail)
    client.sock.settimeout(scaled(20))
    reply = Connection(client.sock)
    error = reply.recv().head()
    assert error[0] == Kind.ERROR and error[2]["kind"] == ErrorKind.PROTOCOL, error
    for lane in lanes:
        lane.close()
    client.close()
    # The worker serves the next client, whose puts over lanes land.
    after, after_offer = _session(worker)
    fresh = [Connection(_lane(worker, after_offer["key"], i)) for i in range(4)]
    _tensor(after, 9, nbytes)
    after.send([[Rec.PUT, 9, "float32", [nbytes // 4], None, nbytes, None, PUT_LANES]])
    for i, lane in enumerate(fresh):
        lane.send(
            [Kind.PUT, 9, i * LANE_CHUNK_BYTES], b"\x00\x00\x80\x3f" * (LANE_CHUNK_BYTES // 4)
        )
    after.run("aten::sum", [tensor(9)], {}, [10])
    assert after.read_floats(10) == [float(nbytes // 4)]
    for lane in fresh:
        lane.close()
    after.close()


def test_a_put_over_lanes_on_a_unix_socket_session_is_a_protocol_error(tmp_path: Path) -> None:
    sock_path = Path(f"/tmp/gp-lanes-{tmp_path.name[-8:]}.sock")
    log = tmp_path / "unix.log"
    worker = start_worker("lease-lanes", TOKEN, log, listen=f"unix:{sock_path}")
    try:
        sock, welcome = authenticate_to(worker.address, worker.lease, worker.token)
        assert welcome["lanes"] is None
        client = Raw(sock)
        _tensor(client, 3, 4 * LANE_CHUNK_BYTES)
        client.sock.sendall(framed(pack_records([Kind.BATCH], [
            [Rec.PUT, 3, "float32", [LANE_CHUNK_BYTES], None, 4 * LANE_CHUNK_BYTES, None,
             PUT_LANES],
            [Rec.SYNC, 99],
        ])))  # fmt: skip
        error = Connection(client.sock).recv().head()
        assert error[0] == Kind.ERROR and "lanes" in error[2]["message"], error
        client.close()
    finally:
        worker.stop()
