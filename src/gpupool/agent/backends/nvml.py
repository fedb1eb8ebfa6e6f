"""Real NVIDIA GPUs through NVML, with every call recordable to a JSON fixture and replayable."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeAlias, TypeVar

from gpupool.agent.backends.base import EventKind, GpuEvent, GpuProcess, xid_event
from gpupool.protocol.v1.api import GpuInventory, GpuTelemetry

log = logging.getLogger(__name__)
T = TypeVar("T")

Json: TypeAlias = bool | int | float | str | list["Json"] | dict[str, "Json"] | None
FIXTURE_FORMAT = "gpupool-nvml-fixture/1"
MIB = 1024 * 1024

# NVML return codes (nvml.h) that change what the backend does; mirrored here so that
# replaying a fixture needs no NVML library at all.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15
FIXTURE_MISSING = -1

# Event types (nvmlEventType*) the agent watches.
EVENT_DOUBLE_BIT_ECC = 0x0000000000000002
EVENT_XID_CRITICAL = 0x0000000000000008
EVENT_GPU_UNAVAILABLE = 0x0000000000004000
WATCHED_EVENTS = EVENT_DOUBLE_BIT_ECC | EVENT_XID_CRITICAL | EVENT_GPU_UNAVAILABLE

# A GPU that crossed its slowdown threshold counts as cool again only this far below it, so
# that a card hovering at the threshold does not raise an event every heartbeat.
TEMPERATURE_HYSTERESIS_C = 5
MAX_EVENTS_PER_POLL = 64
SAMPLE_WINDOW_US = 2_000_000
"""How far back a reading of per-process utilisation looks (NVML samples every ~1/6 s)."""

EccKind = Literal["corrected", "uncorrected"]
ClockKind = Literal["sm", "mem"]


class NvmlError(Exception):
    """An NVML call failed; `code` is NVML's return code (negative: a fixture problem)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class NvmlNotSupported(NvmlError):
    """This GPU or driver does not offer the reading: report it as unknown, not as a fault."""


class NvmlTimeout(NvmlError):
    """No event arrived within the wait."""


class NvmlGpuLost(NvmlError):
    """The GPU stopped answering (fell off the bus): only a reset brings it back."""


def nvml_error(code: int, message: str) -> NvmlError:
    kinds: dict[int, type[NvmlError]] = {
        NVML_ERROR_NOT_SUPPORTED: NvmlNotSupported,
        NVML_ERROR_TIMEOUT: NvmlTimeout,
        NVML_ERROR_GPU_IS_LOST: NvmlGpuLost,
    }
    return kinds.get(code, NvmlError)(code, message)


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    total_bytes: int
    used_bytes: int


@dataclass(frozen=True, slots=True)
class Utilization:
    gpu_pct: int
    memory_pct: int


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    pid: int
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """NVML's per-process utilisation sample: the share of SMs a process used lately."""

    pid: int
    timestamp_us: int
    sm_util_pct: int


@dataclass(frozen=True, slots=True)
class NvmlEvent:
    index: int
    event_type: int
    data: int


# ---- the one door to NVML -----------------------------------------------------------------


class NvmlApi:
    """Every NVML call the backend makes, each answering plain JSON through one `call()`.

    Subclasses decide where answers come from (the library, a recording, a fixture); the
    typed methods here turn the JSON back into values, so all three behave the same.
    """

    def call(self, method: str, *args: int | str) -> Json:
        raise NotImplementedError

    def init(self) -> None:
        self.call("init")

    def shutdown(self) -> None:
        self.call("shutdown")

    def device_count(self) -> int:
        return _int(self.call("device_count"), "device_count")

    def driver_version(self) -> str:
        return _str(self.call("driver_version"), "driver_version")

    def cuda_driver_version(self) -> int:
        return _int(self.call("cuda_driver_version"), "cuda_driver_version")

    def uuid(self, index: int) -> str:
        return _str(self.call("uuid", index), "uuid")

    def name(self, index: int) -> str:
        return _str(self.call("name", index), "name")

    def memory_info(self, index: int) -> MemoryInfo:
        value = _dict(self.call("memory_info", index), "memory_info")
        return MemoryInfo(
            total_bytes=_int(value.get("total"), "memory_info.total"),
            used_bytes=_int(value.get("used"), "memory_info.used"),
        )

    def pci_bus_id(self, index: int) -> str:
        return _str(self.call("pci_bus_id", index), "pci_bus_id")

    def mig_mode(self, index: int) -> int:
        """The current MIG mode (1: enabled)."""
        return _int(self.call("mig_mode", index), "mig_mode")

    def utilization(self, index: int) -> Utilization:
        value = _dict(self.call("utilization", index), "utilization")
        return Utilization(
            gpu_pct=_int(value.get("gpu"), "utilization.gpu"),
            memory_pct=_int(value.get("memory"), "utilization.memory"),
        )

    def temperature_c(self, index: int) -> int:
        return _int(self.call("temperature_c", index), "temperature_c")

    def temperature_slowdown_c(self, index: int) -> int:
        return _int(self.call("temperature_slowdown_c", index), "temperature_slowdown_c")

    def power_mw(self, index: int) -> int:
        return _int(self.call("power_mw", index), "power_mw")

    def ecc_errors(self, index: int, kind: EccKind) -> int:
        """Volatile (since the last driver load) ECC error count."""
        return _int(self.call("ecc_errors", index, kind), "ecc_errors")

    def clock_mhz(self, index: int, clock: ClockKind) -> int:
        return _int(self.call("clock_mhz", index, clock), "clock_mhz")

    def compute_processes(self, index: int) -> list[ProcessInfo]:
        return self._processes("compute_processes", index)

    def mps_compute_processes(self, index: int) -> list[ProcessInfo]:
        """The MPS clients of a GPU (nvmlDeviceGetMPSComputeRunningProcesses): under MPS the
        plain list may show only the MPS server, which holds the clients' contexts."""
        return self._processes("mps_compute_processes", index)

    def process_utilization(self, index: int, since_us: int) -> list[ProcessSample]:
        """Per-process samples newer than `since_us` (nvmlDeviceGetProcessUtilization)."""
        rows = self.call("process_utilization", index, since_us)
        if not isinstance(rows, list):
            raise _malformed("process_utilization", rows)
        out: list[ProcessSample] = []
        for row in rows:
            fields = _dict(row, "process_utilization[]")
            out.append(
                ProcessSample(
                    pid=_int(fields.get("pid"), "process_utilization[].pid"),
                    timestamp_us=_int(fields.get("timestamp_us"), "process_utilization[].ts"),
                    sm_util_pct=_int(fields.get("sm_util_pct"), "process_utilization[].sm"),
                )
            )
        return out

    def _processes(self, method: str, index: int) -> list[ProcessInfo]:
        rows = self.call(method, index)
        if not isinstance(rows, list):
            raise _malformed(method, rows)
        out: list[ProcessInfo] = []
        for row in rows:
            fields = _dict(row, f"{method}[]")
            used = fields.get("used_bytes")
            out.append(
                ProcessInfo(
                    pid=_int(fields.get("pid"), f"{method}[].pid"),
                    used_bytes=None if used is None else _int(used, "used_bytes"),
                )
            )
        return out

    def wait_event(self, timeout_ms: int) -> NvmlEvent | None:
        """The next event of any GPU, or None when none came within `timeout_ms`."""
        try:
            value = _dict(self.call("wait_event", timeout_ms), "wait_event")
        except NvmlTimeout:
            return None
        return NvmlEvent(
            index=_int(value.get("index"), "wait_event.index"),
            event_type=_int(value.get("type"), "wait_event.type"),
            data=_int(value.get("data"), "wait_event.data"),
        )


def _malformed(what: str, value: object) -> NvmlError:
    return NvmlError(FIXTURE_MISSING, f"NVML answer for {what} is malformed: {value!r}")


def _int(value: Json, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _malformed(what, value)
    return value


def _str(value: Json, what: str) -> str:
    if not isinstance(value, str):
        raise _malformed(what, value)
    return value


def _dict(value: Json, what: str) -> dict[str, Json]:
    if not isinstance(value, dict):
        raise _malformed(what, value)
    return value


def _text(value: Any) -> str:
    # pynvml returns bytes or str depending on the function and its version.
    return value.decode() if isinstance(value, bytes) else str(value)


class PynvmlApi(NvmlApi):
    """The real library (nvidia-ml-py). Imported here, so the agent runs without it too."""

    def __init__(self) -> None:
        import pynvml

        self._nvml: Any = pynvml
        self._handles: dict[int, Any] = {}
        self._event_set: Any = None
        self._event_lock = threading.Lock()
        self._calls: dict[str, Callable[..., Json]] = {
            "init": self._init,
            "shutdown": self._shutdown,
            "device_count": lambda: int(pynvml.nvmlDeviceGetCount()),
            "driver_version": lambda: _text(pynvml.nvmlSystemGetDriverVersion()),
            "cuda_driver_version": lambda: int(pynvml.nvmlSystemGetCudaDriverVersion()),
            "uuid": lambda i: _text(pynvml.nvmlDeviceGetUUID(self._handle(i))),
            "name": lambda i: _text(pynvml.nvmlDeviceGetName(self._handle(i))),
            "memory_info": self._memory_info,
            "pci_bus_id": lambda i: _text(pynvml.nvmlDeviceGetPciInfo(self._handle(i)).busId),
            "mig_mode": lambda i: int(pynvml.nvmlDeviceGetMigMode(self._handle(i))[0]),
            "utilization": self._utilization,
            "temperature_c": lambda i: int(
                pynvml.nvmlDeviceGetTemperature(self._handle(i), pynvml.NVML_TEMPERATURE_GPU)
            ),
            "temperature_slowdown_c": lambda i: int(
                pynvml.nvmlDeviceGetTemperatureThreshold(
                    self._handle(i), pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
                )
            ),
            "power_mw": lambda i: int(pynvml.nvmlDeviceGetPowerUsage(self._handle(i))),
            "ecc_errors": self._ecc_errors,
            "clock_mhz": self._clock_mhz,
            "compute_processes": self._compute_processes,
            "mps_compute_processes": self._mps_compute_processes,
            "process_utilization": self._process_utilization,
            "wait_event": self._wait_event,
        }

    def call(self, method: str, *args: int | str) -> Json:
        try:
            return self._calls[method](*args)
        except self._nvml.NVMLError as exc:
            raise nvml_error(int(exc.value), f"{method}{list(args)}: {exc}") from exc

    def _init(self) -> None:
        self._nvml.nvmlInit()

    def _shutdown(self) -> None:
        with self._event_lock:
            if self._event_set is not None:
                self._nvml.nvmlEventSetFree(self._event_set)
                self._event_set = None
        self._handles.clear()
        self._nvml.nvmlShutdown()

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._nvml.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]

    def _memory_info(self, index: int) -> Json:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle(index))
        return {"total": int(info.total), "used": int(info.used)}

    def _utilization(self, index: int) -> Json:
        rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle(index))
        return {"gpu": int(rates.gpu), "memory": int(rates.memory)}

    def _ecc_errors(self, index: int, kind: str) -> Json:
        nvml = self._nvml
        error_type = (
            nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
            if kind == "corrected"
            else nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        )
        handle = self._handle(index)
        return int(nvml.nvmlDeviceGetTotalEccErrors(handle, error_type, nvml.NVML_VOLATILE_ECC))

    def _clock_mhz(self, index: int, clock: str) -> Json:
        nvml = self._nvml
        kind = nvml.NVML_CLOCK_SM if clock == "sm" else nvml.NVML_CLOCK_MEM
        return int(nvml.nvmlDeviceGetClockInfo(self._handle(index), kind))

    def _compute_processes(self, index: int) -> Json:
        return _process_rows(self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle(index)))

    def _mps_compute_processes(self, index: int) -> Json:
        listing = getattr(self._nvml, "nvmlDeviceGetMPSComputeRunningProcesses", None)
        if listing is None:  # a nvidia-ml-py older than the call
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED, "nvmlDeviceGetMPSComputeRunningProcesses")
        return _process_rows(listing(self._handle(index)))

    def _process_utilization(self, index: int, since_us: int) -> Json:
        try:
            samples = self._nvml.nvmlDeviceGetProcessUtilization(self._handle(index), since_us)
        except self._nvml.NVMLError as exc:
            if int(exc.value) == NVML_ERROR_NOT_FOUND:
                return []  # no process ran on the GPU since `since_us`: no samples
            raise
        return [
            {
                "pid": int(s.pid),
                "timestamp_us": int(s.timeStamp),
                "sm_util_pct": int(s.smUtil),
            }
            for s in samples
        ]

    def _wait_event(self, timeout_ms: int) -> Json:
        event_set = self._events()
        data = self._nvml.nvmlEventSetWait(event_set, timeout_ms)
        return {
            "index": int(self._nvml.nvmlDeviceGetIndex(data.device)),
            "type": int(data.eventType),
            "data": int(data.eventData),
        }

    def _events(self) -> Any:
        """The event set, made on first use with every GPU registered for what it supports."""
        nvml = self._nvml
        with self._event_lock:
            if self._event_set is not None:
                return self._event_set
            event_set = nvml.nvmlEventSetCreate()
            for index in range(int(nvml.nvmlDeviceGetCount())):
                handle = self._handle(index)
                try:
                    mask = int(nvml.nvmlDeviceGetSupportedEventTypes(handle)) & WATCHED_EVENTS
                    if mask:
                        nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
                except nvml.NVMLError as exc:
                    # One GPU without events (a vGPU, say) must not blind the others.
                    log.info("GPU %d gives no NVML events: %s", index, exc)
            self._event_set = event_set
            return event_set


def _process_rows(processes: Any) -> Json:
    rows: list[Json] = []
    for proc in processes:
        # pynvml gives None for NVML_VALUE_NOT_AVAILABLE.
        used = proc.usedGpuMemory
        rows.append({"pid": int(proc.pid), "used_bytes": None if used is None else int(used)})
    return rows


def _key(method: str, args: tuple[int | str, ...]) -> str:
    return method + ":" + ",".join(str(a) for a in args)


class RecordingNvml(NvmlApi):
    """Passes calls to another NvmlApi and keeps every answer, to be saved as a fixture."""

    def __init__(self, inner: NvmlApi) -> None:
        self.inner = inner
        self.calls: dict[str, Json] = {}
        self.events: list[Json] = []

    def call(self, method: str, *args: int | str) -> Json:
        if method in ("init", "shutdown"):
            return self.inner.call(method, *args)
        try:
            value = self.inner.call(method, *args)
        except NvmlTimeout:
            raise
        except NvmlError as exc:
            self.calls[_key(method, args)] = {"error": exc.code, "message": exc.message}
            raise
        if method == "wait_event":
            self.events.append(value)
        else:
            self.calls[_key(method, args)] = {"value": value}
        return value

    def fixture(self, source: str, note: str = "") -> dict[str, Json]:
        return {
            "format": FIXTURE_FORMAT,
            "source": source,
            "note": note,
            "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "calls": dict(sorted(self.calls.items())),
            "events": list(self.events),
        }


class ReplayNvml(NvmlApi):
    """Answers from a fixture: the same answer for a call every time, events once each in order."""

    def __init__(self, fixture: dict[str, Json]) -> None:
        if fixture.get("format") != FIXTURE_FORMAT:
            raise ValueError(f"not a {FIXTURE_FORMAT} fixture (format={fixture.get('format')!r})")
        self.source = str(fixture.get("source", ""))
        self._calls = _dict(fixture.get("calls", {}), "fixture calls")
        events = fixture.get("events", [])
        if not isinstance(events, list):
            raise ValueError("fixture events must be a list")
        self._events = list(events)
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path) -> ReplayNvml:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a fixture is a JSON object")
        return cls(data)

    def call(self, method: str, *args: int | str) -> Json:
        if method in ("init", "shutdown"):
            return None
        if method == "wait_event":
            return self._next_event(int(args[0]) if args else 0)
        key = _key(method, args)
        if key not in self._calls:
            raise NvmlError(FIXTURE_MISSING, f"NVML call {key} is not in the fixture")
        entry = _dict(self._calls[key], key)
        if "error" in entry:
            raise nvml_error(_int(entry["error"], key), str(entry.get("message", "")))
        return entry.get("value")

    def _next_event(self, timeout_ms: int) -> Json:
        with self._lock:
            if self._events:
                return self._events.pop(0)
        # Like the real wait, so that a polling loop over a replay does not spin.
        time.sleep(timeout_ms / 1000.0)
        raise NvmlTimeout(NVML_ERROR_TIMEOUT, "timeout waiting for an event")


# ---- the backend --------------------------------------------------------------------------


def format_cuda_version(version: int) -> str:
    """NVML's 13000 → "13.0", 12040 → "12.4" (major * 1000 + minor * 10)."""
    return f"{version // 1000}.{version % 1000 // 10}"


class NvmlBackend:
    """The GPUs NVML sees on this host."""

    name = "nvml"
    simulated = False

    def __init__(self, api: NvmlApi | None = None) -> None:
        self.api: NvmlApi = api if api is not None else PynvmlApi()
        self.api.init()
        try:
            self.device_count = self.api.device_count()
        except NvmlError:
            self.api.shutdown()
            raise
        self._uuids: dict[int, str] = {}
        self._known: dict[int, GpuInventory] = {}
        self._slowdown_c: dict[int, int | None] = {}
        self._hot: set[int] = set()
        self._lost: set[int] = set()
        self._pending: list[GpuEvent] = []
        self._lock = threading.Lock()
        self._events_work = True

    def inventory(self) -> list[GpuInventory]:
        gpus: list[GpuInventory] = []
        for index in range(self.device_count):
            try:
                self._known[index] = self._inventory_of(index)
            except NvmlError as exc:
                # A GPU that stops answering keeps its last known identity, so the pool can
                # mark it unhealthy instead of seeing it vanish.
                if index not in self._known:
                    log.warning("GPU %d left out of the inventory: %s", index, exc)
                    continue
            gpus.append(self._known[index])
        return gpus

    def telemetry(self) -> list[GpuTelemetry]:
        return [self._telemetry_of(index) for index in range(self.device_count)]

    def driver_version(self) -> str | None:
        return _maybe(self.api.driver_version)

    def cuda_version(self) -> str | None:
        version = _maybe(self.api.cuda_driver_version)
        return None if version is None else format_cuda_version(version)

    def poll_events(self, timeout_ms: int) -> list[GpuEvent]:
        with self._lock:
            events, self._pending = self._pending, []
        if not self._events_work:
            if not events:
                time.sleep(timeout_ms / 1000.0)
            return events
        wait_ms = 0 if events else timeout_ms
        while len(events) < MAX_EVENTS_PER_POLL:
            try:
                raw = self.api.wait_event(wait_ms)
            except NvmlError as exc:
                # Without events the agent still sees faults through telemetry; say so once.
                log.warning("NVML events unavailable, watching telemetry only: %s", exc)
                self._events_work = False
                break
            if raw is None:
                break
            event = self._event_of(raw)
            if event is not None:
                events.append(event)
            wait_ms = 0
        return events

    def gpu_processes(self) -> list[GpuProcess]:
        """Compute processes and MPS clients of every GPU, with their memory and, where NVML
        samples processes, their recent SM use."""
        out: list[GpuProcess] = []
        for index in range(self.device_count):
            try:
                uuid = self._uuid(index)
            except NvmlError:
                continue
            out += self._processes_of(index, uuid)
        return out

    def close(self) -> None:
        try:
            self.api.shutdown()
        except NvmlError as exc:
            log.debug("NVML shutdown failed: %s", exc)

    # ---- inside -------------------------------------------------------------------------

    def _uuid(self, index: int) -> str:
        if index not in self._uuids:
            self._uuids[index] = self.api.uuid(index)
        return self._uuids[index]

    def _inventory_of(self, index: int) -> GpuInventory:
        mig = _maybe(lambda: self.api.mig_mode(index))
        return GpuInventory(
            uuid=self._uuid(index),
            index=index,
            model=self.api.name(index),
            memory_mib=self.api.memory_info(index).total_bytes // MIB,
            pci_bus_id=_maybe(lambda: self.api.pci_bus_id(index)),
            mig_mode=None if mig is None else mig == 1,
            simulated=False,
        )

    def _telemetry_of(self, index: int) -> GpuTelemetry:
        uuid = self._uuid(index)
        try:
            telemetry = self._read_telemetry(index, uuid)
        except NvmlGpuLost as exc:
            self._gpu_lost(index, uuid, exc)
            return GpuTelemetry(uuid=uuid)
        self._lost.discard(index)
        self._watch_temperature(index, uuid, telemetry.temperature_c)
        return telemetry

    def _read_telemetry(self, index: int, uuid: str) -> GpuTelemetry:
        api = self.api
        utilization = _maybe(lambda: api.utilization(index))
        memory = _maybe(lambda: api.memory_info(index))
        power_mw = _maybe(lambda: api.power_mw(index))
        processes = _maybe(lambda: api.compute_processes(index)) or []
        return GpuTelemetry(
            uuid=uuid,
            utilization_pct=None if utilization is None else float(utilization.gpu_pct),
            memory_used_mib=None if memory is None else memory.used_bytes // MIB,
            temperature_c=_float(_maybe(lambda: api.temperature_c(index))),
            power_w=None if power_mw is None else power_mw / 1000.0,
            ecc_uncorrected=_maybe(lambda: api.ecc_errors(index, "uncorrected")),
            ecc_corrected=_maybe(lambda: api.ecc_errors(index, "corrected")),
            sm_clock_mhz=_maybe(lambda: api.clock_mhz(index, "sm")),
            mem_clock_mhz=_maybe(lambda: api.clock_mhz(index, "mem")),
            processes=[
                {
                    "pid": p.pid,
                    "used_memory_mib": None if p.used_bytes is None else p.used_bytes // MIB,
                }
                for p in processes
            ],
        )

    def _processes_of(self, index: int, uuid: str) -> list[GpuProcess]:
        used: dict[int, int | None] = {}
        for listing in (self.api.compute_processes, self.api.mps_compute_processes):
            try:
                rows = listing(index)
            except NvmlError:
                # No MPS clients call on this driver (or the GPU stopped answering): the
                # other list still counts; a lost GPU is reported through telemetry.
                continue
            for row in rows:
                mib = None if row.used_bytes is None else row.used_bytes // MIB
                before = used.get(row.pid)
                # A client may be in both lists; its larger reading is the true one.
                used[row.pid] = mib if before is None else max(before, mib or 0)
        sm = self._sm_util(index, set(used))
        return [GpuProcess(uuid, pid, mib, sm.get(pid)) for pid, mib in sorted(used.items())]

    def _sm_util(self, index: int, pids: set[int]) -> dict[int, float]:
        """Each process's mean SM use over NVML's samples of the last SAMPLE_WINDOW_US: a
        window, not "since the last reading", as the watch reads faster than NVML samples."""
        if not pids:
            return {}
        since_us = int(time.time() * 1_000_000) - SAMPLE_WINDOW_US
        try:
            samples = self.api.process_utilization(index, since_us)
        except NvmlError:
            return {}
        by_pid: dict[int, list[int]] = {}
        for sample in samples:
            if sample.pid in pids:
                by_pid.setdefault(sample.pid, []).append(sample.sm_util_pct)
        return {pid: sum(v) / len(v) for pid, v in by_pid.items()}

    def _gpu_lost(self, index: int, uuid: str, exc: NvmlError) -> None:
        if index in self._lost:
            return
        self._lost.add(index)
        self._queue(GpuEvent(uuid, "lost", None, f"GPU is lost: {exc.message}"))

    def _watch_temperature(self, index: int, uuid: str, temperature_c: float | None) -> None:
        if index not in self._slowdown_c:
            self._slowdown_c[index] = _maybe(lambda: self.api.temperature_slowdown_c(index))
        threshold = self._slowdown_c[index]
        if threshold is None or temperature_c is None:
            return
        if temperature_c >= threshold and index not in self._hot:
            self._hot.add(index)
            self._queue(
                GpuEvent(
                    uuid,
                    "temperature",
                    temperature_c,
                    f"temperature {temperature_c:g} C reached the slowdown threshold {threshold} C",
                )
            )
        elif temperature_c < threshold - TEMPERATURE_HYSTERESIS_C:
            self._hot.discard(index)

    def _queue(self, event: GpuEvent) -> None:
        with self._lock:
            self._pending.append(event)

    def _event_of(self, raw: NvmlEvent) -> GpuEvent | None:
        try:
            uuid = self._uuid(raw.index)
        except NvmlError:
            uuid = f"GPU-index-{raw.index}"
        if raw.event_type & EVENT_XID_CRITICAL:
            return xid_event(uuid, raw.data)
        kind: EventKind
        if raw.event_type & EVENT_DOUBLE_BIT_ECC:
            kind, message = "ecc_uncorrected", "uncorrectable (double-bit) ECC error"
        elif raw.event_type & EVENT_GPU_UNAVAILABLE:
            kind, message = "lost", "GPU became unavailable"
        else:
            log.debug("ignoring NVML event %#x on GPU %d", raw.event_type, raw.index)
            return None
        return GpuEvent(uuid, kind, raw.data, message)


def _maybe(read: Callable[[], T]) -> T | None:
    """A reading, or None where this GPU does not offer it; a lost GPU still raises."""
    try:
        return read()
    except NvmlGpuLost:
        raise
    except NvmlNotSupported:
        return None
    except NvmlError as exc:
        # One failing sensor must not cost the whole heartbeat.
        log.debug("NVML reading failed: %s", exc)
        return None


def _float(value: int | None) -> float | None:
    return None if value is None else float(value)


# ---- fixtures -----------------------------------------------------------------------------


def record_fixture(
    path: str | Path, *, api: NvmlApi | None = None, event_wait_ms: int = 1000, note: str = ""
) -> dict[str, Json]:
    """Run every call the backend makes against NVML (or `api`) and save the answers to `path`."""
    recording = RecordingNvml(api if api is not None else PynvmlApi())
    backend = NvmlBackend(api=recording)
    try:
        backend.inventory()
        backend.telemetry()
        backend.driver_version()
        backend.cuda_version()
        backend.poll_events(event_wait_ms)
    finally:
        backend.close()
    source = "replayed" if isinstance(api, ReplayNvml) else "recorded"
    fixture = recording.fixture(source=source, note=note)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fixture, indent=2) + "\n")
    return fixture
