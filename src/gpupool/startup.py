"""Process start-up: heavy imports without the cyclic garbage collector.

CPython's cyclic collector runs after every few hundred new container objects. While a process
imports torch, FastAPI, SQLAlchemy or pydantic it makes hundreds of thousands of them and the
collector walks the young ones again and again without finding garbage: on the 2-core dev VM a
third of a second of the ~1.5 s of CPU that `import torch` takes, and an eighth of a
controller's import (bench/startup_cost.py). Every worker, controller, agent and `gpupool run
--remote` program pays that at start, so their entry points import with the collector off.
"""

from __future__ import annotations

import gc
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
