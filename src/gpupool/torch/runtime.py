"""The remote devices this process is attached to: cuda:0 … cuda:N-1, one DeviceStream each."""

from __future__ import annotations

import contextlib
import os
import threading

from gpupool.torch.stream import DeviceStream

FLUSH_INTERVAL_S = 0.002
"""The background flusher sends what sat unsent this long (the user's code went quiet)."""

_streams: list[DeviceStream] = []
_current = 0
_flusher: _Flusher | None = None


class NotAttached(RuntimeError):
    pass


def streams() -> list[DeviceStream]:
    return _streams


def attached() -> bool:
    return bool(_streams)


def stream(index: int | None = None) -> DeviceStream:
    if not _streams:
        raise NotAttached("no gpupool remote GPUs are attached (call gpupool.torch.attach())")
    i = _current if index is None else index
    if not 0 <= i < len(_streams):
        raise RuntimeError(
            f"CUDA error: invalid device ordinal {i}: the lease has {len(_streams)} GPU(s)"
        )
    return _streams[i]


def current_index() -> int:
    return _current


def set_current(index: int) -> None:
    global _current
    stream(index)
    _current = index


def install(new_streams: list[DeviceStream]) -> None:
    global _flusher, _current
    _streams[:] = new_streams
    _current = 0
    _flusher = _Flusher()
    _flusher.start()


def uninstall() -> None:
    global _flusher
    if _flusher is not None:
        _flusher.stop()
        _flusher = None
    for s in _streams:
        s.close()
    _streams.clear()


class _Flusher(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="gpupool-flusher", daemon=True)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(FLUSH_INTERVAL_S):
            for s in list(_streams):
                # A broken stream is reported by the next op the program runs on it.
                with contextlib.suppress(Exception):
                    s.try_flush()

    def stop(self) -> None:
        self._stop_event.set()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) shares the parent's sockets: it must not use them."""
    global _flusher
    for s in _streams:
        s.forked()
    _flusher = None


os.register_at_fork(after_in_child=_after_fork_in_child)
