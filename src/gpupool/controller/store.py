"""The controller's state: the pool in memory, mirrored from the database it is loaded from.

Every change runs as a command on one writer thread, in a database transaction, and
commands that arrive together share one commit (group commit). The in-memory `Pool` is
changed only by those commands, so it always equals what the database holds; reads of
rows go to the database on other threads.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import Engine, event, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from gpupool.controller.models import GpuRow, LeaseRow, NodeRow, TenantRow
from gpupool.controller.settings import ControllerSettings
from gpupool.core import (
    HOLDING,
    Gpu,
    GpuMode,
    LeaseState,
    Pool,
    PoolError,
    QueuePolicy,
    Quota,
    Ratios,
    Slice,
)
from gpupool.core.migrate import hold_old_place
from gpupool.core.model import Access, Host, LeaseRequest, QueuedLease
from gpupool.core.placement import policy_named

log = logging.getLogger("gpupool.controller")

T = TypeVar("T")
Command = Callable[[Session], Any]

BATCH_MAX = 128

STALL_MIN_S = 2.0
STALL_INTERVALS = 4
"""The reconcile loop counts as stalled when it did not run for STALL_INTERVALS of its
intervals, and at least STALL_MIN_S: long enough that a busy loop or a collection pause does
not count, short enough that no holder's heartbeat can have been lost to it unseen."""


@dataclass(slots=True)
class Liveness:
    """Heartbeat times kept in memory; the database gets them in periodic batches."""

    lease_seen: dict[str, float] = field(default_factory=dict)
    node_seen: dict[str, float] = field(default_factory=dict)
    telemetry: dict[str, dict[str, Any]] = field(default_factory=dict)
    host: dict[str, dict[str, Any]] = field(default_factory=dict)
    dirty_leases: set[str] = field(default_factory=set)
    dirty_nodes: set[str] = field(default_factory=set)
    preempt_deadline: dict[str, float] = field(default_factory=dict)
    """Preempted leases → when they are released if their holder has not stopped."""
    lease_activity: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Remote leases → what their workers report: last op time, memory held."""


class Store:
    """Owns the pool, the writer thread and the reader threads."""

    def __init__(self, engine: Engine, settings: ControllerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.pool = new_pool(settings)
        self.lock = threading.RLock()
        self.live = Liveness()
        self._commands: queue.SimpleQueue[tuple[Command, Future[Any]] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="gpupool-writer", daemon=True)
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpupool-reader")
        self.started_at = time.time()
        # The writer's session lives across batches: rows of live leases, GPUs and nodes stay
        # in it (held by these dicts), so most commands touch the database only to write.
        self.session = self._new_session()
        self.lease_rows: dict[str, LeaseRow] = {}
        self.gpu_rows: dict[str, GpuRow] = {}
        self.node_rows: dict[str, NodeRow] = {}
        self.fence: Callable[[Session], None] | None = None
        """Run first in every write transaction; raising refuses the whole batch. High
        availability sets it so that a controller which lost the lead cannot write."""
        self.leading = True
        """False on an HA standby: it serves reads and runs no reconcile loop or webhook."""
        self.idle_timeouts: dict[str, float | None] = {}
        """Tenants → their remote leases' idle timeout (services/elastic.py)."""
        self.last_reconcile_mono: float | None = None
        """When the reconcile loop last ran (monotonic), to see that it stalled."""
        self.fault: str | None = None
        """The storage fault writes fail with now (None: writes work)."""
        self.stale_since: float | None = None
        """Since when (monotonic) the pool could not be rebuilt from the database."""
        self._flushed = False
        """Whether the batch being run wrote anything (a fault ends only with a real write)."""
        self.fatal: str | None = None
        """Why the store cannot go on; the process then exits non-zero (server.serve)."""
        self.on_fatal: Callable[[str], None] | None = None
        """Called (on the writer thread) when the store cannot go on: stops the server."""

    def _new_session(self) -> Session:
        session = Session(self.engine, expire_on_commit=False)
        event.listen(session, "after_flush", self._note_flush)
        return session

    def _note_flush(self, _session: Session, _context: Any) -> None:
        self._flushed = True

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self.load()
        self._writer.start()

    def stop(self) -> None:
        self._commands.put(None)
        self._writer.join(timeout=10)
        self._readers.shutdown(wait=True)
        self.session.close()

    # ---- rows the writer keeps ---------------------------------------------------------

    def lease_row(self, session: Session, lease_id: str) -> LeaseRow | None:
        row = self.lease_rows.get(lease_id)
        return row if row is not None else session.get(LeaseRow, lease_id)

    def gpu_row(self, session: Session, uuid: str) -> GpuRow | None:
        row = self.gpu_rows.get(uuid)
        return row if row is not None else session.get(GpuRow, uuid)

    def node_row(self, session: Session, name: str) -> NodeRow | None:
        row = self.node_rows.get(name)
        return row if row is not None else session.get(NodeRow, name)

    def load(self, forget_liveness: bool = False) -> None:
        """Rebuild the pool from the database: after a start, or after a failed commit.

        `forget_liveness` drops the heartbeat times held in memory, so every holder and
        node gets its grace again: what an HA controller needs when it takes the lead, as
        the times it kept as a standby were never updated by the heartbeats.
        """
        grace_start = time.time()
        self._flushed = False
        with self.lock:
            self.session.close()
            self.session = session = self._new_session()
            if forget_liveness:
                self.live = Liveness()
            pool = new_pool(self.settings)
            self.lease_rows, self.gpu_rows, self.node_rows = {}, {}, {}
            for tenant in session.scalars(select(TenantRow).where(TenantRow.deleted_at.is_(None))):
                pool.quotas[tenant.name] = quota_of(tenant)
                self.idle_timeouts[tenant.name] = tenant.idle_timeout_s
            for node in session.scalars(select(NodeRow)):
                pool.set_node_up(node.name, node.state == "up")
                pool.set_host(node.name, host_of(node))
                self.live.node_seen.setdefault(node.name, grace_start)
                self.node_rows[node.name] = node
            for row in session.scalars(select(GpuRow)):
                pool.upsert_gpu(gpu_of(row))
                self.gpu_rows[row.uuid] = row
            live_states = [s.value for s in LeaseState if s is not LeaseState.RELEASED]
            for lease in session.scalars(select(LeaseRow).where(LeaseRow.state.in_(live_states))):
                self.lease_rows[lease.id] = lease
                state = LeaseState(lease.state)
                if state in HOLDING or state is LeaseState.PREEMPTED:
                    pool.grant(
                        lease.id,
                        lease.tenant,
                        slices_of(lease),
                        lease.priority,
                        tuple((str(n), int(c), int(m)) for n, c, m in lease.host_charge or ()),
                    )
                    moving = (lease.elastic or {}).get("handoff") or {}
                    if moving.get("shadow"):
                        hold_old_place(
                            pool,
                            lease.id,
                            tuple(
                                Slice(p["gpu_uuid"], p["compute_pct"], p["memory_mib"])
                                for p in moving.get("from", [])
                            ),
                            slices_of(lease),
                        )
                    if state is LeaseState.PREEMPTED:
                        # Its holder was told; the grace period runs on from the stored end.
                        pool.preempting[lease.id] = lease.preempted_by or ""
                        deadline = lease.preempt_deadline_at
                        self.live.preempt_deadline[lease.id] = (
                            deadline.timestamp() if deadline is not None else grace_start
                        )
                elif state is LeaseState.QUEUED and lease.queue_seq is not None:
                    pool.restore_queued(
                        QueuedLease(
                            lease.id,
                            request_of(lease),
                            lease.queue_seq,
                            enqueued_at=lease.created_at.timestamp(),
                        )
                    )
                seen = max(lease.last_heartbeat_at.timestamp(), grace_start)
                self.live.lease_seen.setdefault(lease.id, seen)
            session.commit()
            self.pool = pool
            # What the loop missed before this load does not count as a stall: the load
            # itself gave every holder its grace.
            self.last_reconcile_mono = None

    def stall_s(self, now_mono: float) -> float | None:
        """How long the reconcile loop did not run, where that is a stall; else None.

        Called by each round of the loop, on the writer thread. The gap counts whatever kept
        the loop from running: the process stopped (SIGSTOP, a frozen VM), the event loop
        blocked, or the writer thread busy, since the round runs as a write.
        """
        last, self.last_reconcile_mono = self.last_reconcile_mono, now_mono
        if last is None:
            return None
        gap_s = now_mono - last
        expected_s = max(STALL_MIN_S, STALL_INTERVALS * self.settings.reconcile_interval_s)
        return gap_s if gap_s > expected_s else None

    def regrace(self) -> tuple[int, int]:
        """Give every holder and every node its timeout again from now, as a restart does.

        After a stall, heartbeats sent meanwhile could not be answered (or are still in
        the sockets' buffers); counting the stall against the holders would release every
        lease at once although each holder kept heartbeating. Preemption deadlines run on,
        as after a restart: a preempted holder was told to stop before the stall.
        Returns (leases, nodes) whose grace started again.
        """
        now = time.time()
        live = self.live
        leases = [lid for lid, seen in live.lease_seen.items() if seen < now]
        for lease_id in leases:
            live.lease_seen[lease_id] = now
        nodes = [name for name, seen in live.node_seen.items() if seen < now]
        for name in nodes:
            live.node_seen[name] = now
        for name in self.node_rows:
            live.node_seen.setdefault(name, now)
        return len(leases), len(nodes)

    # ---- commands --------------------------------------------------------------------

    async def write(self, command: Callable[[Session], T]) -> T:
        """Run `command` on the writer thread in a transaction; return after it committed."""
        future: Future[T] = Future()
        self._commands.put((command, future))
        return await asyncio.wrap_future(future)

    def write_sync(self, command: Callable[[Session], T]) -> T:
        future: Future[T] = Future()
        self._commands.put((command, future))
        return future.result()

    async def read(self, query: Callable[[Session], T]) -> T:
        def run() -> T:
            with Session(self.engine) as session:
                return query(session)

        return await asyncio.get_running_loop().run_in_executor(self._readers, run)

    def _write_loop(self) -> None:
        while True:
            item = self._commands.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < BATCH_MAX:
                try:
                    nxt = self._commands.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._commands.put(None)
                    break
                batch.append(nxt)
            if self.fatal is not None:
                # Stopping: every write is answered at once (none may wait for ever, the
                # shutdown's own included) and none runs on a pool that may be wrong.
                _fail_all(batch, StorageUnavailable(f"the controller is stopping: {self.fatal}"))
                continue
            try:
                self._run_batch(batch)
            except Exception as exc:
                # Nothing of a batch may end the writer thread unseen: every later write would
                # wait for ever. The controller says why and stops instead.
                self.fail_fatally(f"the writer thread failed: {exc!r}")
                _fail_all(batch, StorageUnavailable(f"the controller is stopping: {exc!r}"))

    def fail_fatally(self, reason: str) -> None:
        """The store cannot go on: say why, loudly, and have the process stop (non-zero)."""
        if self.fatal is not None:
            return
        self.fatal = reason
        log.critical("gpupool controller cannot go on: %s; stopping", reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _refused(self, session: Session, batch: list[tuple[Command, Future[Any]]]) -> bool:
        """Ask the fence; a refusal fails the batch before any command ran, so there is
        nothing to undo and nothing to reload."""
        if self.fence is None:
            return False
        try:
            self.fence(session)
        except Exception as exc:
            session.rollback()
            for _command, future in batch:
                future.set_exception(exc)
            return True
        return False

    def _recovered(self, batch: list[tuple[Command, Future[Any]]]) -> bool:
        """After a failed write whose reload failed too, rebuild the pool before any command
        runs on it (it may hold the failed batch's changes); refuse the batch while the
        database cannot be read. Past STALE_EXIT_S of that the controller stops."""
        if self.stale_since is None:
            return True
        try:
            self.load()
        except Exception as exc:
            stale_s = time.monotonic() - self.stale_since
            reason = storage_reason(exc)
            if stale_s > STALE_EXIT_S:
                self.fail_fatally(
                    f"the database could not be read for {stale_s:.0f} s ({reason}), so the "
                    "pool cannot be rebuilt from it"
                )
            _fail_all(batch, StorageUnavailable(refusal(reason)))
            return False
        log.warning("the database can be read again: pool rebuilt from it")
        self.stale_since = None
        return True

    def _run_batch(self, batch: list[tuple[Command, Future[Any]]]) -> None:
        if not self._recovered(batch):
            return
        outcomes: list[tuple[Future[Any], Any, BaseException | None]] = []
        self._flushed = False
        try:
            with self.lock:
                session = self.session
                if self._refused(session, batch):
                    return
                for command, future in batch:
                    try:
                        outcomes.append((future, command(session), None))
                    except PoolError as exc:
                        # Commands raise domain errors before they change anything.
                        outcomes.append((future, None, exc))
                session.commit()
        except Exception as exc:
            self._undo(batch, exc)
            return
        if self.fault is not None and self._flushed:
            log.warning("writes work again (after: %s)", self.fault)
            self.fault = None
        for future, result, error in outcomes:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

    def _undo(self, batch: list[tuple[Command, Future[Any]]], exc: Exception) -> None:
        """A batch failed (a storage fault, or a command's bug): nothing of it was committed,
        so the pool is rebuilt from the database and every caller is told.

        A storage fault (read-only or full disk, I/O error, database away) is answered with
        StorageUnavailable (503, the reason, nothing changed) and logged once when it
        begins, not once per batch; anything else is logged with its traceback.
        """
        is_fault = isinstance(exc, STORAGE_FAULTS)
        if not is_fault:
            log.exception("a write batch failed; reloading the pool from the database")
        elif self.fault is None:
            self.fault = storage_reason(exc)
            log.error(
                "the database refused a write (%s): writes are answered 503 until it takes "
                "them again; reads go on",
                self.fault,
            )
        try:
            self.session.rollback()
            self.load()
        except Exception as reload_exc:
            log.error(
                "the pool cannot be rebuilt from the database (%s): every write is refused "
                "until it can",
                storage_reason(reload_exc),
            )
            self.stale_since = time.monotonic()
        error: Exception = StorageUnavailable(refusal(storage_reason(exc))) if is_fault else exc
        _fail_all(batch, error)


class StorageUnavailable(PoolError):
    """The database cannot take (or give) the change now; nothing of it was committed."""

    code = "storage_unavailable"
    http_status = 503


STORAGE_FAULTS: tuple[type[Exception], ...] = (OperationalError, OSError)
"""What a database raises when its storage fails: SQLite's read-only, full or failing disk
(sqlite3.OperationalError, wrapped by SQLAlchemy), PostgreSQL gone or out of space."""

STALE_EXIT_S = 60.0
"""How long the controller may fail to read its database back before it stops."""


def storage_reason(exc: BaseException) -> str:
    """The driver's own words for a fault, without SQLAlchemy's statement and link."""
    original = getattr(exc, "orig", None) or exc
    text = str(original).strip().splitlines()[0] if str(original).strip() else repr(original)
    return text[:200]


def refusal(reason: str) -> str:
    return (
        f"the controller's database cannot take changes now ({reason}); nothing was changed. "
        "Try again once its storage works (the operator sees this in the controller's log)."
    )


def _fail_all(batch: list[tuple[Command, Future[Any]]], exc: BaseException) -> None:
    for _command, future in batch:
        if not future.done():
            future.set_exception(exc)


def new_pool(settings: ControllerSettings) -> Pool:
    """An empty pool with the scheduler the settings ask for."""
    return Pool(
        ratios=Ratios(settings.compute_ratio, settings.memory_ratio),
        policy=policy_named(settings.placement_policy),
        queue_policy=QueuePolicy(
            fair_share=settings.fair_share, max_wait_s=settings.max_queue_wait_s
        ),
        default_max_priority=settings.default_max_priority,
    )


def quota_of(row: TenantRow) -> Quota:
    return Quota(
        max_gpus=row.max_gpus,
        max_memory_mib=row.max_memory_mib,
        max_compute_pct=row.max_compute_pct,
        max_leases=row.max_leases,
        max_priority=row.max_priority,
        weight=row.weight,
        guaranteed_gpus=row.guaranteed_gpus or 0.0,
    )


def gpu_of(row: GpuRow) -> Gpu:
    return Gpu(
        uuid=row.uuid,
        node=row.node,
        model=row.model,
        memory_mib=row.memory_mib,
        index=row.index,
        mode=GpuMode(row.mode),
        target_mode=GpuMode(row.target_mode) if row.target_mode else None,
        healthy=row.healthy,
        simulated=row.simulated,
    )


def slices_of(row: LeaseRow) -> tuple[Slice, ...]:
    return tuple(Slice(s.gpu_uuid, s.compute_pct, s.memory_mib, s.whole) for s in row.slices)


def host_of(row: NodeRow) -> Host:
    """What a server offers direct leases besides its GPUs: all its cores and memory."""
    return Host(
        cpu_milli=None if row.cpu_count is None else row.cpu_count * 1000,
        memory_mib=row.memory_mib,
    )


def request_of(row: LeaseRow) -> LeaseRequest:
    return LeaseRequest(
        tenant=row.tenant,
        gpus=row.gpus,
        compute_pct=row.compute_pct or 100,
        memory_mib=row.memory_mib,
        physical=row.physical,
        priority=row.priority,
        access=Access(row.access),
        node=row.node,
        gpu_models=tuple(row.gpu_models or ()),
        span_nodes=row.span_nodes,
        prefer_node=row.prefer_node,
        max_wait_s=row.max_wait_s,
        cpu_milli=row.cpu_milli or 0,
        host_memory_mib=row.host_memory_mib or 0,
    )
