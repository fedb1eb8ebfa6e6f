"""One worker process per remote slice on this node, started and stopped as leases come and go.

The agent starts workers itself, with the lease's limits in their environment (the GPU, its
MPS daemon, the compute share and memory limit), so the tenant's program, which runs
elsewhere and only talks to the worker, cannot change them.

Workers outlive an agent that dies: they hold their clients' tensors, and the data plane
does not pass through the agent. The agent notes each worker in `workers.json` and, started
again, adopts those still running; those gone meanwhile are reported dead, which ends their
leases with that reason instead of starting an empty worker the client would not expect.
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
from typing import Protocol

import psutil

from gpupool.agent.mps import MpsSupervisor, client_env
from gpupool.protocol.v1.api import RemoteLease, RemoteSlice, WorkerReport
from gpupool.protocol.v1.simgpu import SimulatedGpuMemory

log = logging.getLogger("gpupool.agent.workers")

MIB = 1 << 20
STOP_GRACE_S = 10.0
REGISTRY = "workers.json"
GONE_WHILE_AWAY = "worker exited while the agent was not running"


class WorkerProcess(Protocol):
    """What the supervisor needs of a worker process: a child it started (subprocess.Popen),
    or one a previous agent started and this one adopted (AdoptedProcess)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class AdoptedProcess:
    """A worker started by an earlier agent: not our child, so watched through psutil (its
    creation time guards against a recycled pid). Its exit status is not ours to read."""

    def __init__(self, proc: psutil.Process) -> None:
        self.pid = proc.pid
        self.created_at: float = proc.create_time()
        self._proc = proc
        self._gone = False

    @property
    def returncode(self) -> int | None:
        return None

    def poll(self) -> int | None:
        if not self._gone:
            try:
                self._gone = self._proc.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                self._gone = True
        return -1 if self._gone else None

    def terminate(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self._proc.terminate()

    def kill(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self._proc.kill()

    def wait(self, timeout: float | None = None) -> int:
        try:
            self._proc.wait(timeout)
        except psutil.TimeoutExpired:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0) from None
        except psutil.NoSuchProcess:
            pass
        self._gone = True
        return -1


Key = tuple[str, str, int]
"""(lease, GPU uuid, generation): a move starts generation n+1 beside generation n."""


@dataclass
class Worker:
    lease_id: str
    gpu_uuid: str
    proc: WorkerProcess
    endpoint: str
    status_file: Path
    created_at: float | None = None
    """The process's creation time: with the pid, what tells this worker from a process that
    got its pid later."""
    token: str = ""
    generation: int = 0
    memory_mib: int | None = None
    """The memory limit the worker runs with now (a resize changes it in place)."""
    swap_ordered: str | None = None
    """The reason of the swap-out the controller ordered and this agent passed on."""
    room_denied: int = 0
    """The last refused request for room this agent passed on."""

    def report(self) -> WorkerReport:
        alive = self.proc.poll() is None
        activity: dict[str, object] = {}
        with contextlib.suppress(OSError, ValueError):
            activity = json.loads(self.status_file.read_text())
        last_op = activity.get("last_op_at")
        held = activity.get("memory_held_bytes")
        moved_to = activity.get("moved_to")
        room_seq = activity.get("room_seq")
        wanted = activity.get("room_wanted_bytes")
        return WorkerReport(
            generation=self.generation,
            swapped=activity.get("swapped") is True,
            wants_gpu=activity.get("wants_gpu") is True,
            adopted=activity.get("adopted") is True,
            moved_to=moved_to if isinstance(moved_to, str) else None,
            room_seq=room_seq if isinstance(room_seq, int) else 0,
            room_wanted_mib=-(-wanted // (1024 * 1024)) if isinstance(wanted, int) else 0,
            lease_id=self.lease_id,
            gpu_uuid=self.gpu_uuid,
            endpoint=self.endpoint if alive else None,
            alive=alive,
            last_op_at=float(last_op) if isinstance(last_op, int | float) else None,
            memory_mib=int(held) // (1024 * 1024) if isinstance(held, int) else None,
            error=None if alive else self._exit_text(),
        )

    def _exit_text(self) -> str:
        from gpupool.protocol.v1.dataplane import WORKER_EXIT_DEVICE_BROKEN

        code = self.proc.returncode
        if code is None:
            return "worker exited (it was started by an earlier agent: its status is unknown)"
        if code < 0:
            return f"worker killed by signal {-code}"
        if code == WORKER_EXIT_DEVICE_BROKEN:
            return (
                "worker ended: the client's error left the GPU context unusable "
                "(a sticky CUDA error, as a device-side assert)"
            )
        return f"worker exited with {code}"

    def record(self) -> dict[str, object]:
        """This worker's line in the registry: enough to find the same process again."""
        return {
            "lease_id": self.lease_id,
            "gpu_uuid": self.gpu_uuid,
            "pid": self.proc.pid,
            "create_time": self.created_at,
            "endpoint": self.endpoint,
            "status_file": str(self.status_file),
            "generation": self.generation,
            "memory_mib": self.memory_mib,
            # The lease's data-plane token: the agent's control requests to an adopted worker
            # need it (the registry is readable by the agent's user only).
            "token": self.token,
        }

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
        self,
        root: Path,
        mps: MpsSupervisor,
        simulated: bool,
        listen_host: str = "127.0.0.1",
        tls: tuple[Path, Path] | None = None,
        simulated_gpus: Mapping[str, int] | None = None,
        room_timeout_s: float | None = None,
    ) -> None:
        self.root = root
        self.room_timeout_s = room_timeout_s
        """How long a worker's allocation waits for room on its GPU (None: the worker's own)."""
        # The fake backend's GPUs have no driver to count their memory: a ledger per GPU,
        # shared by its workers, stands in for it (gpupool.protocol.v1.simgpu).
        self.ledgers = {
            uuid: SimulatedGpuMemory.create(root / "simulated-gpus" / f"{uuid}.json", mib * MIB)
            for uuid, mib in (simulated_gpus or {}).items()
        }
        self.tls = tls
        """(certificate, key): remote clients then reach the workers over TLS only."""
        self.mps = mps
        self.simulated = simulated
        self.listen_host = listen_host
        self.workers: dict[Key, Worker] = {}
        self.failures: dict[Key, str] = {}
        # reconcile() runs in a thread of its own while heartbeats read reports().
        self._lock = threading.Lock()
        self._adopt()

    # ---- the registry: what survives the agent ------------------------------------------

    @property
    def registry(self) -> Path:
        return self.root / REGISTRY

    def _adopt(self) -> None:
        """Take back the workers an earlier agent left running; note those that are gone."""
        try:
            entries = json.loads(self.registry.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.error("cannot read %s (%s): earlier workers are not adopted", self.registry, exc)
            return
        for entry in entries if isinstance(entries, list) else []:
            try:
                key = (
                    str(entry["lease_id"]),
                    str(entry["gpu_uuid"]),
                    int(entry.get("generation", 0)),
                )
                pid, created = int(entry["pid"]), entry.get("create_time")
                endpoint, status_file = str(entry["endpoint"]), Path(entry["status_file"])
                token = str(entry.get("token", ""))
                memory = entry.get("memory_mib")
                memory_mib = int(memory) if isinstance(memory, int) else None
            except (KeyError, TypeError, ValueError):
                log.error("ignoring a malformed entry of %s: %r", self.registry, entry)
                continue
            proc = _running_worker(pid, created, key[0])
            if proc is None:
                log.warning(
                    "the worker of lease %s on %s is gone: %s", key[0], key[1], GONE_WHILE_AWAY
                )
                self.failures[key] = GONE_WHILE_AWAY
                continue
            log.info(
                "adopted the worker of lease %s on %s (pid %d, %s)", key[0], key[1], pid, endpoint
            )
            self.workers[key] = Worker(
                key[0], key[1], proc, endpoint, status_file, proc.created_at,
                token=token, generation=key[2], memory_mib=memory_mib,
            )  # fmt: skip

    def _save(self) -> None:
        """Write the registry atomically (a crash mid-write must not lose it); failures stay
        in it until their lease ends, so an agent started again still reports them."""
        with self._lock:
            entries = [w.record() for w in self.workers.values()]
            entries += [
                dict(
                    lease_id=lid,
                    gpu_uuid=uuid,
                    generation=gen,
                    pid=0,
                    create_time=None,
                    endpoint="",
                    status_file="",
                )
                for (lid, uuid, gen) in self.failures
            ]
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.registry.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds lease tokens
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(entries))
        os.replace(tmp, self.registry)

    def reconcile(self, leases: Mapping[str, RemoteLease]) -> None:
        wanted = {
            (lease_id, piece.gpu_uuid, piece.generation): (lease, piece)
            for lease_id, lease in leases.items()
            for piece in lease.slices
        }
        with self._lock:
            ended = {key: self.workers[key] for key in set(self.workers) - set(wanted)}
            forgotten = set(self.failures) - set(wanted)
            for key in forgotten:
                del self.failures[key]
        for worker in ended.values():
            log.info("lease %s ended: stopping its worker on %s", worker.lease_id, worker.gpu_uuid)
            worker.stop()
        # Reported until gone: the controller keeps a returning node out of placement while
        # a worker of an ended lease still holds part of its GPU.
        with self._lock:
            for key in ended:
                self.workers.pop(key, None)
        if ended:
            self._forget_in_ledgers()
        changed = bool(ended or forgotten)
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
            changed = True
        self._pass_orders(wanted)
        if changed or not self.registry.exists():
            self._save()

    def _pass_orders(self, wanted: Mapping[Key, tuple[RemoteLease, RemoteSlice]]) -> None:
        """The controller's answers to oversubscription: swap-outs it ordered, and requests for
        room it found nobody to give way for. Each is sent once (both are idempotent anyway)."""
        for key, (lease, piece) in wanted.items():
            worker = self.workers.get(key)
            if worker is None:
                continue
            ordered = lease.swap_reason
            if ordered != worker.swap_ordered and (
                ordered is None or self._control(worker, {"op": "swap"})
            ):
                worker.swap_ordered = ordered
            denied = piece.room_denied_seq or 0
            if denied > worker.room_denied and self._control(
                worker, {"op": "room", "denied_seq": denied}
            ):
                worker.room_denied = denied

    def _control(self, worker: Worker, body: dict[str, object]) -> bool:
        from gpupool.protocol.v1.dataplane import parse_address, send_control

        try:
            send_control(parse_address(worker.endpoint), worker.lease_id, worker.token, body)
        except Exception as exc:  # retried at the next reconcile
            log.warning("cannot send %s to the worker of lease %s: %s", body, worker.lease_id, exc)
            return False
        log.info("lease %s on %s: %s", worker.lease_id, worker.gpu_uuid, body)
        return True

    def _forget_in_ledgers(self) -> None:
        """What stopped workers held on a simulated GPU is free again."""
        with self._lock:
            pids = {uuid: [str(w.proc.pid) for w in self.workers.values() if w.gpu_uuid == uuid]
                    for uuid in self.ledgers}  # fmt: skip
        for uuid, ledger in self.ledgers.items():
            try:
                ledger.prune(pids[uuid])
            except OSError as exc:
                log.error("cannot update the simulated memory of %s: %s", uuid, exc)

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
            tls_cert=self.tls[0] if self.tls else None,
            tls_key=self.tls[1] if self.tls else None,
            idle_timeout_s=lease.idle_timeout_s,
            restore_from=piece.restore_from,
            managed=True,
            room_timeout_s=self.room_timeout_s,
            simulated_gpu=self.ledgers[piece.gpu_uuid].path
            if piece.gpu_uuid in self.ledgers
            else None,
        )
        endpoint = str(ready.address)
        log.info("worker for lease %s on %s listens on %s", lease_id, piece.gpu_uuid, endpoint)
        try:
            created_at: float | None = psutil.Process(proc.pid).create_time()
        except psutil.NoSuchProcess:  # died already: reported dead at the next heartbeat
            created_at = None
        return Worker(
            lease_id, piece.gpu_uuid, proc, endpoint, status_file, created_at,
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

    def pids(self) -> set[int]:
        """The workers' processes: on a real GPU they hold contexts, and are not tenants'."""
        with self._lock:
            return {w.proc.pid for w in self.workers.values()}

    def stop_all(self) -> None:
        """Stop every worker (the agent is shutting down). The registry keeps them, so the
        next agent reports them gone and their leases end with that reason."""
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.stop()


def _running_worker(pid: int, created: object, lease_id: str) -> AdoptedProcess | None:
    """The process `pid` if it is still the worker of `lease_id` an earlier agent started."""
    if pid <= 0:
        return None
    try:
        proc = psutil.Process(pid)
        if isinstance(created, int | float) and abs(proc.create_time() - created) > 0.05:
            return None  # the pid was recycled
        cmdline = proc.cmdline()
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        if "gpupool.worker" not in cmdline or lease_id not in cmdline:
            return None
        return AdoptedProcess(proc)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
