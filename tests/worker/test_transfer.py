"""The receiving side of copies between a lease's workers: transfers over a real socket pair."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from gpupool.protocol.v1.dataplane import Connection, Kind, ProtocolError
from gpupool.worker.transfer import Arrivals, TransferFailed


def _pair() -> tuple[Connection, Arrivals, threading.Thread, list[BaseException]]:
    left, right = socket.socketpair()
    arrivals = Arrivals()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            arrivals.serve_peer(Connection(right))
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return Connection(left), arrivals, thread, errors


def _send(conn: Connection, xid: int, tensor: torch.Tensor, chunk: int = 7) -> None:
    data = tensor.contiguous().numpy().tobytes()
    conn.send([Kind.TRANSFER, xid, str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
               len(data)])  # fmt: skip
    for offset in range(0, len(data), chunk):
        conn.send([Kind.PUT, xid, offset], data[offset : offset + chunk])


def test_transfers_arrive_by_id_in_chunks() -> None:
    conn, arrivals, _, errors = _pair()
    first, second = torch.arange(10.0).reshape(2, 5), torch.tensor([1, 2, 3])
    _send(conn, 2, second)
    _send(conn, 1, first)
    assert torch.equal(arrivals.take(1, timeout_s=5), first)
    assert torch.equal(arrivals.take(2, timeout_s=5), second)
    assert not errors


def test_a_failed_sender_and_a_missing_one_are_errors() -> None:
    conn, arrivals, _, _ = _pair()
    conn.send([Kind.TRANSFER, 3, None, "an earlier op failed: boom"])
    with pytest.raises(TransferFailed, match="could not send the tensor: an earlier op failed"):
        arrivals.take(3, timeout_s=5)
    with pytest.raises(TransferFailed, match="no data arrived"):
        arrivals.take(4, timeout_s=0.05)


def test_an_abandoned_transfer_is_dropped_when_it_comes() -> None:
    conn, arrivals, _, _ = _pair()
    arrivals.abandon(5)
    _send(conn, 5, torch.ones(3))
    _send(conn, 6, torch.zeros(2))
    assert torch.equal(arrivals.take(6, timeout_s=5), torch.zeros(2))
    assert arrivals._arrived == {} and arrivals._abandoned == set()


@pytest.mark.parametrize(
    "head",
    [
        [Kind.TRANSFER, 1, "float32", [4], 15],  # bytes that do not fit dtype and shape
        [Kind.TRANSFER, 1, "float32", [-1], 4],
        [Kind.TRANSFER, 1, "no-such-dtype", [1], 4],
        [Kind.PUT, 1, 0],
    ],
)
def test_a_malformed_transfer_ends_the_peer_connection(head: list[object]) -> None:
    conn, _, thread, errors = _pair()
    conn.send(head)
    thread.join(5)
    assert not thread.is_alive() and errors and isinstance(errors[0], ProtocolError)
