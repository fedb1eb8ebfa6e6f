"""One worker process per remote slice on this node, started and stopped as leases come and go.

The agent starts workers itself, with the lease's limits in their environment (the GPU, its
MPS daemon, the compute share and memory limit), so the tenant's program, which runs
elsewhere and only talks to the worker, cannot change them. That environment is an
allowlist (no token of the agent's), the worker's credentials come on its stdin, and an agent
running as root starts it as the worker user, in a memory cgroup of its own
(`gpupool.agent.isolation`). Each worker has a control secret of its own, which only its
agent knows: the lease's client token opens its client role and nothing else.

Workers outlive an agent that dies: they hold their clients' tensors, and the data plane
does not pass through the agent. The agent notes each worker in `workers.json` and, started
again, adopts those still running; those gone meanwhile are reported dead, which ends their
leases with that reason instead of starting an empty worker the client would not expect.

A new lease (not a move) takes a ready worker of its GPU where the agent keeps some
(`gpupool.agent.ready`): its cgroup gets the lease's limit, then the worker gets the lease,
its credentials and its limits on its stdin, and serves in milliseconds instead of seconds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import psutil

from gpupool.agent.isolation import (
    Cgroups,
    CgroupUnavailable,
    WorkerCgroup,
    WorkerUser,
    host_limit_bytes,
    worker_environment,
)
from gpupool.agent.mps import MpsSupervisor, client_env
from gpupool.agent.ready import ReadyPool, ReadyWorker
from gpupool.protocol.v1.api import RemoteLease, RemoteSlice, WorkerReport
from gpupool.protocol.v1.simgpu import SimulatedGpuMemory

if TYPE_CHECKING:
    from gpupool.protocol.v1.dataplane import WorkerCredentials

log = logging.getLogger("gpupool.agent.workers")

MIB = 1 << 20
STOP_GRACE_S = 10.0
REGISTRY = "workers.json"
LEDGERS = "simulated-gpus"
TLS_CERT, TLS_KEY = "tls.crt", "tls.key"
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
    control_token: str = ""
    """This worker's control secret: the agent's requests need it; the tenant never has it."""
    generation: int = 0
    memory_mib: int | None = None
    """The memory limit the worker runs with now (a resize changes it in place)."""
    swap_ordered: str | None = None
    """The reason of the swap-out the controller ordered and this agent passed on."""
    room_denied: int = 0
    """The last refused request for room this agent passed on."""
    peers_named: tuple[str | None, ...] | None = None
    """The lease's worker endpoints this agent last named to the worker."""
    cgroup: WorkerCgroup | None = None
    """The worker's memory cgroup (None: the agent could not make one)."""
    host_memory_mib: int = 0
    """The lease's host memory allowance (part of the cgroup's limit)."""
    directory: Path | None = None
    """A directory of this worker alone (one that was a ready worker), removed once it ended;
    None: it shares its lease's directory."""
    ready: bool = False
    """The worker was a ready worker, handed its lease (it did not start cold)."""
    asked_at: float | None = None
    """When this agent set out to start it (wall clock): the lease's grant reached the agent."""
    start_s: float | None = None
    """How long its start took, until it served (a hand-over: milliseconds; cold: seconds)."""

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
            # The worker's control secret: the agent's requests to an adopted worker need it
            # (the registry is readable by the agent's user only, never by the worker user).
            # The lease's client token is not kept: the agent never connects as the client.
            "control_token": self.control_token,
            "cgroup": None if self.cgroup is None else
            [str(self.cgroup.path), self.cgroup.version, self.cgroup.limit_bytes],
            "directory": None if self.directory is None else str(self.directory),
        }  # fmt: skip

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


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
        user: WorkerUser | None = None,
        cgroups: Cgroups | CgroupUnavailable | None = None,
        ready_per_gpu: int = 0,
    ) -> None:
        self.root = root
        self.user = user
        """Workers run as this user (None: as the agent's own)."""
        self.cgroups = cgroups if isinstance(cgroups, Cgroups) else None
        self.cgroup_problem: str | None = (
            str(cgroups) if isinstance(cgroups, CgroupUnavailable) else None
        )
        """Why workers have no memory cgroup of their own (None: they have, or none asked)."""
        self.room_timeout_s = room_timeout_s
        """How long a worker's allocation waits for room on its GPU (None: the worker's own)."""
        # The fake backend's GPUs have no driver to count their memory: a ledger per GPU,
        # shared by its workers, stands in for it (gpupool.protocol.v1.simgpu).
        self.ledgers = {
            uuid: SimulatedGpuMemory.create(root / LEDGERS / f"{uuid}.json", mib * MIB)
            for uuid, mib in (simulated_gpus or {}).items()
        }
        self.tls = tls
        """(certificate, key): remote clients then reach the workers over TLS only."""
        self.mps = mps
        if user is not None:
            mps.client = (user.uid, user.gid)  # all workers of a GPU: one user, as MPS wants
        self.simulated = simulated
        self.listen_host = listen_host
        self.workers: dict[Key, Worker] = {}
        self.failures: dict[Key, str] = {}
        # reconcile() runs in a thread of its own while heartbeats read reports().
        self._lock = threading.Lock()
        self._starting: set[int] = set()
        """Worker processes started but not ready yet (see pids())."""
        self._starting_by: dict[int, set[int]] = {}
        self._prepare_root()
        self._adopt()
        self.ready = ReadyPool(ready_per_gpu, self._start_ready, self._ready_usable)
        """Workers started ahead of their leases (`gpupool agent --ready-workers`)."""
        self._clear_ready_dirs()

    def _prepare_root(self) -> None:
        """The agent's directory: the registry and logs are the agent's alone; a worker user
        may only pass through it to its lease's directory (mode 711)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        os.chmod(self.logs, 0o700)
        if self.user is not None:
            os.chmod(self.root, 0o711)
            for ledger in self.ledgers.values():  # its workers claim their memory in it
                self.user.own(ledger.path, 0o600)
                os.chmod(ledger.path.parent, 0o711)

    @property
    def logs(self) -> Path:
        """Workers' stdout and stderr: in the agent's own directory, never one a worker owns
        (a worker could plant a link there for the agent to append to)."""
        return self.root / "logs"

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
                control_token = str(entry.get("control_token", ""))
                memory = entry.get("memory_mib")
                memory_mib = int(memory) if isinstance(memory, int) else None
                cgroup = _cgroup_of(entry.get("cgroup"))
                directory = Path(entry["directory"]) if entry.get("directory") else None
            except (KeyError, TypeError, ValueError):
                log.error("ignoring a malformed entry of %s: %r", self.registry, entry)
                continue
            proc = _running_worker(pid, created, key[0])
            if proc is None:
                log.warning(
                    "the worker of lease %s on %s is gone: %s", key[0], key[1], GONE_WHILE_AWAY
                )
                if cgroup is not None:
                    cgroup.remove()
                if directory is not None:
                    shutil.rmtree(directory, ignore_errors=True)
                self.failures[key] = GONE_WHILE_AWAY
                continue
            log.info(
                "adopted the worker of lease %s on %s (pid %d, %s)", key[0], key[1], pid, endpoint
            )
            self.workers[key] = Worker(
                key[0], key[1], proc, endpoint, status_file, proc.created_at,
                control_token=control_token, generation=key[2], memory_mib=memory_mib,
                cgroup=cgroup, directory=directory,
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
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds secrets
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(entries))
        os.replace(tmp, self.registry)

    def reconcile(self, leases: Mapping[str, RemoteLease]) -> bool:
        """Start and stop workers to match `leases`; True if a worker started, ended or
        failed (the controller should hear of it now, not at the next heartbeat)."""
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
            asked_at, began = time.time(), time.monotonic()
            try:
                started = self._start(key[0], lease, piece)
                started.asked_at, started.start_s = asked_at, time.monotonic() - began
            except Exception as exc:  # the reason goes to the controller, the loop goes on
                log.error("cannot start a worker for lease %s on %s: %s", key[0], key[1], exc)
                with self._lock:
                    self.failures[key] = str(exc)[:300]
                    self._starting.difference_update(self._started_by_me())
            else:
                with self._lock:
                    self.workers[key] = started
                    self._starting.difference_update(self._started_by_me())
            changed = True
        self._pass_orders(wanted)
        if changed or not self.registry.exists():
            self._save()
        return changed

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
            peers = tuple(lease.peers)
            if peers != worker.peers_named and self._control(
                worker, {"op": "peers", "endpoints": list(peers)}
            ):
                worker.peers_named = peers

    def _control(self, worker: Worker, body: dict[str, object]) -> bool:
        from gpupool.protocol.v1.dataplane import parse_address, send_control

        try:
            send_control(
                parse_address(worker.endpoint), worker.lease_id, worker.control_token, body
            )
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

        growing = worker.memory_mib is None or memory_mib > worker.memory_mib
        if growing:  # the host limit first, so the worker may use what it is given at once
            self._resize_cgroup(worker, memory_mib)
        try:
            send_control(
                parse_address(worker.endpoint),
                worker.lease_id,
                worker.control_token,
                {"op": "limits", "memory_limit_mib": memory_mib},
            )
        except Exception as exc:  # retried at the next reconcile
            log.warning("cannot resize the worker of lease %s: %s", worker.lease_id, exc)
            return
        log.info("lease %s: memory limit now %d MiB", worker.lease_id, memory_mib)
        worker.memory_mib = memory_mib
        if not growing:
            self._resize_cgroup(worker, memory_mib)

    def _resize_cgroup(self, worker: Worker, memory_mib: int) -> None:
        if worker.cgroup is None:
            return
        try:
            limit = host_limit_bytes(memory_mib, worker.host_memory_mib)
            worker.cgroup = worker.cgroup.set_limit(limit)
        except OSError as exc:  # v1 refuses a limit below what the group holds now
            log.warning("lease %s: the worker's host memory limit stays %d MiB: %s",
                        worker.lease_id, worker.cgroup.limit_bytes // MIB, exc)  # fmt: skip

    def _start(self, lease_id: str, lease: RemoteLease, piece: RemoteSlice) -> Worker:
        """The lease's worker on `piece`'s GPU: a ready worker handed the lease where one is
        (never for a move: a successor takes its state over as it starts), else a cold one."""
        from gpupool.protocol.v1.dataplane import WorkerStartFailed

        ready = (
            self.ready.take(piece.gpu_uuid, claim=lambda pid: self._placed(pid, None))
            if piece.restore_from is None
            else None
        )
        if ready is not None:
            try:
                return self._hand_over(ready, lease_id, lease, piece)
            except (WorkerStartFailed, OSError) as exc:  # the cold start below still serves it
                log.warning("the ready worker %d could not take lease %s (%s): starting one",
                            ready.pid, lease_id, exc)  # fmt: skip
                ready.discard()
        return self._start_cold(lease_id, lease, piece)

    def _credentials(self, lease: RemoteLease) -> WorkerCredentials:
        """The client token opens the client role only; the control secret is this worker's
        and the agent's; the peer secret is the lease's, from the controller, for its workers
        alone (a controller that sends none: peers and successors are refused)."""
        from gpupool.protocol.v1.dataplane import WorkerCredentials

        credentials = WorkerCredentials.generate(lease.token, lease.peer_secret)
        if not lease.peer_secret:
            credentials = WorkerCredentials(lease.token, credentials.control, "")
        return credentials

    def _hand_over(
        self, ready: ReadyWorker, lease_id: str, lease: RemoteLease, piece: RemoteSlice
    ) -> Worker:
        """Make a ready worker the lease's: its cgroup's limit first (the lease's size, before
        the worker may allocate for it), then the lease, credentials and limits on its stdin."""
        from gpupool.protocol.v1.dataplane import HANDOVER_ENV, Handover

        if ready.cgroup is not None:
            limit = host_limit_bytes(piece.memory_mib, lease.host_memory_mib)
            ready.cgroup = ready.cgroup.set_limit(limit)
        mps_env: dict[str, str] = {}
        if ready.mps_pipe is not None:
            pipe = Path(ready.mps_pipe)
            limits = client_env(pipe, pipe.parent / "log", piece.compute_pct, piece.memory_mib)
            mps_env = {k: v for k, v in limits.items() if k in HANDOVER_ENV}
        credentials = self._credentials(lease)
        status_name = f"{piece.gpu_index}.g{piece.generation}.status.json"
        handover = Handover(
            lease=lease_id,
            credentials=credentials,
            memory_limit_mib=piece.memory_mib,
            status_file=status_name,
            idle_timeout_s=lease.idle_timeout_s,
            mps_env=mps_env,
        )
        ready_line = ready.standby.hand_over(handover, log_file=ready.log_file)
        endpoint = str(ready_line.address)
        log.info("lease %s on %s: ready worker %d took it, on %s",
                 lease_id, piece.gpu_uuid, ready.pid, endpoint)  # fmt: skip
        return Worker(
            lease_id, piece.gpu_uuid, ready.standby.proc, endpoint,
            ready.directory / status_name, ready.created_at,
            control_token=credentials.control, generation=piece.generation,
            memory_mib=piece.memory_mib, cgroup=ready.cgroup,
            host_memory_mib=lease.host_memory_mib, directory=ready.directory, ready=True,
        )  # fmt: skip

    def _start_ready(self, gpu_uuid: str) -> ReadyWorker:
        """A ready worker for `gpu_uuid`: the process, environment, user and cgroup of a
        cold worker, without anything of a lease (the ready pool's thread calls this)."""
        from gpupool.protocol.v1.dataplane import start_standby_worker

        name = f"ready.{secrets.token_hex(4)}"
        directory = self._ready_dir(name)
        extra: dict[str, str] = {}
        pipe: str | None = None
        if self.simulated:
            device = "cpu"
        else:
            device = "cuda:0"
            extra["CUDA_VISIBLE_DEVICES"] = gpu_uuid
            pipe = self.mps.pipe_dir(gpu_uuid)
            if pipe is not None:  # the share comes with the hand-over: see gpupool.agent.ready
                extra["CUDA_MPS_PIPE_DIRECTORY"] = pipe
                extra["CUDA_MPS_LOG_DIRECTORY"] = str(Path(pipe).parent / "log")
        env = worker_environment(os.environ, directory, extra)
        tls = self._tls_for(directory)
        cgroup = self._cgroup(name, host_limit_bytes(0))
        log_file = self._log_file(name)
        try:
            standby = start_standby_worker(
                env=env,
                log_file=log_file,
                user=self.user.uid if self.user else None,
                group=self.user.gid if self.user else None,
                cwd=directory,
                placed=lambda pid: self._placed_ready(pid, cgroup),
                device=device,
                listen=f"tcp://{self.listen_host}:0",
                tls_cert=tls[0] if tls else None,
                tls_key=tls[1] if tls else None,
                managed=True,
                room_timeout_s=self.room_timeout_s,
                simulated_gpu=Path("..", "..", LEDGERS, f"{gpu_uuid}.json")
                if gpu_uuid in self.ledgers
                else None,
                context_ahead=device != "cpu" and pipe is None,
            )
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            shutil.rmtree(directory, ignore_errors=True)
            raise
        finally:
            with self._lock:
                self._starting.difference_update(self._started_by_me())
        try:
            created_at: float | None = psutil.Process(standby.pid).create_time()
        except psutil.NoSuchProcess:
            created_at = None
        log.info("ready worker %d for %s listens on %s", standby.pid, gpu_uuid, standby.address)
        return ReadyWorker(gpu_uuid, standby, directory, log_file, cgroup, pipe, created_at)

    def _placed_ready(self, pid: int, cgroup: WorkerCgroup | None) -> None:
        self.ready.starting(pid)
        self._placed(pid, cgroup)

    def _ready_usable(self, ready: ReadyWorker) -> bool:
        """A ready worker may take a lease while its GPU's MPS daemon is the one it knows."""
        return self.simulated or ready.mps_pipe == self.mps.pipe_dir(ready.gpu_uuid)

    def _ready_dir(self, name: str) -> Path:
        """A ready worker's own directory under `ready/` (the worker user's, mode 700)."""
        base = self.root / "ready"
        base.mkdir(exist_ok=True)
        directory = base / name
        directory.mkdir()
        if self.user is not None:
            os.chmod(base, 0o711)
            self.user.own(directory, 0o700)
        return directory

    def _clear_ready_dirs(self) -> None:
        """Ready workers end with their agent: what an earlier agent's left is removed (the
        directories of handed-over workers adopted just now stay)."""
        base = self.root / "ready"
        kept = {w.directory for w in self.workers.values() if w.directory is not None}
        with contextlib.suppress(FileNotFoundError):
            for path in base.iterdir():
                if path not in kept:
                    shutil.rmtree(path, ignore_errors=True)

    def _start_cold(self, lease_id: str, lease: RemoteLease, piece: RemoteSlice) -> Worker:
        from gpupool.protocol.v1.dataplane import start_worker_process

        directory = self._lease_dir(lease_id)
        name = f"{_safe(lease_id)}.{piece.gpu_index}.g{piece.generation}"
        status_file = directory / f"{piece.gpu_index}.g{piece.generation}.status.json"
        extra: dict[str, str] = {}
        if self.simulated:
            device = "cpu"
        else:
            device = "cuda:0"
            extra["CUDA_VISIBLE_DEVICES"] = piece.gpu_uuid
            pipe = self.mps.pipe_dir(piece.gpu_uuid)
            if pipe is not None:
                extra.update(
                    client_env(
                        Path(pipe), Path(pipe).parent / "log", piece.compute_pct, piece.memory_mib
                    )
                )
        env = worker_environment(os.environ, directory, extra)
        credentials = self._credentials(lease)
        tls = self._tls_for(directory)
        cgroup = self._cgroup(name, host_limit_bytes(piece.memory_mib, lease.host_memory_mib))
        try:
            proc, ready = start_worker_process(
                lease_id,
                credentials,
                env=env,
                log_file=self._log_file(name),
                user=self.user.uid if self.user else None,
                group=self.user.gid if self.user else None,
                cwd=directory,
                placed=lambda pid: self._placed(pid, cgroup),
                device=device,
                listen=f"tcp://{self.listen_host}:0",
                memory_limit_mib=piece.memory_mib,
                # Paths relative to the worker's directory, where it starts: the worker user
                # need not be able to reach the agent's data dir from /, only to be in it.
                status_file=Path(status_file.name),
                tls_cert=tls[0] if tls else None,
                tls_key=tls[1] if tls else None,
                idle_timeout_s=lease.idle_timeout_s,
                restore_from=piece.restore_from,
                managed=True,
                room_timeout_s=self.room_timeout_s,
                simulated_gpu=Path("..", LEDGERS, f"{piece.gpu_uuid}.json")
                if piece.gpu_uuid in self.ledgers
                else None,
            )
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            raise
        endpoint = str(ready.address)
        log.info("worker for lease %s on %s listens on %s", lease_id, piece.gpu_uuid, endpoint)
        try:
            created_at: float | None = psutil.Process(proc.pid).create_time()
        except psutil.NoSuchProcess:  # died already: reported dead at the next heartbeat
            created_at = None
        return Worker(
            lease_id, piece.gpu_uuid, proc, endpoint, status_file, created_at,
            control_token=credentials.control, generation=piece.generation,
            memory_mib=piece.memory_mib, cgroup=cgroup, host_memory_mib=lease.host_memory_mib,
        )  # fmt: skip

    def _lease_dir(self, lease_id: str) -> Path:
        """The lease's workers' own directory (their HOME, status files): the worker user's,
        mode 700, so neither another user's process nor the tenant's reads it."""
        directory = self.root / _safe(lease_id)
        directory.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            self.user.own(directory, 0o700)
        return directory

    def _tls_for(self, directory: Path) -> tuple[Path, Path] | None:
        """The workers' certificate and key where the worker user can read them: a copy in
        its directory (every worker serves TLS with that key, so it holds it anyway)."""
        if self.tls is None:
            return None
        if self.user is None:
            return self.tls
        copies = (Path(TLS_CERT), Path(TLS_KEY))
        for source, name in zip(self.tls, copies, strict=True):
            target = directory / name
            tmp = target.with_name(target.name + ".tmp")
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(source.read_bytes())
            self.user.own(tmp, 0o600)
            os.replace(tmp, target)
        return copies

    def _log_file(self, name: str) -> Path:
        path = self.logs / f"{name}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        return path

    def _cgroup(self, name: str, limit_bytes: int) -> WorkerCgroup | None:
        if self.cgroups is None:
            return None
        try:
            return self.cgroups.make(name, limit_bytes)
        except CgroupUnavailable as exc:
            self.cgroup_problem = str(exc)
            log.warning("the worker %s runs without a memory cgroup: %s", name, exc)
            return None

    def confinement(self) -> dict[str, str | None]:
        """How this node's workers are confined, for `gpupool nodes` (host facts): their user,
        and their memory cgroups or why they have none."""
        if self.cgroups is not None:
            cgroups = f"v{self.cgroups.version} under {self.cgroups.base}"
        else:
            cgroups = f"none: {self.cgroup_problem or 'not asked for'}"
        return {
            "worker_user": self.user.name if self.user is not None else None,
            "worker_cgroups": cgroups,
        }

    def ready_facts(self) -> dict[str, object]:
        """The ready pool for `gpupool nodes` (host facts): workers ready now, how many the
        agent keeps, per GPU, and why the last one failed to start, if it did."""
        counts = self.ready.counts()
        return {
            "ready_workers": sum(counts.values()),
            "ready_workers_wanted": self.ready.wanted,
            "ready_workers_per_gpu": self.ready.per_gpu,
            "ready_workers_problem": self.ready.problem,
        }

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

    def starts(self) -> list[dict[str, object]]:
        """How each running worker started, for the agent's status API: when the agent began,
        how long it took, and whether a ready worker took the lease."""
        with self._lock:
            workers = list(self.workers.values())
        return [
            {"lease_id": w.lease_id, "gpu_uuid": w.gpu_uuid, "generation": w.generation,
             "pid": w.proc.pid, "ready": w.ready, "asked_at": w.asked_at,
             "start_s": None if w.start_s is None else round(w.start_s, 4)}
            for w in workers
        ]  # fmt: skip

    def pids(self) -> set[int]:
        """The workers' processes: on a real GPU they hold contexts, and are not tenants'.
        Workers still starting count: a worker's CUDA context exists before its ready line,
        and the direct-slice watch stopped one as an unknown GPU process in that window."""
        ready = self.ready.pids()  # first: a worker taken meanwhile is in _starting below
        with self._lock:
            pids = {w.proc.pid for w in self.workers.values()} | set(self._starting)
        return pids | ready

    def _placed(self, pid: int, cgroup: WorkerCgroup | None) -> None:
        """A worker process exists (not yet ready): it is the agent's from now on."""
        with self._lock:
            self._starting.add(pid)
            self._starting_by.setdefault(threading.get_ident(), set()).add(pid)
        if cgroup is not None:
            cgroup.attach(pid)

    def _started_by_me(self) -> set[int]:
        """The pids this thread's start placed (the caller holds the lock)."""
        return self._starting_by.pop(threading.get_ident(), set())

    def stop_all(self) -> None:
        """Stop every worker (the agent is shutting down). The registry keeps them, so the
        next agent reports them gone and their leases end with that reason."""
        self.ready.stop()
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.stop()


def _safe(name: str) -> str:
    """A lease id or name as one path component (ids come from the controller: still checked)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64].lstrip(".") or "_"


def _cgroup_of(entry: object) -> WorkerCgroup | None:
    """A registry entry's cgroup: [path, version, limit] (None: the worker had none)."""
    if entry is None:
        return None
    if not isinstance(entry, list) or len(entry) != 3:
        raise ValueError(f"cgroup entry {entry!r}")
    path, version, limit = entry
    if not isinstance(path, str) or version not in (1, 2) or not isinstance(limit, int):
        raise ValueError(f"cgroup entry {entry!r}")
    return WorkerCgroup(Path(path), int(version), int(limit))


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
