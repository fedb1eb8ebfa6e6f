"""One worker process per remote slice on this node, started and stopped as leases come and go.

The agent starts workers itself, with the lease's limits in their environment (the GPU, its
MPS daemon, the compute share and memory limit), so the tenant's program, which runs
elsewhere and only talks to the worker, cannot change them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpupool.agent.mps import MpsSupervisor, client_env
from gpupool.protocol.v1.api import RemoteLease, RemoteSlice, WorkerReport

log = logging.getLogger("gpupool.agent.workers")

STOP_GRACE_S = 10.0


Key = tuple[str, str, int]
"""(lease, GPU uuid, generation): a move starts generation n+1 beside generation n."""


@dataclass
class Worker:
    lease_id: str
    gpu_uuid: str
    proc: subprocess.Popen[str]
    endpoint: str
    status_file: Path
    token: str = ""
    generation: int = 0
    memory_mib: int | None = None
    """The memory limit the worker runs with now (a resize changes it in place)."""

    def report(self) -> WorkerReport:
        alive = self.proc.poll() is None
        activity: dict[str, object] = {}
        with contextlib.suppress(OSError, ValueError):
            activity = json.loads(self.status_file.read_text())
        last_op = activity.get("last_op_at")
        held = activity.get("memory_held_bytes")
        moved_to = activity.get("moved_to")
        return WorkerReport(
            generation=self.generation,
            swapped=activity.get("swapped") is True,
            wants_gpu=activity.get("wants_gpu") is True,
            adopted=activity.get("adopted") is True,
            moved_to=moved_to if isinstance(moved_to, str) else None,
            lease_id=self.lease_id,
            gpu_uuid=self.gpu_uuid,
            endpoint=self.endpoint if alive else None,
            alive=alive,
            last_op_at=float(last_op) if isinstance(last_op, int | float) else None,
            memory_mib=int(held) // (1024 * 1024) if isinstance(held, int) else None,
            error=None if alive else f"worker exited with {self.proc.returncode}",
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class WorkerSupervisor:
    """Keeps exactly one worker per remote slice the controller placed on this node."""

    def __init__(
        self, root: Path, mps: MpsSupervisor, simulated: bool, listen_host: str = "127.0.0.1"
    ) -> None:
        self.root = root
        self.mps = mps
        self.simulated = simulated
        self.listen_host = listen_host
        self.workers: dict[Key, Worker] = {}
        self.failures: dict[Key, str] = {}
        # reconcile() runs in a thread of its own while heartbeats read reports().
        self._lock = threading.Lock()

    def reconcile(self, leases: Mapping[str, RemoteLease]) -> None:
        wanted = {
            (lease_id, piece.gpu_uuid, piece.generation): (lease, piece)
            for lease_id, lease in leases.items()
            for piece in lease.slices
        }
        with self._lock:
            ended = [self.workers.pop(key) for key in set(self.workers) - set(wanted)]
            for key in set(self.failures) - set(wanted):
                del self.failures[key]
        for worker in ended:
            log.info("lease %s ended: stopping its worker on %s", worker.lease_id, worker.gpu_uuid)
            worker.stop()
        for key, (lease, piece) in wanted.items():
            # A dead worker stays reported as dead: its client's tensors are gone, and
            # restarting it silently would hand the client an empty handle table.
            running = self.workers.get(key)
            if running is not None and running.memory_mib != piece.memory_mib:
                self._resize(running, piece.memory_mib)
            if key in self.workers or key in self.failures:
                continue
            try:
                started = self._start(key[0], lease, piece)
            except Exception as exc:  # the reason goes to the controller, the loop goes on
                log.error("cannot start a worker for lease %s on %s: %s", key[0], key[1], exc)
                with self._lock:
                    self.failures[key] = str(exc)[:300]
            else:
                with self._lock:
                    self.workers[key] = started

    def _resize(self, worker: Worker, memory_mib: int) -> None:
        """A live resize of memory: the worker's allocator limit changes, the client stays."""
        from gpupool.protocol.v1.dataplane import parse_address, send_control

        try:
            send_control(
                parse_address(worker.endpoint),
                worker.lease_id,
                worker.token,
                {"op": "limits", "memory_limit_mib": memory_mib},
            )
        except Exception as exc:  # retried at the next reconcile
            log.warning("cannot resize the worker of lease %s: %s", worker.lease_id, exc)
            return
        log.info("lease %s: memory limit now %d MiB", worker.lease_id, memory_mib)
        worker.memory_mib = memory_mib

    def _start(self, lease_id: str, lease: RemoteLease, piece: RemoteSlice) -> Worker:
        from gpupool.protocol.v1.dataplane import start_worker_process

        token = lease.token
        directory = self.root / lease_id
        directory.mkdir(parents=True, exist_ok=True)
        status_file = directory / f"{piece.gpu_index}.g{piece.generation}.status.json"
        env = dict(os.environ)
        if self.simulated:
            device = "cpu"
        else:
            device = "cuda:0"
            env["CUDA_VISIBLE_DEVICES"] = piece.gpu_uuid
            pipe = self.mps.pipe_dir(piece.gpu_uuid)
            if pipe is not None:
                env.update(
                    client_env(
                        Path(pipe), Path(pipe).parent / "log", piece.compute_pct, piece.memory_mib
                    )
                )
        proc, ready = start_worker_process(
            lease_id,
            token,
            env=env,
            device=device,
            listen=f"tcp://{self.listen_host}:0",
            memory_limit_mib=piece.memory_mib,
            status_file=status_file,
            idle_timeout_s=lease.idle_timeout_s,
            restore_from=piece.restore_from,
            managed=True,
        )
        endpoint = str(ready.address)
        log.info("worker for lease %s on %s listens on %s", lease_id, piece.gpu_uuid, endpoint)
        return Worker(
            lease_id, piece.gpu_uuid, proc, endpoint, status_file,
            token=token, generation=piece.generation, memory_mib=piece.memory_mib,
        )  # fmt: skip

    def reports(self) -> list[WorkerReport]:
        with self._lock:
            workers = list(self.workers.values())
            failures = dict(self.failures)
        out = [w.report() for w in workers]
        out += [
            WorkerReport(lease_id=lease_id, gpu_uuid=uuid, alive=False, error=error, generation=gen)
            for (lease_id, uuid, gen), error in failures.items()
        ]
        return out

    def stop_all(self) -> None:
        with self._lock:
            workers = list(self.workers.values())
            self.workers.clear()
        for worker in workers:
            worker.stop()
