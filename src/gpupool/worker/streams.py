"""The client's CUDA streams and events, held by the worker: STREAM, EVENT and QUERY records.

Client and worker name streams and events by small integers the client chooses (0 is the
device's default stream). On a CUDA worker they are real `torch.cuda.Stream` and
`torch.cuda.Event` objects, so ordering between streams and `elapsed_time` are the GPU's
own. A CPU worker runs every op to its end before the next record, so one stream is as good
as any, and an event's time is the moment its record ran, i.e. after everything before it.
Ids and counts are the tenant's: each is checked, and a client may hold at most
MAX_STREAMS streams and MAX_EVENTS events.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpupool.protocol.v1.dataplane import ProtocolError

MAX_STREAMS = 64
MAX_EVENTS = 4096
MAX_ID = (1 << 63) - 1
PRIORITIES = range(-8, 1)
"""CUDA stream priorities are 0 (default) and negative numbers (higher); torch clamps them."""


class StreamError(RuntimeError):
    """A query the client's state cannot answer (an event never recorded, or without timing);
    the client raises it as PyTorch would (RuntimeError)."""


class _CpuEvent:
    """A recorded moment on a CPU worker."""

    __slots__ = ("at", "timing")

    def __init__(self, timing: bool) -> None:
        self.timing = timing
        self.at: float | None = None


class Streams:
    """One client's streams and events on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.current = 0
        self._streams: dict[int, Any] = {}
        self._events: dict[int, Any] = {}

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    # ---- records -----------------------------------------------------------------------

    def stream_record(self, action: Any, stream_id: Any, arg: Any) -> None:
        """[STREAM, action, stream_id, arg]."""
        stream_id = _id(stream_id, "stream")
        if action == "use":
            priority = arg if type(arg) is int and arg in PRIORITIES else None
            if priority is None:
                raise ProtocolError(f"STREAM use needs a priority in {PRIORITIES.start}..0")
            self._stream(stream_id, priority)
            self.current = stream_id
            if self.on_cuda:
                torch.cuda.set_stream(self._stream(stream_id, priority))
        elif action == "free":
            if stream_id != self.current:  # the one in use stays until the client switches
                self._streams.pop(stream_id, None)
        elif action == "tensor":
            if not isinstance(arg, torch.Tensor):
                raise ProtocolError("STREAM tensor needs a tensor")
            stream = self._streams.get(stream_id)
            if self.on_cuda and stream is not None and arg.device.type == "cuda":
                arg.record_stream(stream)
        else:
            raise ProtocolError(f"unknown STREAM action {action!r:.40}")

    def event_record(self, action: Any, event_id: Any, stream_id: Any, timing: Any) -> None:
        """[EVENT, action, event_id, stream_id, timing]."""
        event_id = _id(event_id, "event")
        if action == "free":
            self._events.pop(event_id, None)
            return
        stream_id = _id(stream_id, "stream")
        if action == "record":
            if type(timing) is not bool:
                raise ProtocolError("EVENT record needs timing as a bool")
            event = self._event(event_id, timing)
            if self.on_cuda:
                event.record(self._stream(stream_id, 0))
            else:
                event.at = time.perf_counter()
        elif action == "wait":
            event = self._events.get(event_id)
            # Waiting for an event never recorded returns at once, in CUDA too.
            if self.on_cuda and event is not None:
                event.wait(self._stream(stream_id, 0))
        else:
            raise ProtocolError(f"unknown EVENT action {action!r:.40}")

    def query(self, what: Any, a: Any, b: Any) -> Any:
        """[QUERY, req, what, a, b] about streams and events; None for the rest."""
        if what == "event_query":
            event = self._recorded(a)
            return event.query() if self.on_cuda else True
        if what == "event_sync":
            event = self._recorded(a)
            if self.on_cuda:
                event.synchronize()
            return None
        if what == "elapsed":
            start, end = self._recorded(a), self._recorded(b)
            if not (start.enable_timing if self.on_cuda else start.timing) or not (
                end.enable_timing if self.on_cuda else end.timing
            ):
                raise StreamError("Both events must be created with argument 'enable_timing=True'")
            if self.on_cuda:
                return float(start.elapsed_time(end))
            return (end.at - start.at) * 1000.0
        if what == "stream_query":
            stream = self._streams.get(_id(a, "stream"))
            return True if stream is None or not self.on_cuda else bool(stream.query())
        if what == "stream_sync":
            stream = self._streams.get(_id(a, "stream"))
            if stream is not None and self.on_cuda:
                stream.synchronize()
            return None
        raise ProtocolError(f"unknown QUERY {what!r:.40}")

    def synchronize(self) -> None:
        """Everything the client queued, on every stream of the device, has finished."""
        if self.on_cuda:
            torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        """A new client: the default stream again, no streams or events of the last one."""
        if self.on_cuda and self.current != 0:
            torch.cuda.set_stream(torch.cuda.default_stream(self.device))
        self.current = 0
        self._streams.clear()
        self._events.clear()

    # ---- lookups -----------------------------------------------------------------------

    def _stream(self, stream_id: int, priority: int) -> Any:
        stream = self._streams.get(stream_id)
        if stream is not None:
            return stream
        if len(self._streams) >= MAX_STREAMS:
            raise ProtocolError(f"a client may hold at most {MAX_STREAMS} streams")
        if not self.on_cuda:
            stream = stream_id
        elif stream_id == 0:
            stream = torch.cuda.default_stream(self.device)
        else:
            stream = torch.cuda.Stream(self.device, priority=priority)
        self._streams[stream_id] = stream
        return stream

    def _event(self, event_id: int, timing: bool) -> Any:
        event = self._events.get(event_id)
        if event is not None:
            return event
        if len(self._events) >= MAX_EVENTS:
            raise ProtocolError(f"a client may hold at most {MAX_EVENTS} events")
        event = torch.cuda.Event(enable_timing=timing) if self.on_cuda else _CpuEvent(timing)
        self._events[event_id] = event
        return event

    def _recorded(self, event_id: Any) -> Any:
        event = self._events.get(_id(event_id, "event"))
        if event is None or (not self.on_cuda and event.at is None):
            raise StreamError("the event was never recorded")
        return event


def _id(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_ID:
        raise ProtocolError(f"a {what} id must be a non-negative integer")
    return value
