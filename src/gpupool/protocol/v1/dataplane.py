"""Data-plane protocol v1: length-prefixed msgpack frames between a client runtime and its worker.

A frame is an 8-byte header (two big-endian uint32: body length, tail length), a msgpack body and
an optional raw tail that carries tensor bytes without copying them through msgpack. The body's
first object is the head `[Kind, ...]`; a BATCH body continues with one msgpack object per record,
so the worker decodes (and resolves handles of) each record just before it runs it.

Nothing here imports torch: tensors travel as dtype names, shapes and raw bytes (see `tensors.py`),
ops as schema names such as `aten::add.Tensor`, so client and worker may run different torch
versions.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import select
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import msgpack

from gpupool.core.errors import InvalidRequest
from gpupool.protocol.tls import private_ca_context

VERSION = 1
MiB = 1 << 20

MAX_FRAME_BYTES = 64 * MiB
"""Largest body + tail a peer accepts; a bigger frame closes the connection with an error."""
CHUNK_BYTES = 8 * MiB
"""Tensor bytes above this travel as several PUT / DATA frames."""
INLINE_PAYLOAD_BYTES = 64 * 1024
"""Host tensors up to this size ride inside the op stream; bigger ones get their own frames."""
PINNED_REGION = 1
"""A PUT record's eighth field: its offset is in the client's shared pinned region (the
second descriptor of HELLO), not in the stream's arena."""
PUT_LANES = 2
"""A PUT record's eighth field: its bytes come over the session's lanes, chunk i (of
LANE_CHUNK_BYTES) on lane i modulo their number, each as a [PUT, handle, offset] frame."""
MAX_LANES = 8
LANE_CHUNK_BYTES = 2 * MiB
"""Small enough that a batch of a few tens of MiB spreads evenly over the lanes."""
BATCH_MAX_RECORDS = 512
PROGRAM_VERSION = 1
"""Version of a PROGRAM record's body; a worker refuses bodies of another version."""
FLAGS_VERSION = 1
"""Version of the FLAGS record's names and values."""
STREAMS_VERSION = 1
"""Version of the STREAM, EVENT and QUERY records."""
DIST_VERSION = 2
"""Version of the DIST record's actions and bodies, and of the peers' STORE frames. 2 added
"reduce", "gather", "scatter" and "all_to_all": a client asks for 2 before it sends them."""
HELLO_TIMEOUT_S = 10.0

_HEADER = struct.Struct(">II")


class Kind(IntEnum):
    """First element of every frame's head."""

    HELLO = 1
    """client → worker: [HELLO, {v, lease, token, torch, host, pid, shm}]"""
    WELCOME = 2
    """worker → client: [WELCOME, {device facts, limits, torch version}]"""
    BATCH = 3
    """client → worker: [BATCH] followed by records (`Rec`), run in order."""
    PUT = 4
    """client → worker: [PUT, handle, offset]; tail = the next bytes of a large put."""
    DATA = 5
    """worker → client: [DATA, req, dtype, shape, offset, total, shm_bytes]: a chunk of a read
    at offset, in the tail, or (shm_bytes > 0) that many bytes in the worker's arena there."""
    RESULT = 6
    """worker → client: [RESULT, req, value] — the answer to CALL, SYNC or STATS."""
    ERROR = 7
    """either way: [ERROR, req or None, ErrorBody]; after a protocol error the sender closes."""
    NOTICE = 8
    """worker → client, unasked: [NOTICE, {"event": "swap" | "move"}]. The worker wants the
    client's state off its GPU (idle) or on a successor worker (migration, resize, drain);
    the client answers with a SWAP or RESUME record in its stream, so the change happens at
    a point both sides agree on: after every record sent before it."""
    CONTROL = 9
    """agent or successor → worker, on a connection of their own (HELLO role `control` or
    `successor`): [CONTROL, req, {"op": ...}]; answered with RESULT or ERROR."""
    STATE = 10
    """worker → successor: [STATE, meta]; the storages follow as PUT frames (see worker/swap)."""
    TRANSFER = 11
    """worker → worker of the same lease (role `peer`): [TRANSFER, transfer_id, dtype, shape,
    nbytes], the bytes following as [PUT, transfer_id, offset] chunks; or [TRANSFER,
    transfer_id, None, message] when the sender could not produce the tensor."""
    STORE = 12
    """worker → worker of the same lease (role `peer`, a connection of its own): [STORE, req,
    group, op, key, value] on the rendezvous store of a process group that the receiving
    worker hosts (`gpupool.worker.collectives`); answered with [RESULT, req, value] or ERROR.
    ops: "set" (value: bytes), "get", "add" (value: int), "check", "wait" (value: seconds),
    "compare_set" (value: [expected, desired]), "delete", "num_keys"."""


class Rec(IntEnum):
    """Records of a BATCH: ops stream without replies; only READ, CALL, SYNC, STATS answer."""

    DEF = 1
    """[DEF, op_id, "aten::add.Tensor"]: names an op once per connection."""
    OP = 2
    """[OP, op_id, args, kwargs, outs]: run an op; outs = handles for its tensor outputs."""
    PUT = 3
    """[PUT, handle, dtype, shape, payload, nbytes, shm_offset]: copy host bytes into the tensor
    `handle` (a plain int here: the bytes may arrive after the record is decoded).

    payload is the bytes (small puts) or None: then nbytes follow in PUT frames, or sit in the
    client's shared-memory arena at shm_offset."""
    READ = 4
    """[READ, req, handle]: reply with DATA frames (or ERROR)."""
    CALL = 5
    """[CALL, req, op_id, args, kwargs, handle_base]: run now, reply with output specs."""
    FREE = 6
    """[FREE, handle]: the client dropped its last reference."""
    SYNC = 7
    """[SYNC, req]: reply once everything before it has finished."""
    SEED = 8
    """[SEED, seed]: seed the worker device's random generator."""
    STATS = 9
    """[STATS, req]: reply with memory and activity counters."""
    RNG_STATE = 10
    """[RNG_STATE, req]: reply with the device generator's state (bytes)."""
    SET_RNG_STATE = 11
    """[SET_RNG_STATE, state]: restore the device generator (as checkpointing does)."""
    PROGRAM = 12
    """[PROGRAM, program_id, body]: define a captured step once; body is msgpack bytes of
    `{v: PROGRAM_VERSION, inputs, slots, externals, steps, outputs, escapes, graph}` whose
    tensors are `Ext.SLOT`s (see `gpupool.worker.program`). A malformed body is a protocol
    error: the connection closes."""
    RUN = 13
    """[RUN, program_id, inputs, outs]: replay a program on these input tensors; its outputs
    are stored under the client-chosen handles `outs`. One record per call of the step."""
    DROP_PROGRAM = 14
    """[DROP_PROGRAM, program_id]: the client will not run this program again."""
    SWAP = 15
    """[SWAP, req]: the client agrees to a swap-out the worker announced: every tensor goes to
    host memory and the device memory is freed; replies with what moved."""
    RESUME = 16
    """[RESUME, req]: the client's next records need its state on a GPU: the worker restores
    it in place, or hands it to its successor and replies {"to": address} before it closes."""
    SEND = 17
    """[SEND, transfer_id, tensor, address]: send the tensor's values to the lease's worker at
    `address` (a copy between two devices of one lease, not through the client)."""
    RECV = 18
    """[RECV, transfer_id, handle, dtype | None, into]: take what another worker of the lease
    sent under transfer_id; store it as a new tensor `handle` (cast to dtype), or with `into`
    copy it into the existing tensor `handle`. Waits for the bytes, in stream order."""
    FLAGS = 19
    """[FLAGS, {name: value}]: the client's global torch switches (deterministic algorithms,
    cuDNN and TF32 flags, matmul precision, default dtype; `gpupool.worker.flags` lists them),
    applied to every record after it. Workers that take it say `"flags": FLAGS_VERSION` in
    WELCOME."""
    STREAM = 20
    """[STREAM, action, stream_id, arg]: the client's torch.cuda.Stream objects. "use": the
    records after it run on stream `stream_id` (0: the device's default stream; made at first
    use with priority `arg`); "free": the client dropped it; "tensor": `arg` (a tensor) is in
    use on the stream (Tensor.record_stream). Workers that take STREAM, EVENT and QUERY say
    `"streams": STREAMS_VERSION` in WELCOME."""
    EVENT = 21
    """[EVENT, action, event_id, stream_id, timing]: "record": record event `event_id` on the
    stream (made at first record, with timing if `timing`); "wait": the stream waits for it;
    "free": the client dropped it (stream_id and timing unused)."""
    QUERY = 22
    """[QUERY, req, what, a, b]: answered with RESULT. "event_query" / "event_sync" (event a),
    "stream_query" / "stream_sync" (stream a), "elapsed" (ms from event a to event b, as the
    worker's device measured them), "reset_peak" (the peak memory counter)."""
    DIST = 23
    """[DIST, action, group, body]: torch.distributed among the workers of one lease, in stream
    order. "init" (body {rank, size, host, timeout_s}): this worker joins process group
    `group` as `rank` of `size`; the worker at `host` (a worker of the lease, rank 0's) keeps
    its rendezvous store. A collective (body {tensors, ...}: "all_reduce", "broadcast",
    "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "send", "recv", "barrier", "all_to_all_single", "all_to_all")
    runs on the worker's tensors in place; "destroy" leaves the group. Workers that take it
    say `"dist": DIST_VERSION` in WELCOME."""
    STORAGE = 24
    """[STORAGE, tensor, nbytes]: resize the storage under the tensor to nbytes, keeping its
    shape: 0 frees the memory, its size allocates it again (uninitialised), as FSDP2 does with
    unsharded parameters between their all-gathers. Workers that take it say `"dist"` too."""


class Ext(IntEnum):
    """msgpack extension codes for op arguments."""

    TENSOR = 1
    """8-byte big-endian handle of a tensor the worker holds."""
    DTYPE = 2
    """dtype name, e.g. b"bfloat16"."""
    DEVICE = 3
    """b"" = the worker's own device, b"cpu" = host memory."""
    LITERAL = 4
    """a small host tensor: msgpack [dtype, shape, bytes]."""
    LAYOUT = 5
    MEMORY_FORMAT = 6
    COMPLEX = 7
    """msgpack [real, imag]."""
    SLOT = 8
    """4-byte big-endian slot of a captured program (only inside a PROGRAM body)."""


class ErrorKind(IntEnum):
    PROTOCOL = 1
    """malformed or oversized frame, unknown record: the connection closes."""
    AUTH = 2
    """no valid token for this lease: the connection is refused."""
    BUSY = 3
    """the worker already serves a client (`ErrorBody.client_gone`: one that has left, whose
    last call the worker is still finishing)."""
    OP = 4
    """a streamed op failed; reported at the next read."""
    OUT_OF_MEMORY = 5
    """an allocation would exceed the lease's memory limit."""
    UNSUPPORTED = 6
    """the worker cannot run this op (unknown to its torch, or not allowed)."""
    MOVED = 7
    """this worker handed the lease's state to another; the message is that worker's address."""


@dataclass(frozen=True)
class ErrorBody:
    kind: ErrorKind
    message: str
    op: str | None = None
    exc_type: str = "RuntimeError"
    client_gone: bool = False
    """BUSY only: the client being served has closed its connection, and the worker frees
    itself when the call it runs for that client ends (an Inductor compile can take minutes),
    so a new client waits for that rather than giving up after a moment."""

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "kind": int(self.kind),
            "message": self.message,
            "op": self.op,
            "exc": self.exc_type,
        }
        if self.client_gone:
            wire["gone"] = True
        return wire

    @classmethod
    def from_wire(cls, body: object) -> ErrorBody:
        if not isinstance(body, dict):
            return cls(ErrorKind.PROTOCOL, f"malformed error body: {body!r:.200}")
        try:
            kind = ErrorKind(int(body.get("kind", ErrorKind.PROTOCOL)))
        except ValueError:
            kind = ErrorKind.PROTOCOL
        return cls(
            kind,
            str(body.get("message", "")),
            body.get("op"),
            str(body.get("exc", "RuntimeError")),
            body.get("gone") is True,
        )


class DataPlaneError(Exception):
    """Base of data-plane failures."""


class ProtocolError(DataPlaneError):
    """The peer sent something this protocol version does not allow."""


class ConnectionClosed(DataPlaneError):
    """The peer closed the connection."""


class RemoteError(DataPlaneError):
    """The peer answered with an ERROR frame."""

    def __init__(self, body: ErrorBody) -> None:
        super().__init__(body.message)
        self.body = body


# ---- addresses ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Address:
    """`tcp://host:port`, `tls://host:port` (TCP under TLS) or `unix:/path/to/socket`."""

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""

    def __str__(self) -> str:
        if self.scheme == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def is_unix(self) -> bool:
        return self.scheme == "unix"

    @property
    def is_tls(self) -> bool:
        return self.scheme == "tls"


def parse_address(text: str) -> Address:
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ValueError(f"unix address without a path: {text!r}")
        return Address("unix", path=path)
    for scheme in ("tcp", "tls"):
        if not text.startswith(f"{scheme}://"):
            continue
        rest = text[len(scheme) + 3 :]
        if rest.startswith("["):
            host, _, port = rest[1:].partition("]:")
        else:
            host, _, port = rest.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"{scheme} address needs host:port: {text!r}")
        return Address(scheme, host=host, port=int(port))
    raise ValueError(f"address must start with tcp://, tls:// or unix: — got {text!r}")


def client_tls_context() -> ssl.SSLContext:
    """What a client checks a tls:// worker's certificate against: $GPUPOOL_CA, else the
    system's store. A bad bundle is a DataPlaneError like any other failure to connect, so
    the callers that handle those (the agent, a successor worker) handle it too."""
    try:
        return private_ca_context() or ssl.create_default_context()
    except InvalidRequest as exc:
        raise DataPlaneError(exc.message) from None


def server_tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A worker's TLS side: TLS 1.2 or newer, its certificate and key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    return context


def listen(address: Address, backlog: int = 8) -> socket.socket:
    """A listening socket; a tcp port 0 or a fresh unix path is bound as given."""
    if address.is_unix:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(address.path)
        os.chmod(address.path, 0o600)
    else:
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address.host, address.port))
    sock.listen(backlog)
    return sock


def bound_address(sock: socket.socket, requested: Address) -> Address:
    if requested.is_unix:
        return requested
    host, port = sock.getsockname()[:2]
    return Address(requested.scheme, host=str(host), port=int(port))


def connect(address: Address, timeout_s: float = 10.0) -> socket.socket:
    if address.is_unix:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect(address.path)
    else:
        sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
        if address.is_tls:
            try:
                # The handshake checks the worker's certificate against its host name or IP.
                sock = client_tls_context().wrap_socket(sock, server_hostname=address.host)
            except (ssl.SSLError, ssl.CertificateError) as exc:
                sock.close()
                raise DataPlaneError(f"TLS with the worker at {address} failed: {exc}") from exc
    sock.settimeout(None)
    tune(sock)
    return sock


KEEPALIVE_IDLE_S = 15
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3
"""A peer whose host vanished (power, cable, a partition) is noticed after about 30 s of
silence: a client waiting for a reply gets an error instead of waiting forever."""


def tune(sock: socket.socket) -> None:
    """Small batches must leave at once; reads are latency-bound; a vanished peer must end
    the connection (TCP keepalive), since a blocked read would otherwise never return."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ):
            option = getattr(socket, name, None)  # Linux names; macOS lacks some
            if option is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, option, value)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 * MiB)


def token_matches(expected: str, given: object) -> bool:
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


# ---- frames -------------------------------------------------------------------------------


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def pack_records(head: Sequence[object], records: Sequence[object]) -> bytes:
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    packer.pack(head)
    for record in records:
        packer.pack(record)
    return packer.bytes()  # type: ignore[no-any-return]


@dataclass
class Frame:
    body: bytes
    tail_len: int

    def head(self) -> list[Any]:
        """The first object of the body, checked to be `[Kind, ...]`."""
        return unpack_head(self.body)

    def objects(self, ext_hook: Callable[[int, bytes], object] | None = None) -> Iterator[Any]:
        """All body objects in order (head first), decoded one at a time."""
        unpacker = _unpacker(ext_hook)
        unpacker.feed(self.body)
        done = 0
        try:
            for obj in unpacker:
                done = unpacker.tell()
                yield obj
        except (msgpack.UnpackException, ValueError) as exc:
            raise ProtocolError(f"malformed frame body: {exc}") from exc
        # The Unpacker stops quietly before an object cut short: that is a malformed body too.
        if done != len(self.body):
            raise ProtocolError("malformed frame body: the body ends inside a record")


def _unpacker(ext_hook: Callable[[int, bytes], object] | None) -> msgpack.Unpacker:
    kwargs: dict[str, Any] = {
        "raw": False,
        "strict_map_key": True,
        "max_buffer_size": MAX_FRAME_BYTES,
    }
    if ext_hook is not None:
        kwargs["ext_hook"] = ext_hook
    return msgpack.Unpacker(**kwargs)


def unpack_head(body: bytes) -> list[Any]:
    unpacker = _unpacker(None)
    unpacker.feed(body)
    try:
        head = unpacker.unpack()
    except (msgpack.UnpackException, ValueError) as exc:
        raise ProtocolError(f"malformed frame body: {exc}") from exc
    if not isinstance(head, list) or not head or not isinstance(head[0], int):
        raise ProtocolError("frame head must be a list starting with its kind")
    try:
        Kind(head[0])
    except ValueError:
        raise ProtocolError(f"unknown frame kind {head[0]}") from None
    return head


class Role:
    """Who opens a connection to a worker (HELLO's `role`); a tenant is always `client`.

    Each role has its own credential (`WorkerCredentials`): the client's lease token opens the
    client role only, so a tenant can neither act as the agent nor as a worker of its lease."""

    CLIENT = "client"
    CONTROL = "control"
    """the agent: resume in place, change limits, ask for a swap, name the lease's peers."""
    SUCCESSOR = "successor"
    """a fresh worker of the same lease that takes over the client's state."""
    PEER = "peer"
    """another worker of the same lease, sending tensors for copies between its devices."""
    LANE = "lane"
    """one more connection of the client (its token and its session's lane key), carrying
    a share of its large puts' bytes beside the others."""


@dataclass(frozen=True)
class WorkerCredentials:
    """The secrets of one worker, one per role, none of them in its argv or environment.

    `client` is the lease's data-plane token (what its holder connects with); `control` is the
    agent's secret for this one worker, which the tenant never sees; `peer` is the lease's
    worker secret, the same on every worker of the lease (its devices, a successor), which
    the controller gives only to the agents that host the lease. A role whose secret is empty
    is refused: a worker started by hand without a peer secret takes no peers."""

    client: str
    control: str = ""
    peer: str = ""

    def admits(self, role: str, given: object) -> bool:
        """Whether `given` is the secret of `role` (constant time; unknown roles: never)."""
        expected = {
            Role.CLIENT: self.client,
            Role.LANE: self.client,
            Role.CONTROL: self.control,
            Role.SUCCESSOR: self.peer,
            Role.PEER: self.peer,
        }.get(role, "")
        return bool(expected) and token_matches(expected, given)

    def to_line(self) -> bytes:
        """One JSON line, as the worker reads its credentials from stdin."""
        import json

        body = {"client": self.client, "control": self.control, "peer": self.peer}
        return (json.dumps(body) + "\n").encode()

    @classmethod
    def from_line(cls, line: bytes | str) -> WorkerCredentials:
        import json

        try:
            body = json.loads(line)
        except ValueError as exc:
            raise ProtocolError(f"the credentials line is not JSON: {exc}") from None
        if not isinstance(body, dict) or not all(
            isinstance(body.get(k, ""), str) for k in ("client", "control", "peer")
        ):
            raise ProtocolError("the credentials line is {client, control, peer}, all strings")
        if not body.get("client"):
            raise ProtocolError("the credentials line has no client token")
        return cls(str(body["client"]), str(body.get("control", "")), str(body.get("peer", "")))

    @classmethod
    def generate(cls, client: str, peer: str | None = None) -> WorkerCredentials:
        """Fresh control (and, unless given, peer) secrets for a worker of `client`'s lease."""
        import secrets

        return cls(client, secrets.token_urlsafe(32), peer or secrets.token_urlsafe(32))


class _Reader:
    """A receive buffer over a blocking socket that can also tell, without blocking, whether
    bytes are waiting (what `Connection.wait` spins on): a BufferedReader cannot."""

    __slots__ = ("_buf", "_end", "_size", "_sock", "_start", "_view")

    def __init__(self, sock: socket.socket, size: int = 256 * 1024) -> None:
        self._sock = sock
        self._size = size
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def buffered(self) -> int:
        return self._end - self._start

    def _compact(self) -> None:
        start, end = self._start, self._end
        if start:
            if end > start:
                self._view[: end - start] = self._view[start:end]
            self._start, self._end = 0, end - start

    def poll(self) -> bool:
        """Whether bytes (or the end of the stream) are ready, without blocking."""
        if self._end > self._start:
            return True
        self._start = self._end = 0
        if isinstance(self._sock, ssl.SSLSocket):
            # TLS takes no recv flags: decrypted bytes may wait in the TLS layer, else ask
            # the socket; a record that has only begun to arrive finishes in the blocking read.
            if self._sock.pending():
                return True
            ready, _, _ = select.select([self._sock], [], [], 0)
            return bool(ready)
        try:
            n = self._sock.recv_into(self._view, self._size, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        if not n:
            return True  # end of stream: the blocking read reports it
        self._end = n
        return True

    def _fill(self) -> int:
        if self._end == self._size:
            self._compact()
        n = self._sock.recv_into(self._view[self._end :])
        self._end += n
        return n

    def read(self, n: int) -> bytes:
        """Exactly n bytes, or fewer at the end of the stream."""
        if self._end - self._start >= n:
            start = self._start
            self._start = start + n
            return bytes(self._view[start : start + n])
        if n > self._size:
            out = bytearray(n)
            got = self.readinto(memoryview(out))
            return bytes(out[:got]) if got < n else bytes(out)
        if self._start + n > self._size:
            self._compact()
        while self._end - self._start < n:
            if not self._fill():
                break
        start = self._start
        take = min(n, self._end - start)
        self._start = start + take
        return bytes(self._view[start : start + take])

    def readinto(self, dest: memoryview) -> int:
        """Fill dest from the buffer, then straight from the socket; fewer at end of stream."""
        want = len(dest)
        have = min(want, self._end - self._start)
        if have:
            dest[:have] = self._view[self._start : self._start + have]
            self._start += have
        while have < want:
            n = self._sock.recv_into(dest[have:])
            if not n:
                break
            have += n
        return have


class Connection:
    """Frames over one blocking stream socket; one reader and one writer thread at a time."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self._reader = _Reader(sock)
        self._unread_tail = 0
        self.closed = False

    # -- writing --

    def send(self, head: Sequence[object], tail: bytes | memoryview | None = None) -> None:
        self.send_body(pack(head), tail)

    def send_body(self, body: bytes, tail: bytes | memoryview | None = None) -> None:
        tail_len = 0 if tail is None else len(tail)
        if len(body) + tail_len > self.max_frame_bytes:
            raise ProtocolError(
                f"frame of {len(body) + tail_len} bytes exceeds the limit of {self.max_frame_bytes}"
            )
        header = _HEADER.pack(len(body), tail_len)
        if not tail_len:
            try:
                # One small frame: a single send, no list of views.
                sent = self.sock.send(header + body)
            except OSError as exc:
                self.closed = True
                raise ConnectionClosed(f"connection lost while sending: {exc}") from exc
            if sent == len(header) + len(body):
                return
            self._sendmsg_all([memoryview(header + body)[sent:]])
            return
        assert tail is not None
        self._sendmsg_all([header, body, tail])

    def _sendmsg_all(self, parts: list[bytes | memoryview]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        if isinstance(self.sock, ssl.SSLSocket):
            # TLS has no scatter-gather send: each part goes through the record layer in turn.
            try:
                for view in views:
                    self.sock.sendall(view)
            except OSError as exc:
                self.closed = True
                raise ConnectionClosed(f"connection lost while sending: {exc}") from exc
            return
        try:
            while views:
                sent = self.sock.sendmsg(views)
                while views and sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                if views and sent:
                    views[0] = views[0][sent:]
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            self.closed = True
            raise ConnectionClosed(f"connection lost while sending: {exc}") from exc

    # -- reading --

    def wait(self, spin_s: float) -> bool:
        """Spin up to spin_s for the next frame's first bytes, without sleeping; True if they
        came. The peer then needs no wakeup to reach this process (a sleeping receiver costs
        the sender a scheduler wakeup, and the receiver tens to hundreds of microseconds to
        get back onto a core); past spin_s the caller blocks in `recv` as usual."""
        if self._unread_tail:
            return True
        reader = self._reader
        try:
            if reader.poll():
                return True
            deadline = time.perf_counter() + spin_s
            while time.perf_counter() < deadline:
                os.sched_yield()  # a busy host's other threads get the core
                if reader.poll():
                    return True
        except OSError:
            return True  # the blocking read reports it
        return False

    def readable(self, timeout_s: float) -> bool:
        """Whether a frame's first bytes (or the end of the stream) arrive within timeout_s."""
        import select

        if self._unread_tail or self._reader.poll():
            return True
        try:
            ready, _, _ = select.select([self.sock], [], [], timeout_s)
        except (OSError, ValueError):
            return True  # the blocking read reports it
        return bool(ready)

    def recv(self) -> Frame:
        """The next frame; its tail (if any) must be read with `read_tail*` before the next."""
        if self._unread_tail:
            self._skip(self._unread_tail)
        header = self._read_exact(_HEADER.size)
        body_len, tail_len = _HEADER.unpack(header)
        if body_len == 0:
            raise ProtocolError("empty frame body")
        if body_len + tail_len > self.max_frame_bytes:
            raise ProtocolError(
                f"frame of {body_len + tail_len} bytes exceeds the limit of {self.max_frame_bytes}"
            )
        body = self._read_exact(body_len)
        self._unread_tail = tail_len
        return Frame(body, tail_len)

    def read_tail(self) -> bytearray:
        buf = bytearray(self._unread_tail)
        self.read_tail_into(memoryview(buf))
        return buf

    def read_tail_into(self, dest: memoryview) -> None:
        if len(dest) != self._unread_tail:
            raise ProtocolError(f"tail of {self._unread_tail} bytes, expected {len(dest)}")
        view = dest.cast("B") if dest.format != "B" else dest
        try:
            got = self._reader.readinto(view)
        except (ConnectionResetError, OSError, ValueError) as exc:
            self.closed = True
            raise ConnectionClosed(f"connection lost while reading: {exc}") from exc
        if got < len(view):
            self.closed = True
            raise ConnectionClosed("connection closed inside a frame")
        self._unread_tail = 0

    def skip_tail(self) -> None:
        """Read past the current frame's tail without keeping it."""
        self._skip(self._unread_tail)

    def _skip(self, n: int) -> None:
        while n:
            chunk = self._read_exact(min(n, CHUNK_BYTES))
            n -= len(chunk)
        self._unread_tail = 0

    def _read_exact(self, n: int) -> bytes:
        try:
            data = self._reader.read(n)
        except (ConnectionResetError, OSError, ValueError) as exc:  # ValueError: closed here
            self.closed = True
            raise ConnectionClosed(f"connection lost while reading: {exc}") from exc
        if len(data) != n:
            self.closed = True
            if not data:
                raise ConnectionClosed("peer closed the connection")
            raise ConnectionClosed("connection closed inside a frame")
        return data

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def forget(self) -> None:
        """Close this process's copy of the socket without ending the connection: a forked
        child's, while the parent goes on using the connection (no shutdown, no TLS alert)."""
        self.closed = True
        with contextlib.suppress(OSError):
            os.close(self.sock.detach())


# ---- the handshake (raw socket calls: it may carry a file descriptor) ----------------------


@dataclass
class Handshake:
    head: list[Any]
    fds: list[int] = field(default_factory=list)


def send_handshake(sock: socket.socket, head: Sequence[object], fds: Sequence[int] = ()) -> None:
    body = pack(head)
    data = _HEADER.pack(len(body), 0) + body
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def recv_handshake(sock: socket.socket, max_bytes: int = 64 * 1024) -> Handshake:
    """Read exactly one small frame without buffering past it (the next frames belong to a
    buffered reader), collecting any file descriptors sent with it."""
    fds: list[int] = []
    try:
        header = _recv_exact_collecting(sock, _HEADER.size, fds)
        body_len, tail_len = _HEADER.unpack(header)
        if body_len == 0 or tail_len or body_len > max_bytes:
            raise ProtocolError(f"handshake frame must be a small body (got {body_len}+{tail_len})")
        body = _recv_exact_collecting(sock, body_len, fds)
        head = unpack_head(body)
    except BaseException:
        # Descriptors that came with a handshake that failed (a peer that hung up halfway
        # included) belong to no one: close them, or a hostile peer exhausts the worker's.
        for fd in fds:
            os.close(fd)
        raise
    return Handshake(head, fds)


def _recv_exact_collecting(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if sock.family == socket.AF_UNIX:
            data, got_fds, _flags, _addr = socket.recv_fds(sock, n - len(buf), 4)
            fds.extend(got_fds)
        else:
            data = sock.recv(n - len(buf))
        if not data:
            raise ConnectionClosed("peer closed the connection during the handshake")
        buf += data
    return bytes(buf)


# ---- shared memory for payloads on one host ---------------------------------------------


class SharedArena:
    """A memfd region both peers map: the writer fills [offset, offset+n), the reader copies out.

    Only offered over Unix sockets (the descriptor travels with the handshake), so it needs no
    file in /dev/shm and no permission shared between the client's and the worker's users."""

    def __init__(self, fd: int, size: int) -> None:
        import mmap

        self.fd = fd
        self.size = size
        self.map = mmap.mmap(fd, size)
        self.cursor = 0

    @classmethod
    def create(cls, size: int, name: str = "gpupool-arena") -> SharedArena:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return cls(fd, size)

    @classmethod
    def adopt(cls, fd: int) -> SharedArena:
        return cls(fd, os.fstat(fd).st_size)

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ProtocolError(f"arena range {offset}+{nbytes} outside {self.size} bytes")
        return memoryview(self.map)[offset : offset + nbytes]

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self.map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def role_handshake(sock: socket.socket, lease: str, token: str, role: str) -> None:
    """Open a connection to a worker of `lease` as something other than its client (the
    agent, a successor, a peer worker): HELLO with the role and the lease's token, then
    WELCOME; a refusal raises RemoteError with the worker's reason."""
    hello = {"v": VERSION, "lease": lease, "token": token, "role": role}
    send_handshake(sock, [Kind.HELLO, hello])
    reply = recv_handshake(sock)
    if reply.head[0] != Kind.WELCOME:
        raise RemoteError(ErrorBody.from_wire(reply.head[2] if len(reply.head) > 2 else None))


def send_control(
    address: Address, lease: str, token: str, body: dict[str, Any], timeout_s: float = 10.0
) -> dict[str, Any]:
    """One request of the agent to its worker (role `control`): resume, limits, swap, status."""
    sock = connect(address, timeout_s)
    try:
        sock.settimeout(timeout_s)
        role_handshake(sock, lease, token, Role.CONTROL)
        conn = Connection(sock)
        conn.send([Kind.CONTROL, 1, body])
        head = conn.recv().head()
        if head[0] == Kind.ERROR:
            raise RemoteError(ErrorBody.from_wire(head[2] if len(head) > 2 else None))
        if head[0] != Kind.RESULT or not isinstance(head[2], dict):
            raise ProtocolError(f"the worker answered {head!r:.200}")
        return head[2]
    finally:
        with contextlib.suppress(OSError):
            sock.close()


# ---- starting a worker (the agent's side of the worker's command line) --------------------

TOKEN_ENV = "GPUPOOL_WORKER_TOKEN"
"""A worker started by hand may read its client token from this variable (`ps` does not show
it, but /proc/PID/environ does, to its user): an agent never uses it, it sends the worker's
credentials on its stdin (`--credentials-stdin`)."""
WORKER_EXIT_DEVICE_BROKEN = 3
"""A worker's exit status when the client's error broke its CUDA context (a sticky error such
as a device-side assert): the worker ends on purpose, it did not crash."""


def worker_argv(
    lease: str | None,
    *,
    device: str = "cpu",
    listen: str = "tcp://127.0.0.1:0",
    memory_limit_mib: int | None = None,
    host_memory_limit_mib: int | None = None,
    status_file: Path | None = None,
    threads: int | None = None,
    spin_us: int | None = None,
    idle_timeout_s: float | None = None,
    restore_from: str | None = None,
    managed: bool = False,
    handoff_paths: Sequence[str] | None = None,
    python: str | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    room_timeout_s: float | None = None,
    simulated_gpu: Path | None = None,
    cpus: str | None = None,
    credentials_stdin: bool = False,
    ready_fd: int | None = None,
    peer_wait_s: float | None = None,
    context_ahead: bool = False,
) -> list[str]:
    """The command that starts a worker. Its credentials go on its stdin (credentials_stdin:
    one `WorkerCredentials.to_line()`) or, started by hand, in TOKEN_ENV; never in argv.
    `lease=None` starts a ready worker (`--standby`): its lease comes later, as a `Handover`
    line on its stdin."""
    import sys

    argv = [python or sys.executable, "-m", "gpupool.worker"]
    argv += ["--standby"] if lease is None else ["--lease", lease]
    argv += ["--device", device, "--listen", listen]
    if context_ahead:
        argv += ["--context-ahead"]
    if memory_limit_mib is not None:
        argv += ["--memory-limit-mib", str(memory_limit_mib)]
    if host_memory_limit_mib is not None:
        argv += ["--host-memory-limit-mib", str(host_memory_limit_mib)]
    if status_file is not None:
        argv += ["--status-file", str(status_file)]
    if threads is not None:
        argv += ["--threads", str(threads)]
    if cpus is not None:
        argv += ["--cpus", cpus]
    if spin_us is not None:
        argv += ["--spin-us", str(spin_us)]
    if tls_cert is not None and tls_key is not None:
        argv += ["--tls-cert", str(tls_cert), "--tls-key", str(tls_key)]
    if idle_timeout_s is not None:
        argv += ["--idle-timeout-s", f"{idle_timeout_s:g}"]
    if restore_from is not None:
        argv += ["--restore-from", restore_from]
    if managed:
        argv += ["--managed"]
    if handoff_paths is not None:
        argv += ["--handoff-paths", ",".join(handoff_paths)]
    if room_timeout_s is not None:
        argv += ["--room-timeout-s", f"{room_timeout_s:g}"]
    if simulated_gpu is not None:
        argv += ["--simulated-gpu", str(simulated_gpu)]
    if peer_wait_s is not None:
        argv += ["--peer-wait-s", f"{peer_wait_s:g}"]
    if credentials_stdin:
        argv += ["--credentials-stdin"]
    if ready_fd is not None:
        argv += ["--ready-fd", str(ready_fd)]
    return argv


@dataclass(frozen=True)
class WorkerReady:
    """The one JSON line a worker prints on stdout once it accepts connections."""

    address: Address
    lease: str
    device: str
    pid: int
    credentials: WorkerCredentials | None = None
    """What the worker was started with (start_worker_process): its starter keeps the control
    secret to send it requests, and the peer secret for the lease's other workers."""


def parse_ready(line: str) -> WorkerReady:
    import json

    try:
        data = json.loads(line)
        if data.get("event") != "ready":
            raise ValueError(f"not a ready line: {line!r}")
        return WorkerReady(
            parse_address(data["address"]),
            str(data["lease"]),
            str(data["device"]),
            int(data["pid"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise DataPlaneError(f"worker did not report ready: {line.strip()!r}") from exc


class WorkerStartFailed(DataPlaneError):
    """A worker process did not come up: it exited, stayed silent, or could not be placed."""


READY_LINE_MAX = 4096

HANDOVER_ENV = frozenset({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"})
"""The only variables a hand-over may set in a ready worker: the lease's MPS share and memory
limit, which CUDA reads when the worker makes its context (after the hand-over)."""
MAX_HANDOVER_BYTES = 64 * 1024


@dataclass(frozen=True)
class Handover:
    """What makes a ready worker the worker of one lease: one JSON line its agent writes on the
    worker's stdin (a pipe only the agent holds), never argv or an environment a tenant saw.

    Before it, the worker has imported torch and bound its socket, and refuses every HELLO;
    after it, the worker applies the limits (the MPS share before its CUDA context exists, the
    memory limit before its first allocation) and serves the lease's roles."""

    lease: str
    credentials: WorkerCredentials
    memory_limit_mib: int | None = None
    host_memory_limit_mib: int | None = None
    status_file: str | None = None
    """Relative to the worker's directory (its cwd), as for a worker started cold."""
    idle_timeout_s: float | None = None
    mps_env: dict[str, str] = field(default_factory=dict)
    """HANDOVER_ENV variables: the lease's MPS share, for the context made at hand-over."""

    def to_line(self) -> bytes:
        import json

        body = {
            "lease": self.lease,
            "credentials": {
                "client": self.credentials.client,
                "control": self.credentials.control,
                "peer": self.credentials.peer,
            },
            "memory_limit_mib": self.memory_limit_mib,
            "host_memory_limit_mib": self.host_memory_limit_mib,
            "status_file": self.status_file,
            "idle_timeout_s": self.idle_timeout_s,
            "mps_env": self.mps_env,
        }
        return (json.dumps(body) + "\n").encode()

    @classmethod
    def from_line(cls, line: bytes) -> Handover:
        """The agent's line, checked field by field: a ready worker acts on nothing else."""
        import json

        try:
            body = json.loads(line)
        except ValueError as exc:
            raise ProtocolError(f"the hand-over line is not JSON: {exc}") from None
        lease = body.get("lease") if isinstance(body, dict) else None
        if not isinstance(lease, str) or not lease:
            raise ProtocolError("the hand-over line names no lease")
        credentials = WorkerCredentials.from_line(json.dumps(body.get("credentials")))
        sizes = {}
        for name in ("memory_limit_mib", "host_memory_limit_mib"):
            value = body.get(name)
            if value is not None and (type(value) is not int or value <= 0):
                raise ProtocolError(f"hand-over {name} must be a positive integer, got {value!r}")
            sizes[name] = value
        idle = body.get("idle_timeout_s")
        if idle is not None and (not isinstance(idle, int | float) or idle <= 0):
            raise ProtocolError(f"hand-over idle_timeout_s must be positive, got {idle!r}")
        status = body.get("status_file")
        if status is not None and (not isinstance(status, str) or not status):
            raise ProtocolError("hand-over status_file must be a path")
        env = body.get("mps_env") or {}
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ProtocolError("hand-over mps_env must map names to strings")
        if set(env) - HANDOVER_ENV:
            raise ProtocolError(
                f"a hand-over may set {', '.join(sorted(HANDOVER_ENV))} only, not "
                + ", ".join(sorted(set(env) - HANDOVER_ENV))
            )
        return cls(
            lease=lease,
            credentials=credentials,
            memory_limit_mib=sizes["memory_limit_mib"],
            host_memory_limit_mib=sizes["host_memory_limit_mib"],
            status_file=status,
            idle_timeout_s=float(idle) if idle is not None else None,
            mps_env=dict(env),
        )


@dataclass
class StandbyWorker:
    """A ready worker (`start_standby_worker`): its process, the address it listens on, and the
    two pipes its agent keeps, stdin for the hand-over and the ready pipe for its answer. It
    serves nothing until `hand_over`; its stdin closed without one (`stop`, or its agent gone)
    makes it leave."""

    proc: Any
    address: Address
    device: str
    _stdin: Any
    _ready_fd: int
    _handed: bool = False

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def hand_over(
        self, handover: Handover, timeout_s: float = 60.0, log_file: Path | None = None
    ) -> WorkerReady:
        """Give the worker its lease; returns once it serves it (its ready line). A ready worker
        is handed over once: a second call, or one after stop(), is refused."""
        if self._handed:
            raise WorkerStartFailed("this ready worker was handed over already")
        self._handed = True
        try:
            self._stdin.write(handover.to_line())
            self._stdin.close()
        except OSError as exc:  # it died meanwhile
            self._close_ready()
            raise WorkerStartFailed(f"the ready worker is gone: {exc}") from None
        try:
            line = _read_ready(self._ready_fd, timeout_s)
        finally:
            self._close_ready()
        if not line:
            _kill(self.proc)
            said = "did not take its lease in time" if line is None else "exited"
            raise WorkerStartFailed(
                f"the ready worker {said} (lease {handover.lease})" + _log_tail(log_file)
            )
        ready = parse_ready(line)
        if ready.lease != handover.lease or ready.address != self.address:
            _kill(self.proc)
            raise WorkerStartFailed(
                f"the ready worker answered for {ready.lease} at {ready.address}"
            )
        return WorkerReady(
            ready.address, ready.lease, ready.device, ready.pid, handover.credentials
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """End a worker never handed over: its stdin closes (it leaves by itself), else a kill."""
        import subprocess

        self._handed = True
        with contextlib.suppress(OSError):
            self._stdin.close()
        self._close_ready()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _kill(self.proc)

    def _close_ready(self) -> None:
        if self._ready_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._ready_fd)
            self._ready_fd = -1


def start_standby_worker(
    *,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 120.0,
    log_file: Path | None = None,
    user: int | None = None,
    group: int | None = None,
    cwd: Path | None = None,
    placed: Callable[[int], None] | None = None,
    **options: Any,
) -> StandbyWorker:
    """Start a ready worker (options as for worker_argv, less the lease's own) and wait until
    it has imported torch and listens: its `standby` line on the ready pipe. As for
    start_worker_process, `placed(pid)` runs first (the worker's cgroup), and nothing secret is
    in its argv or environment; its lease, credentials and limits come with `hand_over`."""
    proc, read_end = _spawn(worker_argv(None, **options), env, log_file, user, group, cwd)
    try:
        if placed is not None:
            placed(proc.pid)
        line = _read_ready(read_end, ready_timeout_s)
    except BaseException:
        _kill(proc)
        os.close(read_end)
        raise
    if not line:
        _kill(proc)
        os.close(read_end)
        said = f"did not start within {ready_timeout_s:.0f} s" if line is None else "exited"
        raise WorkerStartFailed(f"a ready worker {said}" + _log_tail(log_file))
    try:
        standby = parse_standby(line)
    except DataPlaneError:
        _kill(proc)
        os.close(read_end)
        raise
    return StandbyWorker(proc, standby[0], standby[1], proc.stdin, read_end)


def parse_standby(line: str) -> tuple[Address, str]:
    """A ready worker's first line: {event: standby, address, device, pid}."""
    import json

    try:
        data = json.loads(line)
        if data.get("event") != "standby":
            raise ValueError(f"not a standby line: {line!r}")
        return parse_address(data["address"]), str(data["device"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataPlaneError(f"the ready worker did not report standby: {line.strip()!r}") from exc


def _spawn(
    argv: list[str],
    env: dict[str, str] | None,
    log_file: Path | None,
    user: int | None,
    group: int | None,
    cwd: Path | None,
) -> tuple[Any, int]:
    """A worker process with stdin a pipe of ours and a ready pipe (`--ready-fd`) of its own;
    its output to `log_file`. Returns (Popen, the ready pipe's read end)."""
    import subprocess

    child_env = dict(os.environ if env is None else env)
    child_env.pop(TOKEN_ENV, None)
    read_end, write_end = os.pipe()
    out: Any = subprocess.DEVNULL
    if log_file is not None:
        out = open(log_file, "ab")  # noqa: SIM115 - the child holds it; ours closes below
    try:
        proc = subprocess.Popen(
            [*argv, "--ready-fd", str(write_end)],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=out,
            env=child_env,
            pass_fds=(write_end,),
            user=user,
            group=group,
            extra_groups=[] if group is not None else None,
            cwd=cwd,
        )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
        if log_file is not None:
            out.close()
    return proc, read_end


def start_worker_process(
    lease: str,
    token: str | WorkerCredentials,
    *,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 120.0,
    log_file: Path | None = None,
    user: int | None = None,
    group: int | None = None,
    cwd: Path | None = None,
    placed: Callable[[int], None] | None = None,
    **options: Any,
) -> tuple[Any, WorkerReady]:
    """Start `python -m gpupool.worker` (options as for worker_argv) and wait for its ready
    line: what an agent does for a remote lease. Returns (Popen, WorkerReady).

    `token` is the lease's client token (fresh control and peer secrets are made for it) or
    the worker's whole credentials; they go through a pipe on the worker's stdin, which it
    reads before anything else, so they are in neither its argv nor its environment. Its
    stdout and stderr go to `log_file` (else nowhere): a pipe nobody reads would stop the
    worker the moment it filled; the ready line comes on a pipe of its own. `user`/`group`
    run it as another user (an agent running as root), `placed(pid)` runs before the worker
    gets its credentials, so a worker is in its cgroup before it can serve anybody."""
    credentials = WorkerCredentials.generate(token) if isinstance(token, str) else token
    argv = worker_argv(lease, credentials_stdin=True, **options)
    proc, read_end = _spawn(argv, env, log_file, user, group, cwd)
    assert proc.stdin is not None
    try:
        if placed is not None:
            placed(proc.pid)
        try:
            proc.stdin.write(credentials.to_line())
            proc.stdin.close()
        except OSError:  # it died before reading them: said below as it exited
            pass
        line = _read_ready(read_end, ready_timeout_s)
    except BaseException:
        _kill(proc)
        os.close(read_end)
        raise
    os.close(read_end)
    if line is None:
        _kill(proc)
        raise WorkerStartFailed(
            f"worker for lease {lease} did not start within {ready_timeout_s:.0f} s"
            + _log_tail(log_file)
        )
    if not line:
        proc.wait()
        raise WorkerStartFailed(
            f"worker for lease {lease} exited with {proc.returncode} before it was ready"
            + _log_tail(log_file)
        )
    ready = parse_ready(line)
    return proc, WorkerReady(ready.address, ready.lease, ready.device, ready.pid, credentials)


def _read_ready(fd: int, timeout_s: float) -> str | None:
    """The worker's ready line from `fd`: None if none came in time, "" if it closed first."""
    deadline = time.monotonic() + timeout_s
    got = b""
    while b"\n" not in got and len(got) < READY_LINE_MAX:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            return None
        chunk = os.read(fd, READY_LINE_MAX)
        if not chunk:
            break
        got += chunk
    return got.decode(errors="replace").partition("\n")[0] if b"\n" in got else ""


def _kill(proc: Any) -> None:
    with contextlib.suppress(OSError):
        proc.kill()
    proc.wait()


def _log_tail(log_file: Path | None, lines: int = 5) -> str:
    if log_file is None:
        return ""
    try:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return (": " + " | ".join(tail))[:1000] if tail else ""
