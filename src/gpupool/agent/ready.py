"""Workers started before their leases, a few per GPU, so that a new remote lease starts at once.

A cold worker costs a new remote lease seconds (a process, torch's import, the meta kernels,
on a GPU the CUDA context). The agent keeps `per_gpu` ready workers for every GPU that takes
remote leases (`gpupool agent --ready-workers N`); a new lease takes one, which the supervisor
hands the lease's limits and credentials (`gpupool.worker.standby`), and the pool starts
another in the background. A ready worker serves one lease and ends with it, like a cold one:
nothing of one tenant's session is ever in another's worker.

A ready worker is started as a cold one is (the workers' user, environment allowlist and
memory cgroup) but without anything of a lease: no credentials, limits or lease id. Those it
can only get from its agent, on its stdin. Where its GPU has an MPS daemon the worker waits
for the hand-over to make its CUDA context, since the lease's share must be in the
environment when the context connects; a worker that reached its GPU's daemon at another
pipe than the GPU has now is not handed out (`ReadyWorker.mps_pipe`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpupool.agent.isolation import WorkerCgroup

if TYPE_CHECKING:
    from gpupool.protocol.v1.dataplane import StandbyWorker

log = logging.getLogger("gpupool.agent.ready")

DEFAULT_PER_GPU = 1
MAX_PER_GPU = 8
CHECK_S = 1.0
"""How often the pool looks for ready workers that died, when nothing woke it sooner."""
RETRY_MAX_S = 60.0
"""The longest pause after ready workers failed to start (doubling from CHECK_S)."""


@dataclass
class ReadyWorker:
    """One started worker waiting for a lease: its process and what the agent made for it."""

    gpu_uuid: str
    standby: StandbyWorker
    directory: Path
    """Its HOME and working directory (the worker user's), removed when it has ended."""
    log_file: Path
    cgroup: WorkerCgroup | None
    mps_pipe: str | None
    """The MPS pipe directory in its environment (None: it runs without MPS)."""
    created_at: float | None = None

    @property
    def pid(self) -> int:
        return self.standby.pid

    def discard(self) -> None:
        """Stop a worker that will not be handed over, and remove what was made for it."""
        self.standby.stop()
        if self.cgroup is not None:
            self.cgroup.remove()
        shutil.rmtree(self.directory, ignore_errors=True)


class ReadyPool:
    """Keeps `per_gpu` ready workers for each GPU named by set_gpus(), in a thread of its own.

    `start(gpu_uuid)` makes one (blocking: seconds); `usable(worker)` says whether one may
    still be handed out (its GPU's MPS pipe unchanged). Workers start one at a time, so that
    refilling after a hand-over takes one core, not all of them, from the leases running."""

    def __init__(
        self,
        per_gpu: int,
        start: Callable[[str], ReadyWorker],
        usable: Callable[[ReadyWorker], bool],
        check_s: float = CHECK_S,
    ) -> None:
        if not 0 <= per_gpu <= MAX_PER_GPU:
            raise ValueError(f"ready workers per GPU must be 0..{MAX_PER_GPU}, got {per_gpu}")
        self.per_gpu = per_gpu
        self._start = start
        self._usable = usable
        self._check_s = check_s
        self._gpus: tuple[str, ...] = ()
        self._ready: dict[str, list[ReadyWorker]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = 0
        """Ready workers started since the agent started (refills included)."""
        self.handed_over = 0
        self.replaced = 0
        """Ready workers found dead, or unusable, and started again."""
        self.problem: str | None = None
        """Why the last ready worker failed to start (None: the last one started)."""
        self._starting_pid: int | None = None
        """The process of the ready worker being started now (stop() ends it at once)."""

    # ---- what the agent and the supervisor ask ------------------------------------------

    def set_gpus(self, uuids: Iterable[str]) -> None:
        """The GPUs that take remote leases now (virtual mode); ready workers of others go."""
        gpus = tuple(sorted(set(uuids)))
        if self.per_gpu == 0:
            return
        with self._lock:
            changed = gpus != self._gpus
            self._gpus = gpus
            if self._thread is None and not self._stopping.is_set():
                self._thread = threading.Thread(
                    target=self._keep, name="gpupool-ready", daemon=True
                )
                self._thread.start()
        if changed:
            self._wake.set()

    def take(self, gpu_uuid: str, claim: Callable[[int], None] | None = None) -> ReadyWorker | None:
        """A ready worker of `gpu_uuid` for a new lease (None: none is ready); it is the
        caller's from now on, and the pool starts another.

        `claim` gets the worker's pid while the pool still counts it among its own (under the
        pool's lock), so that the caller counts it before the pool stops: the direct-slice watch
        asks both, and a worker in neither is a stranger on the GPU. Under MPS a ready worker
        makes its CUDA context during the hand-over, and the watch stopped it there in about
        half of the hand-overs on the H200 machine (each lease then waited 4-6 s for a cold
        start)."""
        found: ReadyWorker | None = None
        dropped: list[ReadyWorker] = []
        with self._lock:
            ready = self._ready.get(gpu_uuid, [])
            while ready and found is None:
                candidate = ready[0]
                if candidate.standby.alive() and self._usable(candidate):
                    found = candidate
                    if claim is not None:
                        claim(candidate.pid)
                else:
                    dropped.append(candidate)
                ready.pop(0)
            if found is not None:
                self.handed_over += 1
        for worker in dropped:
            log.warning("ready worker %d of %s is gone or unusable: dropped", worker.pid, gpu_uuid)
            worker.discard()
        self._wake.set()
        return found

    def counts(self) -> dict[str, int]:
        """Ready workers alive now, per GPU that should have them."""
        with self._lock:
            return {
                uuid: sum(1 for w in self._ready.get(uuid, []) if w.standby.alive())
                for uuid in self._gpus
            }

    @property
    def wanted(self) -> int:
        with self._lock:
            return self.per_gpu * len(self._gpus)

    def pids(self) -> set[int]:
        with self._lock:
            return {w.pid for ready in self._ready.values() for w in ready}

    def starting(self, pid: int) -> None:
        """The start in progress has this process (called by `start` as soon as it exists)."""
        with self._lock:
            self._starting_pid = pid
        if self._stopping.is_set():
            self._kill_starting()

    def stop(self) -> None:
        """Stop refilling and end every ready worker (the agent is stopping); one still
        importing torch is killed rather than waited for."""
        self._stopping.set()
        self._wake.set()
        self._kill_starting()
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            workers = [w for ready in self._ready.values() for w in ready]
            self._ready.clear()
        for worker in workers:
            worker.discard()

    def _kill_starting(self) -> None:
        with self._lock:
            pid = self._starting_pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    # ---- the refill thread ------------------------------------------------------------------

    def _keep(self) -> None:
        pause_s = self._check_s
        while not self._stopping.is_set():
            self._drop_dead()
            gpu = self._short_of()
            if gpu is None:
                self._wake.wait(self._check_s)
                self._wake.clear()
                continue
            try:
                worker = self._start(gpu)
            except Exception as exc:  # said in facts and the log; tried again, less often
                with self._lock:
                    self._starting_pid = None
                if self._stopping.is_set():
                    return
                self.problem = str(exc)[:300]
                log.error("cannot start a ready worker for %s: %s", gpu, exc)
                self._stopping.wait(pause_s)
                pause_s = min(RETRY_MAX_S, pause_s * 2)
                continue
            pause_s, self.problem = self._check_s, None
            with self._lock:
                self._starting_pid = None
                keep = gpu in self._gpus and not self._stopping.is_set()
                if keep:
                    self._ready.setdefault(gpu, []).append(worker)
                    self.started += 1
            if not keep:
                worker.discard()

    def _short_of(self) -> str | None:
        """The GPU with the fewest ready workers, if it has fewer than per_gpu."""
        with self._lock:
            counts = {uuid: len(self._ready.get(uuid, [])) for uuid in self._gpus}
        if not counts:
            return None
        gpu = min(counts, key=lambda uuid: counts[uuid])
        return gpu if counts[gpu] < self.per_gpu else None

    def _drop_dead(self) -> None:
        """Ready workers that died, or whose GPU no longer takes remote leases, go."""
        gone: list[tuple[ReadyWorker, str]] = []
        with self._lock:
            for uuid, ready in list(self._ready.items()):
                for worker in list(ready):
                    if uuid not in self._gpus:
                        gone.append((worker, "its GPU takes no remote leases now"))
                    elif not worker.standby.alive():
                        gone.append((worker, f"it exited with {worker.standby.proc.returncode}"))
                        self.replaced += 1
                    elif not self._usable(worker):
                        gone.append((worker, "its GPU's MPS daemon changed"))
                        self.replaced += 1
                    else:
                        continue
                    ready.remove(worker)
                if not ready:
                    del self._ready[uuid]
        for worker, why in gone:
            log.warning("ready worker %d of %s dropped: %s", worker.pid, worker.gpu_uuid, why)
            with contextlib.suppress(Exception):
                worker.discard()
