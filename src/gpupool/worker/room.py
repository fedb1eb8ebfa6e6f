"""Waiting for device memory that other sessions of the GPU hold (memory oversubscription).

An allocation that fits the lease's own limit but not the GPU's physical free memory does not
fail at once: the worker tells its agent how much it is short of (through the status file,
written at once), and waits. The controller picks sessions that give way
(`gpupool.core.oversubscription.choose_victims`) and has them swapped out; as their memory
frees, the allocation goes on. If nothing can be freed the controller says so (the agent's
control op `room` with the request's number) and the allocation fails with the lease's
OutOfMemoryError; if no answer frees the room within the timeout, likewise. Nobody is killed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpupool.worker.activity import Activity

log = logging.getLogger("gpupool.worker.room")

ROOM_TIMEOUT_S = 60.0
"""How long an allocation waits for other sessions to make room before it fails."""
POLL_S = 0.05
"""How often a waiting allocation looks whether the room is there (a swap-out frees it)."""
MiB = 1 << 20


class Room:
    """The requests for room of one worker: one at a time (the serving thread allocates)."""

    def __init__(
        self,
        activity: Activity,
        timeout_s: float = ROOM_TIMEOUT_S,
        flush: Callable[[], None] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the room timeout must be positive, got {timeout_s:g} s")
        self.activity = activity
        self.timeout_s = timeout_s
        self._flush = flush
        self._seq = 0
        self._denied = 0
        self._changed = threading.Condition()
        self.waits = 0
        self.waited_s = 0.0
        self._refusal: str | None = None

    def take_refusal(self) -> str | None:
        """Why the last wait failed, in words for the tenant's OutOfMemoryError (None: it did
        not, or that was said already). A denial and a timeout differ for the user: the first
        says nobody will give way, the second that nobody did in time."""
        with self._changed:
            refusal, self._refusal = self._refusal, None
        return refusal

    def wait(self, missing: Callable[[], int]) -> bool:
        """Wait until `missing()` (the bytes the GPU still lacks; it may record the allocation
        when they are there) reaches 0. False: refused, or the timeout passed."""
        short = missing()
        if short <= 0:
            return True
        started = time.monotonic()
        with self._changed:
            self._seq += 1
            seq = self._seq
            self._refusal = None
        self.activity.room_wanted_bytes = short
        self.activity.room_seq = seq
        self._tell_agent()
        log.info(
            "lease %s: the GPU is %.1f MiB short; asking for room (request %d)",
            self.activity.lease_id, short / MiB, seq,
        )  # fmt: skip
        deadline = started + self.timeout_s
        try:
            while True:
                if missing() <= 0:
                    log.info(
                        "lease %s: room made in %.2f s", self.activity.lease_id,
                        time.monotonic() - started,
                    )  # fmt: skip
                    return True
                with self._changed:
                    if self._denied >= seq:
                        log.info("lease %s: no session can give way", self.activity.lease_id)
                        self._refusal = "no other session on this GPU can give way"
                        return False
                    left = deadline - time.monotonic()
                    if left <= 0:
                        log.warning(
                            "lease %s: no room within %.0f s", self.activity.lease_id,
                            self.timeout_s,
                        )  # fmt: skip
                        self._refusal = (
                            f"no other session on this GPU made room within {self.timeout_s:.0f} s"
                        )
                        return False
                    self._changed.wait(min(POLL_S, left))
        finally:
            self.waits += 1
            self.waited_s += time.monotonic() - started
            self.activity.room_wanted_bytes = 0
            self._tell_agent()

    def deny(self, seq: int) -> None:
        """The controller found nobody to give way for request `seq` (the agent's control op)."""
        with self._changed:
            self._denied = max(self._denied, seq)
            self._changed.notify_all()

    def stop(self) -> None:
        """The worker is stopping: a waiting allocation fails now rather than at its timeout."""
        with self._changed:
            self._denied = self._seq + (1 << 30)
            self._changed.notify_all()

    def _tell_agent(self) -> None:
        if self._flush is not None:
            self._flush()
