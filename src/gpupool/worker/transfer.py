"""Copies between two devices of one lease, worker to worker, not through the client.

A lease of several GPUs may span servers. For `t.to("cuda:1")` the client places a SEND
record in cuda:0's stream and a RECV record in cuda:1's, at the same point of its program;
the first worker sends the values to the second over a connection of their own (HELLO role
`peer`, the lease's worker secret, which the client never sees), and the second stores them
when its stream reaches the RECV. A worker connects only to the lease's workers its agent
named, whatever address a SEND record carries. Each
stream stays ordered, and the client neither waits nor carries the bytes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from gpupool.protocol.v1.dataplane import (
    CHUNK_BYTES,
    Connection,
    DataPlaneError,
    Kind,
    ProtocolError,
    RemoteError,
    Role,
    connect,
    parse_address,
    role_handshake,
)
from gpupool.protocol.v1.tensors import dtype_from_name, dtype_name, host_bytes
from gpupool.worker.memory import NO_RESERVATION, LimitExceeded, Reservation
from gpupool.worker.swap import bytes_of

log = logging.getLogger(__name__)

RECV_TIMEOUT_S = 120.0
"""How long a RECV waits for its bytes before the op fails (the sender is gone or stuck)."""
MAX_TRANSFER_BYTES = 256 << 30
"""A claim beyond this is refused before anything is allocated (a hostile or broken peer)."""


def dial_peer(
    address: str, lease: str, token: str, failed: type[Exception], whom: str
) -> Connection:
    """A peer-role connection to another worker of the lease (an endpoint its agent named:
    the caller checks), for transfers and for a group's store; what goes wrong raises
    `failed`, naming `whom` it could not reach."""
    try:
        sock = connect(parse_address(address))
    except (ValueError, OSError, DataPlaneError) as exc:
        raise failed(f"cannot reach {whom} at {address}: {exc}") from exc
    try:
        sock.settimeout(30)
        role_handshake(sock, lease, token, Role.PEER)
        sock.settimeout(None)
    except RemoteError as exc:
        sock.close()
        raise failed(f"the worker at {address} refused: {exc.body.message}") from exc
    except (OSError, DataPlaneError) as exc:
        sock.close()
        raise failed(f"handshake with the worker at {address} failed: {exc}") from exc
    return Connection(sock)


class TransferFailed(RuntimeError):
    pass


Reserve = Callable[[int, str], Reservation]
"""Charges a host buffer to the lease before it is allocated (raises LimitExceeded)."""


def _unlimited(nbytes: int, what: str) -> Reservation:
    return NO_RESERVATION


class Arrivals:
    """Tensors other workers of the lease sent here, by transfer id, until a RECV takes them."""

    def __init__(self, reserve: Reserve = _unlimited) -> None:
        self._arrived: dict[int, tuple[Any, ...]] = {}
        self._abandoned: set[int] = set()
        """Transfers whose RECV will not take them (the stream had failed): dropped on arrival."""
        self._changed = threading.Condition()
        self._reserve = reserve

    def bind(self, reserve: Reserve) -> None:
        """Charge every receive buffer to this lease's memory (the executor's)."""
        self._reserve = reserve

    def serve_peer(
        self, conn: Connection, store: Callable[[Connection, list[Any]], None] | None = None
    ) -> None:
        """A peer worker's connection (its own thread): receive transfers until it closes;
        STORE requests (a process group's rendezvous) go to `store`."""
        while True:
            frame = conn.recv()
            head = frame.head()
            if head and head[0] == Kind.STORE and store is not None:
                store(conn, head)
                continue
            if head[0] != Kind.TRANSFER or len(head) < 4 or not isinstance(head[1], int):
                raise ProtocolError("a peer sends [TRANSFER, id, dtype, shape, nbytes]")
            xid = head[1]
            if head[2] is None:  # the sender failed: the receiver reports why
                self._arrive(xid, ("error", str(head[3])[:2000]))
                continue
            if len(head) != 5:
                raise ProtocolError("a TRANSFER head has five fields")
            _, _, dtype, shape, nbytes = head
            torch_dtype = dtype_from_name(dtype)
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ProtocolError("a TRANSFER shape is a list of sizes")
            expected = math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()
            if nbytes != expected or nbytes > MAX_TRANSFER_BYTES:
                raise ProtocolError(f"TRANSFER of {nbytes} bytes for {dtype} {shape}")
            try:
                what = f"the copy from another device (transfer {xid})"
                reservation = self._reserve(nbytes, what)
            except LimitExceeded as exc:
                # Nothing is allocated: the RECV fails at once with the lease's out-of-memory
                # error, and the bytes are read and dropped as they come.
                self._arrive(xid, ("oom", str(exc)))
                self._receive(conn, xid, nbytes, None)
                continue
            try:
                # Not zero-filled: pages are touched only as the bytes arrive.
                buffer = torch.empty(nbytes, dtype=torch.uint8)
                self._receive(conn, xid, nbytes, bytes_of(buffer))
            except BaseException:
                reservation.release()
                raise
            self._arrive(xid, ("ok", torch_dtype, shape, buffer, reservation))

    @staticmethod
    def _receive(conn: Connection, xid: int, nbytes: int, into: memoryview | None) -> None:
        """The PUT frames of transfer `xid` into `into` (None: read and dropped)."""
        filled = 0
        while filled < nbytes:
            chunk = conn.recv()
            part = chunk.head()
            if part[0] != Kind.PUT or part[1] != xid or part[2] != filled or not chunk.tail_len:
                raise ProtocolError(f"transfer {xid}: expected bytes at offset {filled}")
            if filled + chunk.tail_len > nbytes:
                raise ProtocolError(f"transfer {xid}: more bytes than announced")
            if into is None:
                conn.skip_tail()
            else:
                conn.read_tail_into(into[filled : filled + chunk.tail_len])
            filled += chunk.tail_len

    def _arrive(self, xid: int, value: tuple[Any, ...]) -> None:
        with self._changed:
            if xid in self._abandoned:
                self._abandoned.discard(xid)
                _release(value)
                return
            _release(self._arrived.pop(xid, None))  # a second send under one id replaces it
            self._arrived[xid] = value
            self._changed.notify_all()

    def abandon(self, xid: int) -> None:
        """The RECV of xid will not wait for it: drop it now, or when it comes."""
        with self._changed:
            entry = self._arrived.pop(xid, None)
            if entry is None:
                self._abandoned.add(xid)
        _release(entry)

    def take(self, xid: int, timeout_s: float = RECV_TIMEOUT_S) -> torch.Tensor:
        """The host tensor sent under xid, waiting for it; raises TransferFailed, or
        LimitExceeded where it did not fit the lease (nothing was allocated for it)."""
        tensor, reservation = self.take_charged(xid, timeout_s)
        reservation.release()
        return tensor

    def take_charged(
        self, xid: int, timeout_s: float = RECV_TIMEOUT_S
    ) -> tuple[torch.Tensor, Reservation]:
        """As take(), with the charge of its buffer, for the caller to release once the
        tensor is stored (and counted) or dropped."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while xid not in self._arrived:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferFailed(
                        f"no data arrived from the other device within {timeout_s:g} s "
                        f"(transfer {xid}): its worker failed or cannot reach this one"
                    )
                self._changed.wait(left)
            entry = self._arrived.pop(xid)
        if entry[0] == "error":
            raise TransferFailed(f"the other device could not send the tensor: {entry[1]}")
        if entry[0] == "oom":
            raise LimitExceeded(entry[1])
        _, dtype, shape, buffer, reservation = entry
        if not buffer.numel():
            return torch.empty(shape, dtype=dtype), reservation
        return buffer.view(dtype).reshape(shape), reservation

    def clear(self) -> None:
        with self._changed:
            entries = list(self._arrived.values())
            self._arrived.clear()
            self._abandoned.clear()
        for entry in entries:
            _release(entry)


def _release(entry: tuple[Any, ...] | None) -> None:
    """Let an arrival's buffer go uncharged (it is being dropped)."""
    if entry is not None and entry[0] == "ok":
        entry[4].release()


PEER_WAIT_S = 10.0
"""How long a SEND to an address its agent has not named yet waits for the agent to name it:
a lease's workers learn each other's endpoints through their agents' heartbeats, which may
come a moment after the client learnt them from the controller."""
MAX_PEERS = 64


class PeerNotNamed(TransferFailed):
    """A SEND to an address that is not a worker of this lease: no connection is made."""


class PeerLinks:
    """This worker's connections to the other workers of its lease, one per address.

    It connects only to the endpoints its agent named (control op `peers`), never to an
    address a client's SEND record merely names: the client token must not make the worker
    open connections elsewhere and present the lease's peer secret there."""

    def __init__(self, lease: str, token: str, wait_s: float = PEER_WAIT_S) -> None:
        self.lease = lease
        self.token = token
        self.wait_s = wait_s
        self._conns: dict[str, Connection] = {}
        self._named: frozenset[str] = frozenset()
        self._changed = threading.Condition()

    def name(self, endpoints: object) -> list[str]:
        """The agent names the lease's workers: only these are ever connected to."""
        if not isinstance(endpoints, list) or len(endpoints) > MAX_PEERS:
            raise ProtocolError(f"peers is a list of at most {MAX_PEERS} endpoints")
        named = set()
        for endpoint in endpoints:
            if endpoint is None:
                continue  # a worker of the lease that does not listen yet
            if not isinstance(endpoint, str) or len(endpoint) > 256:
                raise ProtocolError("a peer endpoint is an address string")
            named.add(_normal(endpoint))
        with self._changed:
            self._named = frozenset(named)
            self._changed.notify_all()
        return sorted(named)

    @property
    def named(self) -> frozenset[str]:
        return self._named

    def check_named(self, address: str) -> str:
        """`address` as named by the agent, waiting a little for the agent to name it."""
        if not self.token:
            raise PeerNotNamed("this worker was started without its lease's peer secret")
        try:
            wanted = _normal(address)
        except ValueError as exc:
            raise PeerNotNamed(f"{address!r:.80} is not an address: {exc}") from None
        deadline = time.monotonic() + self.wait_s
        with self._changed:
            while wanted not in self._named:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerNotNamed(
                        f"{wanted:.200} is not a worker of lease {self.lease}: its agent named "
                        f"{len(self._named)} peer(s), not this one"
                    )
                self._changed.wait(left)
        return wanted

    def send(self, address: str, xid: int, host: torch.Tensor) -> None:
        conn = self._conn(address)
        host = host.contiguous()
        nbytes = host.numel() * host.element_size()
        try:
            conn.send([Kind.TRANSFER, xid, dtype_name(host.dtype), list(host.shape), nbytes])
            data = host_bytes(host)
            for offset in range(0, nbytes, CHUNK_BYTES):
                conn.send([Kind.PUT, xid, offset], data[offset : offset + CHUNK_BYTES])
        except (DataPlaneError, OSError):
            self._drop(address)
            raise

    def send_failure(self, address: str, xid: int, message: str) -> None:
        """Tell the receiver at once that nothing will come (it would wait for its timeout)."""
        with contextlib.suppress(DataPlaneError, OSError, TransferFailed):
            self._conn(address).send([Kind.TRANSFER, xid, None, message])

    def _conn(self, address: str) -> Connection:
        conn = self._conns.get(address)
        if conn is not None:
            return conn
        address = self.check_named(address)
        conn = self._conns.get(address)
        if conn is not None:
            return conn
        conn = self._conns[address] = dial_peer(
            address, self.lease, self.token, TransferFailed, "the lease's worker"
        )
        return conn

    def _drop(self, address: str) -> None:
        keys = {address}
        with contextlib.suppress(ValueError):
            keys.add(_normal(address))
        for key in keys:
            conn = self._conns.pop(key, None)
            if conn is not None:
                conn.close()

    def close(self) -> None:
        for address in list(self._conns):
            self._drop(address)


def _normal(address: str) -> str:
    """One spelling per endpoint, so `tcp://127.0.0.1:5` and its parsed form compare equal."""
    return str(parse_address(address))
