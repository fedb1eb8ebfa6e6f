"""torch.cuda.Stream and torch.cuda.Event of a remote device: the worker's own streams and events.

A Stream or Event here is a client-chosen id; the worker holds the real one (STREAM, EVENT and
QUERY records, `gpupool.worker.streams`). Switching streams, recording and waiting are records
in the op stream, so they keep their place among the ops and cost no round trip; `query()`,
`synchronize()` and `elapsed_time()` ask the worker, and the time is the worker's device's.
The current stream is per device and per process (not per thread).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from gpupool.protocol.v1.dataplane import Rec
from gpupool.torch import runtime
from gpupool.torch.stream import DeviceStream
from gpupool.torch.tensor import RemoteTensor

_IDS = itertools.count(1)
PRIORITY_MIN = -8
"""Priorities below this mean the same as it (CUDA clamps to the device's range too)."""

_current: dict[int, Stream] = {}
"""Device index → the stream ops on it run on, where not the default one."""
_defaults: dict[int, Stream] = {}


def _device_index(device: Any) -> int:
    if device is None:
        return runtime.current_index()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"expected a cuda device, got {device}")
    return runtime.current_index() if device.index is None else device.index


def _worker(index: int) -> DeviceStream:
    stream = runtime.stream(index)
    if not stream.takes_streams():
        raise NotImplementedError(
            f"the worker of {stream.device} is older than this client and has no streams or "
            "events (torch.cuda.Stream, torch.cuda.Event): update the pool's workers"
        )
    return stream


class Stream:
    """A stream of a remote device; ops inside `with torch.cuda.stream(s)` run on it."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"unexpected arguments {', '.join(kwargs)}")
        index = _device_index(device)
        self._ds = _worker(index)
        self.device = self._ds.device
        self.priority = max(min(int(priority), 0), PRIORITY_MIN)
        self.stream_id = next(_IDS)

    @classmethod
    def _default(cls, index: int) -> Stream:
        stream = _defaults.get(index)
        if stream is None or stream._ds is not runtime.stream(index):
            stream = cls.__new__(cls)
            stream._ds = runtime.stream(index)  # any worker has its default stream
            stream.device, stream.priority, stream.stream_id = stream._ds.device, 0, 0
            _defaults[index] = stream
        return stream

    @property
    def cuda_stream(self) -> int:
        """The stream's id (not a CUDA pointer: the stream lives in the worker)."""
        return self.stream_id

    def wait_event(self, event: Event) -> None:
        event.wait(self)

    def wait_stream(self, stream: Stream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def is_capturing(self) -> bool:
        """Optimizers ask before every step; no CUDA graph is ever captured in this process
        (gpupool.torch.capture records steps its own way)."""
        return False

    def query(self) -> bool:
        if not self.stream_id and not self._ds.takes_streams():
            return bool(self._ds.sync() is not None)
        return bool(self._ds.query("stream_query", self.stream_id))

    def synchronize(self) -> None:
        if not self.stream_id and not self._ds.takes_streams():
            self._ds.sync()
            return
        self._ds.query("stream_sync", self.stream_id)

    def __enter__(self) -> Stream:
        self._previous = current_stream(self.device)
        set_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        set_stream(self._previous)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Stream)
            and other._ds is self._ds
            and other.stream_id == self.stream_id
        )

    def __hash__(self) -> int:
        return hash((id(self._ds), self.stream_id))

    def __repr__(self) -> str:
        return f"<gpupool Stream device={self.device} id={self.stream_id}>"

    def __del__(self) -> None:
        stream_id, ds = getattr(self, "stream_id", 0), getattr(self, "_ds", None)
        if stream_id and ds is not None:
            ds.free_stream(stream_id)


class Event:
    """A marker in a stream of a remote device; its time is measured on the worker."""

    def __init__(
        self,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        external: bool = False,
    ) -> None:
        if interprocess or external:
            raise NotImplementedError(
                "interprocess and external CUDA events are not supported on gpupool remote GPUs"
            )
        self.enable_timing = bool(enable_timing)
        self.blocking = bool(blocking)
        self.event_id = next(_IDS)
        self._ds: DeviceStream | None = None
        self.device: torch.device | None = None

    @property
    def cuda_event(self) -> int:
        return self.event_id

    def record(self, stream: Stream | None = None) -> None:
        stream = current_stream() if stream is None else stream
        if self._ds is None:
            self._ds, self.device = stream._ds, stream.device
        elif self._ds is not stream._ds:
            raise RuntimeError(
                f"Event device {self.device} does not match recording stream's device "
                f"{stream.device}."
            )
        self._ds.emit([Rec.EVENT, "record", self.event_id, stream.stream_id, self.enable_timing])

    def wait(self, stream: Stream | None = None) -> None:
        stream = current_stream() if stream is None else stream
        if self._ds is None:
            return  # never recorded: nothing to wait for, as in CUDA
        if stream._ds is not self._ds:
            # Streams of two workers: the other device's later ops must follow the event, so
            # this process waits for it before it sends them.
            self.synchronize()
            return
        self._ds.emit([Rec.EVENT, "wait", self.event_id, stream.stream_id, False])

    def query(self) -> bool:
        if self._ds is None:
            return True
        return bool(self._ds.query("event_query", self.event_id))

    def synchronize(self) -> None:
        if self._ds is not None:
            self._ds.query("event_sync", self.event_id)

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds from this event to `end_event`, as the worker's device measured them."""
        if self._ds is None or end_event._ds is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if self._ds is not end_event._ds:
            raise RuntimeError("Both events must be recorded on the same device.")
        return float(self._ds.query("elapsed", self.event_id, end_event.event_id))

    def ipc_handle(self) -> Any:
        raise NotImplementedError("CUDA event IPC handles are not supported on gpupool remote GPUs")

    def __repr__(self) -> str:
        return f"<gpupool Event device={self.device} id={self.event_id}>"

    def __del__(self) -> None:
        ds = getattr(self, "_ds", None)
        if ds is not None:
            ds.free_event(self.event_id)


def current_stream(device: Any = None) -> Stream:
    index = _device_index(device)
    stream = _current.get(index)
    if stream is not None and stream._ds is runtime.stream(index):
        return stream
    return Stream._default(index)


def default_stream(device: Any = None) -> Stream:
    return Stream._default(_device_index(device))


def set_stream(stream: Stream | None) -> None:
    if stream is None:
        return
    if not isinstance(stream, Stream):
        raise TypeError(f"expected a torch.cuda.Stream of a gpupool remote GPU, got {stream!r}")
    index = stream._ds.index
    if stream.stream_id == 0:
        _current.pop(index, None)
    else:
        _current[index] = stream
    stream._ds.use_stream(stream.stream_id, stream.priority)


class StreamContext:
    """`with torch.cuda.stream(s):` ops inside run on s; None changes nothing."""

    def __init__(self, stream: Stream | None) -> None:
        self.stream = stream
        self._previous: Stream | None = None

    def __enter__(self) -> None:
        if self.stream is not None:
            self._previous = current_stream(self.stream.device)
            set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None:
            set_stream(self._previous)


def stream(stream: Stream | None) -> StreamContext:
    return StreamContext(stream)


def record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """Tensor.record_stream: the worker's allocator keeps the tensor's memory until the work
    queued on `stream` so far is done, even after the client drops the tensor."""
    if not isinstance(tensor, RemoteTensor):
        _ORIGINAL_RECORD_STREAM(tensor, stream)
        return
    if not isinstance(stream, Stream) or stream._ds is not tensor._gp.stream:
        raise RuntimeError(
            f"record_stream: the stream {stream!r} is not a stream of the tensor's device "
            f"{tensor.device}"
        )
    stream._ds.emit([Rec.STREAM, "tensor", stream.stream_id, tensor._gp.ext])


_ORIGINAL_RECORD_STREAM: Any = None


def install() -> None:
    global _ORIGINAL_RECORD_STREAM
    if _ORIGINAL_RECORD_STREAM is None:
        _ORIGINAL_RECORD_STREAM = torch.Tensor.record_stream
        torch.Tensor.record_stream = record_stream  # type: ignore[method-assign,assignment]


def uninstall() -> None:
    global _ORIGINAL_RECORD_STREAM
    if _ORIGINAL_RECORD_STREAM is not None:
        torch.Tensor.record_stream = _ORIGINAL_RECORD_STREAM  # type: ignore[method-assign]
        _ORIGINAL_RECORD_STREAM = None
    _current.clear()
    _defaults.clear()
