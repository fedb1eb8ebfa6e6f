"""A client's extra TCP connections (lanes) that carry its large puts' bytes side by side.

One TCP stream is bound by the copies one core makes on each end: on loopback and on fast
networks a large tensor moves several times faster over a few connections at once, as NCCL
and iperf -P move theirs. A client that connects over TCP may open up to the number of lanes
its WELCOME offers, each authenticated with the lease's client token and the session's lane
key (a secret of this connection only). A put marked PUT_LANES then has chunk i on lane
i modulo the number of lanes, each chunk a [PUT, handle, offset] frame read straight into
the put's destination by that lane's own thread (socket reads release the GIL), while the
executor waits for all of them. Every frame is checked against the chunk expected on that
lane; a lane that breaks or lies ends the session, as the main connection would.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field

from gpupool.protocol.v1.dataplane import (
    LANE_CHUNK_BYTES,
    Connection,
    ConnectionClosed,
    DataPlaneError,
    Kind,
    ProtocolError,
)

LANE_CONNECT_S = 10.0
"""How long a put marked PUT_LANES waits for lanes the client has not connected yet."""


@dataclass
class _Share:
    """One lane's part of one put: the chunks it carries, and how reading them ended."""

    handle: int
    dest: memoryview | None
    """None: read and drop (the put has nowhere to go)."""
    chunks: list[tuple[int, int]]
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None


class Lanes:
    """The lanes of one client session."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.key = secrets.token_hex(16)
        self._cv = threading.Condition()
        self._conns: dict[int, Connection] = {}
        self._work: dict[int, list[_Share]] = {i: [] for i in range(count)}
        self._closed = False

    def offer(self) -> dict[str, object]:
        """What WELCOME tells the client: how many lanes, and the key that opens them."""
        return {"count": self.count, "key": self.key}

    def admits(self, key: object, index: object) -> bool:
        return (
            isinstance(key, str)
            and secrets.compare_digest(key, self.key)
            and isinstance(index, int)
            and not isinstance(index, bool)
            and 0 <= index < self.count
        )

    def join(self, index: int, conn: Connection) -> bool:
        """Take `conn` as lane `index` (False: that lane is open already, or the session has
        ended). Before its WELCOME: a lane welcomed is a lane the session reads."""
        with self._cv:
            if self._closed or index in self._conns:
                return False
            self._conns[index] = conn
            self._cv.notify_all()
            return True

    def serve(self, index: int) -> None:
        """Run lane `index` (joined) on its connection's thread until the session ends."""
        conn = self._conns[index]
        while True:
            with self._cv:
                while not self._work[index] and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                share = self._work[index].pop(0)
            try:
                _read_share(conn, share)
            except (DataPlaneError, OSError, ValueError) as exc:
                share.error = exc
                share.done.set()
                self.close()
                return
            share.done.set()

    def read_put(self, handle: int, dest: memoryview | None, nbytes: int) -> None:
        """Fill dest (None: drop) with the put's nbytes from the lanes; raises where a lane
        broke, lied, or never connected."""
        with self._cv:
            if not self._cv.wait_for(
                lambda: self._closed or len(self._conns) == self.count, LANE_CONNECT_S
            ):
                raise ProtocolError("a put over lanes, but the client did not open them")
            if self._closed:
                raise ConnectionClosed("a lane of this session was closed")
            shares = [_Share(handle, dest, []) for _ in range(self.count)]
            for i, offset in enumerate(range(0, nbytes, LANE_CHUNK_BYTES)):
                size = min(LANE_CHUNK_BYTES, nbytes - offset)
                shares[i % self.count].chunks.append((offset, size))
            for index, share in enumerate(shares):
                self._work[index].append(share)
            self._cv.notify_all()
        for share in shares:
            share.done.wait()
        errors = [share.error for share in shares if share.error is not None]
        for error in errors:
            if isinstance(error, ProtocolError):
                raise error  # the lie, not the other lanes' reads that its end cut short
        if errors:
            raise ConnectionClosed(f"a lane was lost during a put: {errors[0]}")

    def close(self) -> None:
        with self._cv:
            self._closed = True
            conns = list(self._conns.values())
            waiting = [share for work in self._work.values() for share in work]
            for work in self._work.values():
                work.clear()
            self._cv.notify_all()
        for share in waiting:
            share.error = ConnectionClosed("the session ended")
            share.done.set()
        for conn in conns:
            conn.close()


def _read_share(conn: Connection, share: _Share) -> None:
    for offset, size in share.chunks:
        frame = conn.recv()
        head = frame.head()
        if head[0] != Kind.PUT or len(head) != 3 or head[1] != share.handle or head[2] != offset:
            raise ProtocolError(f"expected PUT of tensor {share.handle} at byte {offset} on a lane")
        if frame.tail_len != size:
            raise ProtocolError("a lane's PUT frame does not carry its chunk")
        if share.dest is None:
            conn.skip_tail()
        else:
            conn.read_tail_into(share.dest[offset : offset + size])
