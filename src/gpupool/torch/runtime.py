"""The remote devices this process is attached to: cuda:0 … cuda:N-1, one DeviceStream each.

A lazy attach installs a `Pending` instead of streams: the process counts as attached (torch
sees its devices), and the first thing that needs a worker acquires the lease and opens them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Protocol

from gpupool.torch.stream import DeviceStream

FLUSH_INTERVAL_S = 0.002
"""The background flusher sends what sat unsent this long (the user's code went quiet)."""
FLUSH_MAX_INTERVAL_S = 0.016
"""How far the flusher backs off while the program flushes its own batches."""

_streams: list[DeviceStream] = []
_current = 0
_flusher: _Flusher | None = None
_pending: Pending | None = None
_deferred_seeds: dict[int, int] = {}
"""Seeds set before a lazy lease was acquired (torch.manual_seed at the top of a program),
by device index: the first records each stream sends, so results equal a non-lazy run."""
_acquiring = threading.Lock()
_alias: int | None = None
_visible = 0
"""How many GPUs a rank of a one-GPU-per-rank attach counts (see device_count)."""
"""One GPU per process (a rank of a distributed program, `attach(rank=...)`): its device is
cuda:0, and cuda:<local rank>, the index such programs pass to `torch.cuda.set_device` and
`.to()`, names the same device."""
_forked_child = False
"""This process is a forked child (a DataLoader worker) of a process attached to remote GPUs."""


class NotAttached(RuntimeError):
    pass


class Pending(Protocol):
    """A lease not taken yet: how many GPUs it will have, and how to take it."""

    @property
    def device_count(self) -> int: ...

    def acquire(self) -> list[DeviceStream]:
        """Take the lease (waiting in the queue) and open one stream per GPU; raises why not."""
        ...

    def release(self) -> None:
        """Give the lease back, if it was taken."""
        ...


def streams() -> list[DeviceStream]:
    """The open streams: none while a lazy lease is not acquired yet."""
    return _streams


def attached() -> bool:
    return bool(_streams) or _pending is not None


def pending() -> bool:
    """A lazy attach whose lease is not acquired yet."""
    return not _streams and _pending is not None


def device_count() -> int:
    """The lease's GPUs, known from the request before a lazy lease is acquired. A rank that
    attached to one of them counts them all, as a process of a local multi-GPU launch does
    (torch's own code sizes per-device tables by it), though only its own can be used."""
    if _alias is not None:
        return _visible
    if _streams or _pending is None:
        return len(_streams)
    return _pending.device_count


def stream(index: int | None = None) -> DeviceStream:
    if not _streams:
        if _pending is None:
            raise NotAttached("no gpupool remote GPUs are attached (call gpupool.torch.attach())")
        _check_ordinal(_current if index is None else index)
        _acquire()
    i = _current if index is None else index
    if not 0 <= i < len(_streams):  # inline: factory ops of every step come through here
        i = canonical(i)
    return _streams[i]


def canonical(index: int) -> int:
    """The position in `_streams` of device `index`: a rank's own index (see `_alias`) and 0
    are its one stream; an index the lease lacks raises CUDA's invalid-ordinal error."""
    if index == _alias:
        return 0
    _check_ordinal(index)
    if _alias is not None and index != 0:
        raise RuntimeError(
            f"CUDA error: invalid device ordinal {index}: cuda:{index} is another rank's GPU; "
            f"this rank has cuda:{_alias} (cuda:0 names it too)"
        )
    return index


def alias() -> int | None:
    """A rank's own device index, in a one-GPU-per-rank attach (cuda:0 names it too)."""
    return _alias


def _check_ordinal(index: int) -> None:
    count = device_count()
    if not 0 <= index < count:
        raise RuntimeError(
            f"CUDA error: invalid device ordinal {index}: the lease has {count} GPU(s)"
        )


def _acquire() -> None:
    """The first op that needs a worker: take the lease now (one thread does, others wait)."""
    with _acquiring:
        if _streams or _pending is None:
            return
        opened = _pending.acquire()
        for index, seed in sorted(_deferred_seeds.items()):
            opened[index].seed(seed)
        _deferred_seeds.clear()
        _start(opened)


def defer_seed(index: int | None, seed: int) -> None:
    """Before a lazy lease is acquired: remember a seed for device `index` (None: all)."""
    for i in range(device_count()) if index is None else [index]:
        _check_ordinal(i)
        _deferred_seeds[i] = seed


def current_index() -> int:
    return _current


def set_current(index: int) -> None:
    global _current
    position = canonical(index)
    _current = _alias if _alias is not None else position


def install(
    new_streams: list[DeviceStream], alias_index: int | None = None, visible: int = 0
) -> None:
    """`alias_index`: this process is one rank with one GPU (its stream, opened as device
    `alias_index`) of a lease of `visible` GPUs."""
    global _current, _forked_child, _alias, _visible
    _forked_child = False
    _alias = alias_index if alias_index is not None and len(new_streams) == 1 else None
    _current = 0 if _alias is None else _alias
    _visible = max(visible, 1 if _alias is None else _alias + 1)
    _start(new_streams)


def install_pending(lazy: Pending) -> None:
    """Attach lazily: devices are visible now, the lease is taken at the first op."""
    global _current, _pending
    _current = 0
    _pending = lazy
    _deferred_seeds.clear()


def _start(new_streams: list[DeviceStream]) -> None:
    global _flusher
    _streams[:] = new_streams
    _flusher = _Flusher()
    _flusher.start()


def uninstall() -> None:
    """Close the streams, then give a lazily taken lease back (its workers end with it)."""
    global _flusher, _pending, _alias
    _alias = None
    if _flusher is not None:
        _flusher.stop()
        _flusher = None
    for s in _streams:
        s.close()
    _streams.clear()
    lazy, _pending = _pending, None
    _deferred_seeds.clear()
    if lazy is not None:
        lazy.release()


class _Flusher(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="gpupool-flusher", daemon=True)
        self._stop_event = threading.Event()

    def run(self) -> None:
        interval = FLUSH_INTERVAL_S
        while not self._stop_event.wait(interval):
            now = time.perf_counter()
            busy = False
            for s in list(_streams):
                # A broken stream is reported by the next op the program runs on it.
                with contextlib.suppress(Exception):
                    busy = s.try_flush(now) or busy
            # Every wake-up takes the GIL from the program's thread: while the program sends
            # its batches itself, look less often (a tail it leaves waits at most this long).
            interval = min(interval * 2, FLUSH_MAX_INTERVAL_S) if busy else FLUSH_INTERVAL_S

    def stop(self) -> None:
        self._stop_event.set()


def forked_child() -> bool:
    """Whether this process is a forked child of an attached one: it sees the parent's devices
    but cannot use them (a remote op raises WorkerLost saying so); seeding them is a no-op, as
    DataLoader workers seed every device at their start."""
    return _forked_child


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) shares the parent's sockets: it must not use them,
    whatever the parent had queued or was sending at the fork."""
    global _flusher, _pending, _forked_child
    _forked_child = bool(_streams) or _pending is not None
    for s in _streams:
        s.forked()
    _flusher = None
    # Nor may it take a lease of its own: its tensors would live apart from the parent's.
    _pending = None
    _deferred_seeds.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
