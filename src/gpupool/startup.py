"""Process start-up: heavy imports without the cyclic garbage collector, and the collector's
threshold for processes that stream ops.

CPython's cyclic collector runs after every few hundred new container objects. While a process
imports torch, FastAPI, SQLAlchemy or pydantic it makes hundreds of thousands of them and the
collector walks the young ones again and again without finding garbage: on the 2-core dev VM a
third of a second of the ~1.5 s of CPU that `import torch` takes, and an eighth of a
controller's import (bench/startup_cost.py). Every worker, controller, agent and `gpupool run
--remote` program pays that at start, so their entry points import with the collector off.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def imports_without_gc(freeze: bool = True) -> Iterator[None]:
    """Turn the cyclic collector off for the block (imports make almost no garbage cycles),
    then back on as it was. With `freeze`, what the imports made moves out of its reach
    (gc.freeze): a long-running service's later full collections no longer walk its modules,
    classes and functions. A user's program is not frozen (it owns its collector)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()


GC_THRESHOLD_ENV = "GPUPOOL_GC_THRESHOLD"
GC_YOUNG_THRESHOLD = 10_000
"""The collector's first threshold for processes that stream ops (a client, a worker).

CPython collects its youngest generation whenever tracked objects made minus those freed
exceed 700. A remote training step keeps thousands of small tracked objects alive from the
forward to the backward pass (tensor wrappers, handles, saved activations, queued records), so
at 700 they survive two young collections, pile up in the oldest generation and bring a full
collection of every object in the process every few dozen steps: on the dev VM a GPT-2-shaped
client step averaged 3-4 ms of collector time (one 190 ms pass over 377,000 objects per ~60
steps, the step that takes it twice as slow as its neighbours), and none of those passes found
more than a few hundred objects to free. At 10,000 the objects of a step die young: the same
steps ran no collection at all (bench/gc_threshold.py). Cycles are still collected, after
10,000 new objects instead of 700."""


def tune_gc() -> tuple[int, int, int] | None:
    """Raise the collector's first threshold to GC_YOUNG_THRESHOLD ($GPUPOOL_GC_THRESHOLD
    overrides it; 0 leaves Python's), never lower it; returns the thresholds it replaced (for
    restore_gc), or None when it changed nothing (the collector off, or a higher threshold)."""
    wanted = _wanted_threshold()
    before = gc.get_threshold()
    if wanted <= 0 or before[0] == 0 or before[0] >= wanted:
        return None
    gc.set_threshold(wanted, *before[1:])
    return before


def restore_gc(before: tuple[int, int, int] | None) -> None:
    """Put back what tune_gc replaced, unless the program has changed the threshold since."""
    if before is not None and gc.get_threshold()[0] == _wanted_threshold():
        gc.set_threshold(*before)


def _wanted_threshold() -> int:
    try:
        return int(os.environ.get(GC_THRESHOLD_ENV, GC_YOUNG_THRESHOLD))
    except ValueError:
        return GC_YOUNG_THRESHOLD
