"""The client's side of a worker's lanes: extra TCP connections that send large puts' bytes
side by side (`gpupool.worker.lanes` says why and how the worker reads them).

Each lane has a sender thread and a queue; a put hands lane k its chunks k, k + n, k + 2n, ...
of the tensor's bytes (kept alive by the put until sent), and the lanes send them in the order
the puts were made, which is the order the worker reads them in. A blocking put waits for its
own chunks; a non-blocking one (pinned memory, as CUDA asks) returns at once. A lane that
fails marks them all broken: the put's stream is lost, as it is when its own connection is.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from gpupool.protocol.v1.dataplane import (
    LANE_CHUNK_BYTES,
    MAX_LANES,
    VERSION,
    Address,
    Connection,
    DataPlaneError,
    Kind,
    Role,
    connect,
    recv_handshake,
    send_handshake,
)

PUT_LANES_WANTED = int(os.environ.get("GPUPOOL_PUT_LANES", "4"))
"""How many lanes a client opens, at most (the worker offers how many it takes; 0: none)."""
LANE_PUT_MIN_BYTES = 2 * LANE_CHUNK_BYTES
"""Smaller puts gain nothing from being split: they go on the stream's own connection."""


class _Job:
    """One put's chunks on every lane: done when each lane has sent its share."""

    def __init__(self, lanes: int) -> None:
        self.left = lanes
        self.done = threading.Event()


@dataclass
class _Share:
    handle: int
    data: memoryview
    start: int
    step: int
    keep: Any
    job: _Job


class PutLanes:
    """A worker's lanes, opened with the session's key."""

    def __init__(self, conns: list[Connection]) -> None:
        self._conns = conns
        self._cv = threading.Condition()
        self._queues: list[deque[_Share]] = [deque() for _ in conns]
        self._busy = 0
        self.error: DataPlaneError | None = None
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"gpupool-lane-{i}", daemon=True)
            for i in range(len(conns))
        ]
        for thread in self._threads:
            thread.start()

    @classmethod
    def open(cls, address: Address, lease: str, token: str, offer: object) -> PutLanes | None:
        """Connect the lanes a WELCOME offered (None: none offered, or they cannot be had:
        puts then go on the stream's own connection, as before)."""
        if not isinstance(offer, dict) or address.is_unix or PUT_LANES_WANTED <= 0:
            return None
        count, key = offer.get("count"), offer.get("key")
        if not isinstance(count, int) or not isinstance(key, str) or count <= 0:
            return None
        conns: list[Connection] = []
        try:
            for index in range(min(count, PUT_LANES_WANTED, MAX_LANES)):
                sock = connect(address)
                conns.append(Connection(sock))
                hello = {"v": VERSION, "lease": lease, "token": token, "role": Role.LANE,
                         "key": key, "lane": index}  # fmt: skip
                send_handshake(sock, [Kind.HELLO, hello])
                if recv_handshake(sock).head[0] != Kind.WELCOME:
                    raise DataPlaneError(f"the worker refused lane {index}")
        except (OSError, DataPlaneError):
            for conn in conns:
                conn.close()
            return None
        return cls(conns)

    @property
    def count(self) -> int:
        return len(self._conns)

    @property
    def busy(self) -> bool:
        """Whether some put's bytes are still being sent."""
        return self._busy > 0

    def send(self, handle: int, data: memoryview, keep: Any) -> _Job:
        """Queue a put's bytes on every lane (`keep` holds their memory until they are sent)."""
        job = _Job(self.count)
        with self._cv:
            if self.error is not None:
                raise self.error
            for index, queue in enumerate(self._queues):
                queue.append(_Share(handle, data, index * LANE_CHUNK_BYTES,
                                    self.count * LANE_CHUNK_BYTES, keep, job))  # fmt: skip
            self._busy += 1
            self._cv.notify_all()
        return job

    def wait(self, job: _Job | None = None) -> None:
        """Until `job` is sent (None: everything queued); raises where a lane broke."""
        if job is not None:
            job.done.wait()
        else:
            with self._cv:
                while self._busy and self.error is None:
                    self._cv.wait()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for conn in self._conns:
            conn.close()

    def forget(self) -> None:
        """In a forked child: drop this process's copies of the sockets, end nothing."""
        for conn in self._conns:
            conn.forget()

    def _run(self, index: int) -> None:
        queue, conn = self._queues[index], self._conns[index]
        while True:
            with self._cv:
                while not queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                share = queue[0]
            try:
                if self.error is None:
                    for offset in range(share.start, len(share.data), share.step):
                        chunk = share.data[offset : offset + LANE_CHUNK_BYTES]
                        conn.send([Kind.PUT, share.handle, offset], chunk)
            except DataPlaneError as exc:
                with self._cv:
                    self.error = self.error or exc
            with self._cv:
                queue.popleft()
                share.job.left -= 1
                if share.job.left == 0:
                    share.job.done.set()
                    self._busy -= 1
                self._cv.notify_all()
            del share
