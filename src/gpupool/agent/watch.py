"""The watch of direct slices: find each GPU process's lease, and stop those that break it.

A direct program runs on this server under variables it may set again (CUDA_VISIBLE_DEVICES,
the MPS limits): the watch does not trust them. Several times a second it reads every GPU's
processes from the backend (NVML, MPS clients included), finds each one's lease through its
ancestry (the process `gpupool run` attached, see gpupool.protocol.v1.attach), and stops,
SIGTERM then SIGKILL after a short grace, each process that uses a GPU its lease does not
hold, that belongs to no lease, or whose lease's processes hold more memory than the slice.
Compute above the share is measured where NVML samples processes, and reported.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import psutil

from gpupool.agent.backends.base import Backend, GpuProcess
from gpupool.agent.direct import Finding, Reason, judge, raised_limits, slice_on
from gpupool.protocol.v1.api import DirectEvent, DirectEventKind, DirectLease
from gpupool.protocol.v1.attach import AttachRefused, token_sha256

log = logging.getLogger(__name__)
ENVIRON_SETTLE_S = 2.0
"""How long an empty start environment counts as not laid out yet (see _environ_words)."""

WATCH_INTERVAL_S = 0.25
"""How often every GPU's processes are read: with STOP_GRACE_S, a breach is over in < 2 s."""
STOP_GRACE_S = 1.0
"""Between SIGTERM and SIGKILL: time to exit cleanly, short enough to hold the 2 s promise."""
MAX_ROOTS_PER_LEASE = 64
MAX_ANCESTRY = 256
UNSEEN_POLLS = 4
"""A pid that the GPU lists but /proc does not show for this many readings in a row is
reported as one the agent cannot see (the agent in another pid namespace)."""
FORGET_STOPPED_S = 10.0
KEPT_EVENTS = 1000
COMMAND_CHARS = 256


class WatchMode(StrEnum):
    """`enforce` stops what breaks a lease; `report` only says so; `off` reads nothing."""

    ENFORCE = "enforce"
    REPORT = "report"
    OFF = "off"


@dataclass(frozen=True, slots=True)
class Root:
    """A process attached to a direct lease: it and all it starts belong to the lease. The
    creation time tells it from a later process that got the same pid."""

    pid: int
    create_time: float
    lease_id: str


@dataclass(slots=True)
class Stopping:
    proc: psutil.Process
    kill_at: float
    killed: bool = False


class DirectWatch:
    """The state of the watch; `poll` blocks (NVML, /proc): run it off the event loop.

    `exempt` gives the pids whose processes (and their descendants) are not tenants': the
    workers of remote leases and the MPS daemons this agent started."""

    def __init__(
        self,
        mode: WatchMode,
        exempt: Callable[[], set[int]],
        *,
        grace_s: float = STOP_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        roots_file: Path | None = None,
    ) -> None:
        self.mode = mode
        self.roots_file = roots_file
        """Where the attached processes are kept: an agent started again must not take every
        running direct program for one without a lease."""
        self.grace_s = grace_s
        self._exempt = exempt
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, DirectLease] | None = None
        self._roots: dict[int, Root] = {}
        self._stopping: dict[int, Stopping] = {}
        self._stopped_at: dict[int, float] = {}
        self._said: set[tuple[object, ...]] = set()
        self._over_share: set[tuple[str, str]] = set()
        self._unseen: Counter[int] = Counter()
        self.events: deque[DirectEvent] = deque(maxlen=KEPT_EVENTS)
        self.stopped: Counter[str] = Counter()
        """Processes stopped (or, reporting only, found) per reason, since the agent started."""
        self.reported: Counter[str] = Counter()
        self.usage: dict[tuple[str, str], tuple[int, float | None]] = {}
        """(lease, GPU) → (MiB its processes hold, % of SMs they use or None), last reading."""

    def restore(self) -> None:
        """Take over the attachments an earlier agent saved (blocks: reads the file)."""
        roots = self._load_roots()
        with self._lock:
            self._roots.update(roots)

    # ---- what the controller says --------------------------------------------------------

    def set_leases(self, leases: Mapping[str, DirectLease] | None) -> None:
        """The direct leases on this node (None: not known, so nothing is judged)."""
        with self._lock:
            self._leases = None if leases is None else dict(leases)
            if self._leases is not None:
                ended = [p for p, r in self._roots.items() if r.lease_id not in self._leases]
                for pid in ended:
                    del self._roots[pid]
                if ended:
                    self._save_roots()

    def knows(self, lease_id: str) -> bool:
        with self._lock:
            return self._leases is not None and lease_id in self._leases

    # ---- attaching -----------------------------------------------------------------------

    def attach(self, lease_id: str, token: str, pid: int) -> None:
        """Make `pid` (the kernel's word for who connected) a root of `lease_id`."""
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            raise AttachRefused(f"process {pid} is gone") from None
        digest = token_sha256(token)
        with self._lock:
            lease = (self._leases or {}).get(lease_id)
            if lease is None:
                raise AttachRefused(f"lease {lease_id} holds no direct slice on this node")
            if lease.token_sha256 is None or not _same(lease.token_sha256, digest):
                raise AttachRefused(f"wrong token for lease {lease_id}")
            root = self._roots.get(pid)
            if root is not None and root.create_time == created and root.lease_id != lease_id:
                raise AttachRefused(f"process {pid} is already attached to lease {root.lease_id}")
            mine = [r for r in self._roots.values() if r.lease_id == lease_id]
            if root is None and len(mine) >= MAX_ROOTS_PER_LEASE:
                raise AttachRefused(
                    f"lease {lease_id} has {MAX_ROOTS_PER_LEASE} attached processes already"
                )
            self._roots[pid] = Root(pid, created, lease_id)
            self._save_roots()
        log.info("process %d attached to direct lease %s", pid, lease_id)

    def roots(self) -> list[Root]:
        with self._lock:
            return list(self._roots.values())

    # ---- one reading ---------------------------------------------------------------------

    def poll(self, backend: Backend) -> list[DirectEvent]:
        """Read the GPUs' processes once, act on what breaks a lease; the events to tell."""
        if self.mode is WatchMode.OFF:
            return []
        self._finish_stops()
        with self._lock:
            leases = None if self._leases is None else dict(self._leases)
        if leases is None:
            return []
        processes = [p for p in backend.gpu_processes() if p.pid not in self._stopping]
        self._forget_dead_roots()
        events: list[DirectEvent] = []
        owners, unseen = self._attribute(processes)
        events += self._unattributable(unseen)
        judged = [p for p in processes if p.pid in owners]
        self._note_usage(judged, owners, leases)
        findings = judge(judged, owners, leases)
        over_now: set[tuple[str, str]] = set()
        for finding in findings:
            if finding.reason is Reason.COMPUTE_OVER_SHARE:
                assert finding.lease_id is not None
                over_now.add((finding.lease_id, finding.process.gpu_uuid))
                if (finding.lease_id, finding.process.gpu_uuid) not in self._over_share:
                    events.append(self._report(finding, "compute_over_share"))
            else:
                event = self._stop(finding, leases)
                if event is not None:
                    events.append(event)
        # An episode over the share ends when the lease's use is back within its share.
        self._over_share = over_now | {
            key for key in self._over_share if self._still_over(key, leases)
        }
        events += self._raised_limits(judged, owners, leases)
        # What was said about processes that left the GPUs is forgotten: the set stays as
        # small as the GPUs' process lists (keys are (what, pid, ...)).
        present = {p.pid for p in processes} | set(self._stopping)
        self._said = {key for key in self._said if key[1] in present}
        self.events.extend(events)
        return events

    def _attribute(
        self, processes: list[GpuProcess]
    ) -> tuple[dict[int, str | None], list[GpuProcess]]:
        """Each visible, non-exempt process's lease (None: none); and those /proc hides."""
        exempt = self._exempt()
        with self._lock:
            roots = dict(self._roots)
        owners: dict[int, str | None] = {}
        unseen: list[GpuProcess] = []
        seen_now: set[int] = set()
        for pid in sorted({p.pid for p in processes}):
            try:
                owner = _owner(pid, roots, exempt)
            except psutil.NoSuchProcess:
                if pid not in self._stopped_at:
                    unseen += [p for p in processes if p.pid == pid]
                continue
            except psutil.AccessDenied:
                unseen += [p for p in processes if p.pid == pid]
                continue
            seen_now.add(pid)
            if owner is not _EXEMPT:
                owners[pid] = owner if isinstance(owner, str) else None
        for pid in seen_now:
            self._unseen.pop(pid, None)
        return owners, unseen

    def _unattributable(self, unseen: list[GpuProcess]) -> list[DirectEvent]:
        events = []
        pids = {p.pid for p in unseen}
        for pid in list(self._unseen):
            if pid not in pids:
                del self._unseen[pid]
        for proc in unseen:
            self._unseen[proc.pid] += 1
            key = ("unseen", proc.pid, proc.gpu_uuid)
            if self._unseen[proc.pid] >= UNSEEN_POLLS and key not in self._said:
                self._said.add(key)
                self.reported["unattributable"] += 1
                events.append(
                    DirectEvent(
                        kind="process_unattributable",
                        reason="unattributable",
                        message=f"pid {proc.pid} uses {proc.gpu_uuid} but the agent cannot see "
                        "it in /proc (another pid namespace?): it can be neither placed in a "
                        "lease nor stopped",
                        gpu_uuid=proc.gpu_uuid,
                        pid=proc.pid,
                        used_memory_mib=proc.used_memory_mib,
                    )
                )
        return events

    def _stop(self, finding: Finding, leases: Mapping[str, DirectLease]) -> DirectEvent | None:
        proc = finding.process
        try:
            target = psutil.Process(proc.pid)
            command = _command(target)
        except psutil.Error:
            return None  # gone already
        extra = self._environ_words(target, finding.lease_id, proc.gpu_uuid, leases)
        detail = finding.detail + (f"; started with {', '.join(extra)}" if extra else "")
        kind: DirectEventKind
        if self.mode is WatchMode.ENFORCE:
            try:
                target.terminate()
            except psutil.NoSuchProcess:
                return None
            except psutil.AccessDenied:
                key = ("denied", proc.pid, proc.gpu_uuid, finding.reason.value)
                if key in self._said:
                    return None
                self._said.add(key)
                log.error("cannot stop pid %d (%s): permission denied", proc.pid, detail)
                kind, verb = "process_not_stopped", "could not stop (permission denied)"
            else:
                self._stopping[proc.pid] = Stopping(target, self._clock() + self.grace_s)
                kind, verb = "process_stopped", "stopped"
        else:
            key = ("violation", proc.pid, proc.gpu_uuid, finding.reason.value)
            if key in self._said:
                return None
            self._said.add(key)
            kind, verb = "process_not_stopped", "found (watch reports only)"
        self.stopped[finding.reason.value] += 1
        return _event(
            finding, kind, f"{verb} pid {proc.pid} ({command}): {detail}", command,
            used_memory_mib=_clip(finding.used_memory_mib or proc.used_memory_mib),
            limit_memory_mib=_clip(finding.limit_memory_mib),
        )  # fmt: skip

    def _report(self, finding: Finding, kind: DirectEventKind) -> DirectEvent:
        proc = finding.process
        try:
            command = _command(psutil.Process(proc.pid))
        except psutil.Error:
            command = ""
        self.reported[finding.reason.value] += 1
        return _event(
            finding, kind, f"pid {proc.pid} ({command}): {finding.detail}", command,
            compute_pct=finding.compute_pct, share_pct=finding.share_pct,
        )  # fmt: skip

    def _raised_limits(
        self,
        processes: list[GpuProcess],
        owners: Mapping[int, str | None],
        leases: Mapping[str, DirectLease],
    ) -> list[DirectEvent]:
        """Once per process: did it start with MPS or device variables beyond its lease?"""
        events = []
        for proc in processes:
            lease_id = owners.get(proc.pid)
            if lease_id is None or lease_id not in leases or proc.pid in self._stopping:
                continue
            try:
                target = psutil.Process(proc.pid)
                key = ("environ", proc.pid, target.create_time(), proc.gpu_uuid)
            except psutil.Error:
                continue
            if key in self._said:
                continue
            words = self._environ_words(target, lease_id, proc.gpu_uuid, leases)
            if words is None:
                continue  # exec'd a moment ago: its environment is not readable yet
            self._said.add(key)
            if not words:
                continue
            finding = Finding(
                Reason.RAISED_LIMITS,
                proc,
                lease_id,
                f"started with {', '.join(words)}: its slice's MPS limits do not hold for it; "
                "memory and GPUs are still watched",
            )
            events.append(self._report(finding, "limits_raised"))
        return events

    def _environ_words(
        self,
        target: psutil.Process,
        lease_id: str | None,
        gpu_uuid: str,
        leases: Mapping[str, DirectLease],
    ) -> list[str] | None:
        """What the process's start environment asks beyond its lease, or None to look again
        at the next poll: execve drops the old image (and tells the parent so) before it lays
        out the new environment, so a process caught in that instant reads as having none (a
        loaded machine showed it). An empty environment that lasts is judged as it is."""
        lease = leases.get(lease_id) if lease_id is not None else None
        if lease is None or slice_on(lease, gpu_uuid) is None:
            return []
        try:
            environ = target.environ()
            young = time.time() - target.create_time() < ENVIRON_SETTLE_S
        except psutil.Error:
            return []
        if not environ and young:
            return None
        return raised_limits(environ, lease, gpu_uuid)

    def _still_over(self, key: tuple[str, str], leases: Mapping[str, DirectLease]) -> bool:
        lease = leases.get(key[0])
        piece = slice_on(lease, key[1]) if lease is not None else None
        use = self.usage.get(key)
        if piece is None or use is None or use[1] is None:
            return False
        return use[1] > piece.compute_pct

    def _note_usage(
        self,
        processes: list[GpuProcess],
        owners: Mapping[int, str | None],
        leases: Mapping[str, DirectLease],
    ) -> None:
        usage: dict[tuple[str, str], tuple[int, float | None]] = {}
        for proc in processes:
            lease_id = owners.get(proc.pid)
            if lease_id is None or lease_id not in leases:
                continue
            key = (lease_id, proc.gpu_uuid)
            mib, pct = usage.get(key, (0, None))
            if proc.sm_util_pct is not None:
                pct = (pct or 0.0) + proc.sm_util_pct
            usage[key] = (mib + (proc.used_memory_mib or 0), pct)
        self.usage = usage

    def _finish_stops(self) -> None:
        """SIGKILL what outlived its grace; forget what ended."""
        now = self._clock()
        for pid, stop in list(self._stopping.items()):
            try:
                running = stop.proc.is_running() and stop.proc.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                running = False
            if not running:
                del self._stopping[pid]
                self._stopped_at[pid] = now
                continue
            if now >= stop.kill_at and not stop.killed:
                log.warning("pid %d outlived its %gs grace: killing it", pid, self.grace_s)
                with contextlib.suppress(psutil.Error):
                    stop.proc.kill()
                stop.killed = True
        for pid in [p for p, at in self._stopped_at.items() if now - at > FORGET_STOPPED_S]:
            del self._stopped_at[pid]

    def _forget_dead_roots(self) -> None:
        with self._lock:
            roots = list(self._roots.values())
        dead = [r.pid for r in roots if not _alive(r)]
        if dead:
            with self._lock:
                for pid in dead:
                    self._roots.pop(pid, None)
                self._save_roots()

    def _load_roots(self) -> dict[int, Root]:
        """The attached processes an earlier agent kept that still run (same creation time)."""
        if self.roots_file is None:
            return {}
        try:
            entries = json.loads(self.roots_file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.error("cannot read %s (%s): earlier attachments are lost", self.roots_file, exc)
            return {}
        roots: dict[int, Root] = {}
        for entry in entries if isinstance(entries, list) else []:
            try:
                root = Root(int(entry["pid"]), float(entry["create_time"]), str(entry["lease_id"]))
            except (KeyError, TypeError, ValueError):
                log.error("ignoring a malformed entry of %s: %r", self.roots_file, entry)
                continue
            if _alive(root):
                roots[root.pid] = root
        return roots

    def _save_roots(self) -> None:
        """Write the attached processes atomically; called with the lock held."""
        if self.roots_file is None:
            return
        entries = [asdict(r) for r in self._roots.values()]
        try:
            self.roots_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.roots_file.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(json.dumps(entries))
            os.replace(tmp, self.roots_file)
        except OSError as exc:
            log.error(
                "cannot save %s (%s): a restarted agent would not know them", self.roots_file, exc
            )


_EXEMPT = object()


def _owner(pid: int, roots: Mapping[int, Root], exempt: set[int]) -> object:
    """The lease id of `pid`'s nearest attached ancestor (itself included), _EXEMPT under an
    exempt process, None for neither. Raises psutil.NoSuchProcess / AccessDenied."""
    proc = psutil.Process(pid)
    chain = [proc]
    for parent in proc.parents()[:MAX_ANCESTRY]:
        chain.append(parent)
    for link in chain:
        if link.pid in exempt:
            return _EXEMPT
        root = roots.get(link.pid)
        if root is not None:
            try:
                if link.create_time() == root.create_time:
                    return root.lease_id
            except psutil.Error:
                continue
    return None


def _alive(root: Root) -> bool:
    try:
        created: float = psutil.Process(root.pid).create_time()
    except psutil.Error:
        return False
    return created == root.create_time


def _command(proc: psutil.Process) -> str:
    """A process's command line, printable and short: it is the tenant's text."""
    try:
        words = proc.cmdline()
    except psutil.AccessDenied:
        words = []
    text = " ".join(words) or proc.name()
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean[:COMMAND_CHARS]


def _clip(value: int | None) -> int | None:
    return None if value is None else max(0, min(value, 2**31 - 1))


def _same(a: str, b: str) -> bool:
    return bool(hmac.compare_digest(a.encode(), b.encode()))


def _event(
    finding: Finding, kind: DirectEventKind, message: str, command: str, **numbers: Any
) -> DirectEvent:
    """The event of one finding, logged as it is sent: stopped and reported ones alike."""
    log.warning("direct watch: %s", message)
    proc = finding.process
    return DirectEvent(
        kind=kind, reason=finding.reason.value, message=message[:500], gpu_uuid=proc.gpu_uuid,
        lease_id=finding.lease_id, pid=proc.pid, command=command, **numbers,
    )  # fmt: skip
