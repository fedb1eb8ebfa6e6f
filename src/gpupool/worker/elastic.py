"""Swap-out, restore and handoff of one client's state: what makes a remote slice elastic.

Every change happens at a point of the client's op stream that both sides agree on. The
worker only announces (a NOTICE frame: "swap" when the client has been idle for the idle
timeout or the agent asks for it, "move" when a successor worker is waiting); the client
answers with a SWAP or RESUME record after everything it sent before, so no op is lost, run
twice or run against the wrong copy of a tensor.

- SWAP: the tensors go to host memory (pinned on a GPU worker) and the device memory is
  freed; the worker process stays, holding the state, and reports `swapped` to its agent.
- RESUME: the client needs its tensors again. An unmanaged worker (no agent) restores in
  place at once; a managed one waits until its agent says the slice is granted here again
  (control `resume`) or a successor worker of the lease connects (the controller placed the
  lease elsewhere). To a successor it ships the state and replies {"to": its address}; the
  client reconnects there and goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpupool.protocol.v1.dataplane import (
    CHUNK_BYTES,
    Connection,
    ConnectionClosed,
    DataPlaneError,
    ErrorBody,
    ErrorKind,
    Kind,
    ProtocolError,
)
from gpupool.worker.executor import Executor, Link
from gpupool.worker.handoff import RING_SLOTS, HandoffFailed, Offer, receive, send
from gpupool.worker.memory import LimitExceeded
from gpupool.worker.swap import ClientState, Ring

if TYPE_CHECKING:
    from gpupool.worker.memory import MemoryLimit
    from gpupool.worker.room import Room

log = logging.getLogger("gpupool.worker.elastic")

TICK_S = 0.1
"""How often a worker with nothing to read checks for idleness and waiting successors."""
SUCCESSOR_ACK_TIMEOUT_S = 600.0


class HandedOff(Exception):
    """The client's state now lives on the successor: this connection ends."""


@dataclass
class _Successor:
    conn: Connection
    offer: Offer
    done: threading.Event

    @property
    def address(self) -> str:
        return self.offer.address


class Elasticity:
    """The swap and handoff state of one worker (one client at a time)."""

    def __init__(
        self,
        executor: Executor,
        memory: MemoryLimit,
        idle_timeout_s: float | None,
        managed: bool,
        room: Room | None = None,
    ) -> None:
        self.executor = executor
        self.room = room
        self.memory = memory
        self.idle_timeout_s = idle_timeout_s
        self.managed = managed
        self.swapped: ClientState | None = None
        self.moved_to: str | None = None
        self._successor: _Successor | None = None
        self._resume_here = False
        self._swap_requested = False
        self._noticed: str | None = None
        self._client_since = time.time()
        self.wanted = False
        """A successor waits for the state: checked before every batch, so it is cheap."""
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._settled = threading.Event()
        """Clear from a handoff's start to its reply to the client (see finish_handoff)."""
        self._settled.set()
        executor.elastic = self

    # ---- the serving thread, between frames -------------------------------------------------

    def client_started(self) -> None:
        self._noticed = None
        self._client_since = time.time()

    def client_left(self) -> None:
        """The client's program ended: a swapped state has nobody left to come back for it."""
        self.swapped = None
        self.executor.activity.swapped = False
        self.executor.activity.wants_gpu = False

    def busy(self) -> None:
        """The client sends ops: a swap it did not answer is off; it may be asked again."""
        if self._noticed == "swap":
            self._noticed = None

    def quiet(self, link: Link) -> None:
        """No frame for a tick: announce a waiting successor or an idle swap to the client."""
        with self._changed:
            successor = self._successor
            swap_asked = self._swap_requested
        if successor is not None:
            self._notice(link, "move")
        elif self.swapped is None and self.executor.tensors and (swap_asked or self._idle()):
            self._notice(link, "swap")

    def _idle(self) -> bool:
        if self.idle_timeout_s is None:
            return False
        last = max(self.executor.activity.last_op_at or 0.0, self._client_since)
        return time.time() - last >= self.idle_timeout_s

    def _notice(self, link: Link, event: str) -> None:
        if self._noticed == event:
            return
        self._noticed = event
        log.info("asking the client of lease %s to %s", self.executor.lease_id, event)
        link.reply([Kind.NOTICE, {"event": event}])

    # ---- records of the client's stream -------------------------------------------------------

    def swap(self, req: int, link: Link) -> None:
        started = time.perf_counter()
        if self.swapped is None:
            try:
                self.swapped = self.executor.export_state()
            except LimitExceeded as exc:  # nothing moved: the tensors are still on the device
                self._noticed = None
                with self._changed:
                    self._swap_requested = False
                error = ErrorBody(
                    ErrorKind.OUT_OF_MEMORY,
                    f"gpupool lease {self.executor.lease_id}: cannot swap to host memory: {exc}",
                    "swap", "OutOfMemoryError",
                )  # fmt: skip
                link.reply([Kind.ERROR, req, error.to_wire()])
                return
        self._noticed = None
        with self._changed:
            self._swap_requested = False
            self._resume_here = False
        self.executor.activity.swapped = True
        took = time.perf_counter() - started
        log.info(
            "lease %s swapped out: %.1f MiB to host memory in %.3f s",
            self.executor.lease_id, self.swapped.nbytes / (1 << 20), took,
        )  # fmt: skip
        link.reply([Kind.RESULT, req, {"bytes": self.swapped.nbytes, "seconds": took}])

    def resume(self, req: int, link: Link) -> None:
        started = time.perf_counter()
        while (successor := self._await_gpu()) is not None:
            self._noticed = None
            self._settled.clear()
            try:
                moved = self._hand_off(successor)
                if moved is not None:
                    nbytes, path = moved
                    link.reply(
                        [Kind.RESULT, req, {"to": successor.address, "bytes": nbytes,
                                            "path": path,
                                            "seconds": time.perf_counter() - started}]
                    )  # fmt: skip
                    raise HandedOff(successor.address)
            finally:
                self._settled.set()
            if self.swapped is None:
                break  # the handoff failed and the tensors are still here: the client goes on
            # A swapped state needs a GPU: wait for the next successor or a grant here.
        self._noticed = None
        if self.swapped is not None:
            try:
                self.executor.import_state(self.swapped)
            except Exception as exc:  # e.g. the slice shrank below the state: stay swapped
                self.executor.tensors.clear()
                self.memory.reset()
                error = ErrorBody(
                    ErrorKind.OUT_OF_MEMORY,
                    f"gpupool lease {self.executor.lease_id}: cannot restore "
                    f"{self.swapped.nbytes / (1 << 20):.1f} MiB of swapped tensors: {exc}",
                    "resume", "OutOfMemoryError",
                )  # fmt: skip
                link.reply([Kind.ERROR, req, error.to_wire()])
                return
            self.swapped = None
            self.executor.activity.swapped = False
        link.reply([Kind.RESULT, req, {"to": None, "seconds": time.perf_counter() - started}])

    def _await_gpu(self) -> _Successor | None:
        """Block until the state may go back on a GPU: a successor, or a grant here."""
        activity = self.executor.activity
        with self._changed:
            while True:
                if self._successor is not None:
                    break
                if self.swapped is None or not self.managed or self._resume_here:
                    break
                if self._stopping.is_set():
                    raise ConnectionClosed("the worker is stopping")
                activity.wants_gpu = True
                self._changed.wait(TICK_S)
            activity.wants_gpu = False
            self._resume_here = False
            return self._successor

    def _hand_off(self, successor: _Successor) -> tuple[int, str] | None:
        """Ship the state; once the successor holds it, free it here: (bytes, path). None: it
        failed, and the state is still here as it was (on the device, or swapped to host memory)."""
        started = time.perf_counter()
        state = self.swapped if self.swapped is not None else self.executor.client_state()
        try:
            successor.conn.sock.settimeout(SUCCESSOR_ACK_TIMEOUT_S)
            path = send(successor.conn, state, successor.offer, self.executor.device)
        except (DataPlaneError, OSError) as exc:
            kind = "" if isinstance(exc, HandoffFailed) else "the connection broke: "
            log.warning(
                "handing lease %s to %s failed (%s%s); the state stays here",
                self.executor.lease_id, successor.address, kind, exc,
            )  # fmt: skip
            with self._changed:
                self._successor = None
            return None
        finally:
            self.wanted = False
            successor.done.set()
        nbytes = state.nbytes
        del state
        self.swapped = None
        self.executor.drop_state()
        self.moved_to = successor.address
        self.executor.activity.moved_to = successor.address
        self.executor.activity.swapped = False
        log.info(
            "lease %s handed to %s by %s: %.1f MiB in %.3f s",
            self.executor.lease_id, successor.address, path, nbytes / (1 << 20),
            time.perf_counter() - started,
        )  # fmt: skip
        return nbytes, path

    # ---- side connections (their own threads) ------------------------------------------------

    def serve_successor(self, conn: Connection, idle: threading.Lock) -> None:
        """A successor worker registers; the serving thread ships the state at the client's
        RESUME. With no client on, nothing is in the table: hand off the (empty) state now."""
        frame = conn.recv().head()
        if frame[0] != Kind.CONTROL or len(frame) != 3 or not isinstance(frame[2], dict):
            raise ProtocolError("a successor starts with [CONTROL, req, {op: adopt}]")
        successor = _Successor(conn, Offer.from_wire(frame[2]), threading.Event())
        if idle.acquire(blocking=False):  # no client: nobody will send RESUME
            try:
                self._hand_off(successor)
            finally:
                idle.release()
            return
        with self._changed:
            if self._successor is not None:
                raise ProtocolError("another successor is already waiting")
            self._successor = successor
            self.wanted = True
            self._changed.notify_all()
        successor.done.wait()

    def control(self, body: dict[str, Any]) -> dict[str, Any]:
        """The agent's requests: resume in place, new limits, swap now (another session needs
        the memory, or the client idles), no room for a request (nobody can give way)."""
        op = body.get("op")
        if op == "room":
            seq = body.get("denied_seq")
            if not isinstance(seq, int) or isinstance(seq, bool) or seq <= 0:
                raise ProtocolError("room needs denied_seq, a positive integer")
            if self.room is not None:
                self.room.deny(seq)
            return {"room_seq": self.executor.activity.room_seq}
        with self._changed:
            if op == "resume":
                self._resume_here = True
            elif op == "swap":
                self._swap_requested = self.swapped is None
            elif op == "limits":
                mib = body.get("memory_limit_mib")
                if mib is not None and (not isinstance(mib, int) or mib <= 0):
                    raise ProtocolError("memory_limit_mib must be a positive integer")
                self.memory.set_limit(None if mib is None else mib << 20)
                self.executor.activity.memory_limit_bytes = self.memory.limit_bytes
            elif op != "status":
                raise ProtocolError(f"unknown control op {op!r}")
            self._changed.notify_all()
        return {
            "swapped": self.swapped is not None,
            "moved_to": self.moved_to,
            "memory_limit_bytes": self.memory.limit_bytes,
        }

    def refusal(self) -> ErrorBody | None:
        """A client that comes back to a worker that handed its state on is told where to go."""
        if self.moved_to is None:
            return None
        return ErrorBody(ErrorKind.MOVED, self.moved_to)

    def finish_handoff(self, timeout_s: float) -> bool:
        """Before the worker stops: let a handoff in flight end with its reply, which tells the
        client where its state went. The agent stops a predecessor as soon as the controller
        places the lease on the successor, which can come before that reply (the successor
        holds the state once it is received, the predecessor replies after its acknowledgement);
        closing the client's connection then would strand a client whose tensors are safe.
        Returns whether no handoff is in flight."""
        return self._settled.wait(timeout_s)

    def stop(self) -> None:
        self._stopping.set()
        with self._changed:
            self._changed.notify_all()


def adopt(conn: Connection, offer: Offer, executor: Executor) -> ClientState:
    """The successor's side: register with the predecessor, receive the state, restore it."""
    # Pinned before the pause.
    ring = Ring(RING_SLOTS, CHUNK_BYTES) if executor.device.type == "cuda" else None
    conn.send([Kind.CONTROL, 1, offer.to_wire()])
    conn.sock.settimeout(None)  # the client may take its time to reach a RESUME
    return receive(conn, executor.device, executor.import_state, ring, executor.reserve_state)
