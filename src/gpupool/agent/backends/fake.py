"""Simulated GPUs for tests and demos, with faults that can be injected on demand.

SIMULATED GPU processes: nothing runs on a simulated GPU, so a real process says that it
"uses" one by holding open a file `<process_dir>/<gpu uuid>/<its pid>` whose content is the
MiB it pretends to hold (`SimulatedGpuUse` writes it). The backend reports such a process,
as NVML would a real one, only while that very process has the file open: the kernel's fd
table, which only the process itself changes, is the proof, so nobody can make another
process appear on a GPU (and be stopped by the agent's watch) by writing a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from gpupool.agent.backends.base import GpuEvent, GpuProcess, xid_event
from gpupool.protocol.v1.api import GpuInventory, GpuTelemetry

MAX_GPUS_PER_NODE = 64
MAX_MEMORY_GB = 1024
_ITEM = re.compile(r"^(\d+)\s*[xX]\s*([A-Za-z0-9][A-Za-z0-9._-]*)-(\d+)\s*GB$", re.IGNORECASE)
_SPEC_HELP = "write COUNTxMODEL-MEMORYGB items separated by commas, e.g. '4xH100-80GB'"

IDLE_TEMPERATURE_C = 32.0
IDLE_POWER_W = 60.0
BUSY_POWER_W = 600.0
IDLE_SM_CLOCK_MHZ = 345
BUSY_SM_CLOCK_MHZ = 1980
MEM_CLOCK_MHZ = 2619
MAX_USE_FILE_BYTES = 256
MAX_FDS_CHECKED = 4096
"""A process with more descriptors than this is not searched for its use file (and so not
reported): the agent's watch must not stall on one process."""


@dataclass(frozen=True, slots=True)
class FakeGpuSpec:
    """One item of a spec string: `count` GPUs of `model` with `memory_gb` of memory each."""

    count: int
    model: str
    memory_gb: int

    @property
    def memory_mib(self) -> int:
        # "80GB" on a GPU's box means 80 GiB of device memory (an H100 80GB has 81559 MiB
        # usable), so the simulated card gets the round binary figure.
        return self.memory_gb * 1024


def parse_spec(spec: str) -> list[FakeGpuSpec]:
    """Read `2xA100-40GB,1xH100-80GB`; any mistake is a ValueError of one line."""
    items = [item.strip() for item in spec.split(",")]
    if not spec.strip() or any(not item for item in items):
        raise ValueError(f"fake GPU spec {spec!r} has an empty item: {_SPEC_HELP}")
    parsed: list[FakeGpuSpec] = []
    for item in items:
        match = _ITEM.match(item)
        if match is None:
            raise ValueError(f"cannot read fake GPU spec item {item!r}: {_SPEC_HELP}")
        count, model, memory_gb = int(match.group(1)), match.group(2), int(match.group(3))
        if not 1 <= count <= MAX_GPUS_PER_NODE:
            raise ValueError(
                f"fake GPU spec item {item!r}: count must be 1..{MAX_GPUS_PER_NODE}, got {count}"
            )
        if not 1 <= memory_gb <= MAX_MEMORY_GB:
            raise ValueError(
                f"fake GPU spec item {item!r}: memory must be 1..{MAX_MEMORY_GB}GB, "
                f"got {memory_gb}GB"
            )
        parsed.append(FakeGpuSpec(count=count, model=model, memory_gb=memory_gb))
    total = sum(p.count for p in parsed)
    if total > MAX_GPUS_PER_NODE:
        raise ValueError(
            f"fake GPU spec {spec!r} has {total} GPUs; one node holds at most {MAX_GPUS_PER_NODE}"
        )
    return parsed


@dataclass(slots=True)
class FakeGpu:
    """The simulated state of one GPU: what telemetry reports and what faults it carries."""

    inventory: GpuInventory
    utilization_pct: float = 0.0
    memory_used_mib: int = 0
    ecc_uncorrected: int = 0
    overheat_c: float | None = None
    lost: bool = False
    processes: list[dict[str, int]] = field(default_factory=list)

    def telemetry(self) -> GpuTelemetry:
        if self.lost:
            # A GPU off the bus answers nothing: the controller sees a uuid and no readings.
            return GpuTelemetry(uuid=self.inventory.uuid)
        busy = self.utilization_pct / 100.0
        return GpuTelemetry(
            uuid=self.inventory.uuid,
            utilization_pct=self.utilization_pct,
            memory_used_mib=self.memory_used_mib,
            temperature_c=(
                self.overheat_c
                if self.overheat_c is not None
                else round(IDLE_TEMPERATURE_C + 40.0 * busy, 1)
            ),
            power_w=round(IDLE_POWER_W + (BUSY_POWER_W - IDLE_POWER_W) * busy, 1),
            ecc_uncorrected=self.ecc_uncorrected,
            ecc_corrected=0,
            sm_clock_mhz=BUSY_SM_CLOCK_MHZ if busy > 0 else IDLE_SM_CLOCK_MHZ,
            mem_clock_mhz=MEM_CLOCK_MHZ,
            processes=[dict(p) for p in self.processes],
        )


class FakeBackend:
    """GPUs that exist only in this process; faults injected here show up as real ones would."""

    name = "fake"
    simulated = True

    def __init__(self, gpus: list[GpuInventory], process_dir: Path | None = None) -> None:
        self._gpus = [FakeGpu(inventory=gpu) for gpu in gpus]
        self.process_dir = process_dir
        """Where real processes declare their simulated use of a GPU (module docstring)."""
        if process_dir is not None:
            _open_process_dir(process_dir, [gpu.uuid for gpu in gpus])
        self._events: list[GpuEvent] = []
        # poll_events runs in a worker thread while faults are injected from another.
        self._changed = threading.Condition()

    @classmethod
    def from_spec(
        cls, spec: str, node_name: str | None = None, process_dir: Path | None = None
    ) -> FakeBackend:
        node = node_name if node_name is not None else socket.gethostname()
        gpus: list[GpuInventory] = []
        for item in parse_spec(spec):
            for _ in range(item.count):
                index = len(gpus)
                gpus.append(
                    GpuInventory(
                        uuid=f"GPU-sim-{node}-{index}",
                        index=index,
                        model=f"NVIDIA {item.model}-{item.memory_gb}GB (simulated)",
                        memory_mib=item.memory_mib,
                        pci_bus_id=f"00000000:{0x10 + index:02X}:00.0",
                        mig_mode=False,
                        simulated=True,
                    )
                )
        return cls(gpus, process_dir)

    # ---- Backend ------------------------------------------------------------------------

    def inventory(self) -> list[GpuInventory]:
        with self._changed:
            return [gpu.inventory for gpu in self._gpus]

    def telemetry(self) -> list[GpuTelemetry]:
        with self._changed:
            return [gpu.telemetry() for gpu in self._gpus]

    def driver_version(self) -> str | None:
        return "simulated"

    def cuda_version(self) -> str | None:
        return None

    def poll_events(self, timeout_ms: int) -> list[GpuEvent]:
        with self._changed:
            if not self._events and timeout_ms > 0:
                self._changed.wait(timeout_ms / 1000.0)
            events, self._events = self._events, []
            return events

    def close(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def gpu_processes(self) -> list[GpuProcess]:
        """The processes set with set_processes, and the real processes that hold a use file
        (module docstring); both SIMULATED uses of simulated GPUs."""
        with self._changed:
            out = [
                GpuProcess(
                    gpu.inventory.uuid,
                    int(p["pid"]),
                    p.get("used_memory_mib"),
                    float(p["sm_util_pct"]) if "sm_util_pct" in p else None,
                )
                for gpu in self._gpus
                for p in gpu.processes
            ]
            uuids = [gpu.inventory.uuid for gpu in self._gpus]
        if self.process_dir is not None:
            listed = {(p.gpu_uuid, p.pid) for p in out}
            out += [
                p
                for p in _declared_uses(self.process_dir, uuids)
                if (p.gpu_uuid, p.pid) not in listed
            ]
        return out

    # ---- settings of the simulation -----------------------------------------------------

    def set_utilization(self, index: int, pct: float) -> None:
        if not 0.0 <= pct <= 100.0:
            raise ValueError(f"utilisation must be 0..100 %, got {pct}")
        with self._changed:
            self._gpu(index).utilization_pct = pct

    def set_memory_used(self, index: int, mib: int) -> None:
        with self._changed:
            gpu = self._gpu(index)
            if not 0 <= mib <= gpu.inventory.memory_mib:
                raise ValueError(
                    f"memory used must be 0..{gpu.inventory.memory_mib} MiB, got {mib}"
                )
            gpu.memory_used_mib = mib

    def set_processes(self, index: int, processes: list[dict[str, int]]) -> None:
        """Compute processes as NVML lists them: `{"pid": ..., "used_memory_mib": ...}`, with
        `"sm_util_pct"` where a test wants per-process SM use."""
        with self._changed:
            self._gpu(index).processes = [dict(p) for p in processes]

    # ---- fault injection ----------------------------------------------------------------

    def inject_xid(self, index: int, code: int) -> GpuEvent:
        with self._changed:
            gpu = self._gpu(index)
            event = xid_event(gpu.inventory.uuid, code)
            if event.kind == "lost":
                gpu.lost = True
            return self._emit(event)

    def inject_ecc(self, index: int) -> GpuEvent:
        """One more uncorrectable (double-bit) ECC error, counted as NVML's volatile counter."""
        with self._changed:
            gpu = self._gpu(index)
            gpu.ecc_uncorrected += 1
            return self._emit(
                GpuEvent(
                    gpu_uuid=gpu.inventory.uuid,
                    kind="ecc_uncorrected",
                    value=gpu.ecc_uncorrected,
                    message=f"uncorrectable ECC error ({gpu.ecc_uncorrected} since boot)",
                )
            )

    def inject_overheat(self, index: int, temp_c: float) -> GpuEvent:
        with self._changed:
            gpu = self._gpu(index)
            gpu.overheat_c = temp_c
            return self._emit(
                GpuEvent(
                    gpu_uuid=gpu.inventory.uuid,
                    kind="temperature",
                    value=temp_c,
                    message=f"temperature {temp_c:g} C is above the slowdown threshold",
                )
            )

    def inject_lost(self, index: int) -> GpuEvent:
        with self._changed:
            gpu = self._gpu(index)
            gpu.lost = True
            return self._emit(
                GpuEvent(
                    gpu_uuid=gpu.inventory.uuid,
                    kind="lost",
                    value=None,
                    message="GPU is lost (no longer answers; needs a reset)",
                )
            )

    def clear_faults(self, index: int) -> None:
        """Back to healthy, as after a GPU reset: counters and overheating cleared."""
        with self._changed:
            gpu = self._gpu(index)
            gpu.ecc_uncorrected = 0
            gpu.overheat_c = None
            gpu.lost = False

    # ---- inside -------------------------------------------------------------------------

    def _gpu(self, index: int) -> FakeGpu:
        if not 0 <= index < len(self._gpus):
            raise IndexError(f"no simulated GPU {index}: this node has {len(self._gpus)}")
        return self._gpus[index]

    def _emit(self, event: GpuEvent) -> GpuEvent:
        # Called with the condition held.
        self._events.append(event)
        self._changed.notify_all()
        return event


# ---- simulated use of a GPU by a real process ------------------------------------------------


def _open_process_dir(root: Path, uuids: list[str]) -> None:
    """One directory per GPU, writable by every local user (sticky, as /tmp): any tenant's
    program may pretend to use a simulated GPU, none may touch another's file."""
    for directory in [root, *(root / uuid for uuid in uuids)]:
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o1777)


def _declared_uses(root: Path, uuids: list[str]) -> list[GpuProcess]:
    out: list[GpuProcess] = []
    for uuid in uuids:
        try:
            names = os.listdir(root / uuid)
        except OSError:
            continue
        for name in names:
            if not name.isdigit() or len(name) > 10:
                continue
            path = root / uuid / name
            pid = int(name)
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            if not _holds_open(pid, st.st_dev, st.st_ino):
                continue
            used = _read_use(path)
            if used is not None:
                out.append(GpuProcess(uuid, pid, used[0], used[1]))
    return out


def _holds_open(pid: int, dev: int, ino: int) -> bool:
    """Whether process `pid` has the file (dev, ino) open: its proof that it uses the GPU."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    if len(fds) > MAX_FDS_CHECKED:
        return False
    for fd in fds:
        try:
            st = os.stat(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (dev, ino):
            return True
    return False


def _read_use(path: Path) -> tuple[int, float | None] | None:
    """`{"used_memory_mib": N, "sm_util_pct": X}` from a use file; None when unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        raw = os.read(fd, MAX_USE_FILE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > MAX_USE_FILE_BYTES:
        return None
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    used, sm = data.get("used_memory_mib", 0), data.get("sm_util_pct")
    if isinstance(used, bool) or not isinstance(used, int) or not 0 <= used < 2**31:
        return None
    if sm is not None and (isinstance(sm, bool) or not isinstance(sm, int | float)):
        return None
    if sm is not None and not 0 <= sm <= 100:
        return None
    return used, None if sm is None else float(sm)


class SimulatedGpuUse:
    """A real process's pretended use of a simulated GPU (module docstring): held while the
    object is open, changed with `set()`. SIMULATED: it allocates nothing anywhere."""

    def __init__(self, process_dir: Path | str, gpu_uuid: str, used_memory_mib: int = 0) -> None:
        self.path = Path(process_dir) / gpu_uuid / str(os.getpid())
        self._file: IO[str] | None = open(self.path, "w")  # noqa: SIM115 (held open on purpose)
        self.set(used_memory_mib)

    def set(self, used_memory_mib: int, sm_util_pct: float | None = None) -> None:
        assert self._file is not None, "closed"
        body: dict[str, float] = {"used_memory_mib": used_memory_mib}
        if sm_util_pct is not None:
            body["sm_util_pct"] = sm_util_pct
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps(body))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            with contextlib.suppress(OSError):
                self.path.unlink()

    def __enter__(self) -> SimulatedGpuUse:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
