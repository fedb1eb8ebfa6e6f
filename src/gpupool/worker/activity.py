"""What the agent learns about its worker: last op time, memory held, whether a client is on."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path


@dataclass
class Activity:
    lease_id: str = ""
    pid: int = 0
    client_connected: bool = False
    client_peer: str | None = None
    last_op_at: float | None = None
    """Unix time of the last batch of ops run; None until the first."""
    ops_total: int = 0
    busy_s: float = 0.0
    """Seconds spent running batches (decoding records, calling ops, launching kernels): with
    ops_total, what the worker's own Python costs per record, the bound it sets on a step."""
    busy_cpu_s: float = 0.0
    """Of busy_s, what the serving thread spent on the CPU; the rest it waited (for the GPU's
    launch queue, an allocation, a copy): tells a worker bound by Python from one bound by
    its device."""
    memory_held_bytes: int = 0
    memory_limit_bytes: int | None = None
    swapped: bool = False
    """The client's tensors are in host memory; the device holds none of them."""
    wants_gpu: bool = False
    """A swapped client sent ops: the agent should ask the controller for its slice again."""
    moved_to: str | None = None
    """The successor worker that took the client's state (migration)."""
    adopted: bool = False
    """This worker took its predecessor's state over and serves the client now."""
    room_seq: int = 0
    """The number of the last request for room on the GPU (memory oversubscription)."""
    room_wanted_bytes: int = 0
    """While an allocation waits for others to free memory: how much the GPU lacks; else 0."""

    _memory_probe: Callable[[], int] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def watch_memory(self, probe: Callable[[], int]) -> None:
        """memory_held_bytes is asked of `probe` when a snapshot is taken, not after every
        batch: on CUDA it is `torch.cuda.memory_stats`, whose dictionary takes far longer to
        build than a small batch takes to run (it made every read wait for it)."""
        self._memory_probe = probe

    def ran(
        self,
        ops: int,
        memory_held_bytes: int | None = None,
        busy_s: float = 0.0,
        busy_cpu_s: float = 0.0,
    ) -> None:
        self.busy_s += busy_s
        self.busy_cpu_s += busy_cpu_s
        if ops:
            self.ops_total += ops
            self.last_op_at = time.time()
        if memory_held_bytes is not None:
            self.memory_held_bytes = memory_held_bytes

    def snapshot(self) -> dict[str, object]:
        probe = self._memory_probe
        if probe is not None:
            with contextlib.suppress(Exception):
                self.memory_held_bytes = int(probe())
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}


class StatusFile:
    """Rewrites a small JSON file (atomically) whenever the activity changed; the agent reads it.

    A file, not an endpoint: the worker serves exactly one client and must not open a second
    listening socket that a tenant could reach."""

    def __init__(self, path: Path, activity: Activity, period_s: float = 1.0) -> None:
        self.path = path
        self.activity = activity
        self.period_s = period_s
        self._stop = threading.Event()
        self._last: dict[str, object] | None = None
        # The periodic thread and an urgent write (a request for room) share the file.
        self._writing = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="gpupool-status", daemon=True)

    def start(self) -> None:
        self.write()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.write()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.write()

    def write(self) -> None:
        with self._writing:
            self._write()

    def _write(self) -> None:
        snapshot = self.activity.snapshot()
        if snapshot == self._last:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(snapshot))
            os.replace(tmp, self.path)
            self._last = snapshot
