"""A simulated GPU's physical memory, shared by the workers of one fake-backend GPU.

A real GPU refuses an allocation when its physical memory is used up, whoever holds it; the
driver is the single place that knows. Workers of the fake backend run on the CPU, so the agent
stands in for the driver with a ledger file per simulated GPU: `{"total_bytes": T, "held":
{"<worker pid>": bytes}}`. A worker records what it holds under an exclusive lock and may grow
only while the sum stays within the total; the agent creates the file with the GPU's simulated
size and removes the entries of workers it no longer runs. It is a simulation and says so: no
device memory exists behind it, only the host memory the CPU workers really use.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any


class SimulatedGpuMemory:
    """The ledger of one simulated GPU; every method takes the file's lock for its whole work."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, path: Path, total_bytes: int) -> SimulatedGpuMemory:
        """The agent's side: a ledger of `total_bytes`, keeping the entries of one that exists
        (its workers outlive an agent restart)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        ledger = cls(path)
        with ledger._locked() as (data, save):
            data["total_bytes"] = int(total_bytes)
            data.setdefault("held", {})
            save()
        return ledger

    @contextlib.contextmanager
    def _locked(self) -> Iterator[tuple[dict[str, Any], Any]]:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                data = _read(handle)
                yield data, lambda: _write(handle, data)
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def claim(self, key: str, held_bytes: int) -> int:
        """Record that `key` holds `held_bytes` if the GPU has room for it. Returns the bytes
        still missing: 0 when recorded, else how much the others must free first."""
        with self._locked() as (data, save):
            held: dict[str, int] = data.setdefault("held", {})
            others = sum(int(v) for k, v in held.items() if k != key)
            missing = others + held_bytes - int(data.get("total_bytes", 0))
            if missing > 0 and held_bytes > int(held.get(key, 0)):
                return missing
            held[key] = int(held_bytes)
            save()
            return 0

    def record(self, key: str, held_bytes: int) -> None:
        """A worker that holds less (it freed or swapped out) says so; shrinking always fits."""
        with self._locked() as (data, save):
            held: dict[str, int] = data.setdefault("held", {})
            if held_bytes > 0:
                held[key] = int(held_bytes)
            else:
                held.pop(key, None)
            save()

    def prune(self, keep: Iterable[str]) -> None:
        """The agent's side: forget workers that are gone (an exit without a goodbye)."""
        kept = set(keep)
        with self._locked() as (data, save):
            held: dict[str, int] = data.setdefault("held", {})
            gone = set(held) - kept
            if gone:
                for key in gone:
                    del held[key]
                save()

    def usage(self) -> tuple[int, int]:
        """(held by all workers, total) in bytes."""
        with self._locked() as (data, _save):
            held = data.get("held", {})
            return sum(int(v) for v in held.values()), int(data.get("total_bytes", 0))


def _read(handle: IO[str]) -> dict[str, Any]:
    handle.seek(0)
    text = handle.read()
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _write(handle: IO[str], data: dict[str, Any]) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps(data))
    handle.flush()
