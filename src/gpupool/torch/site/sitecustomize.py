"""Put on PYTHONPATH by `gpupool run --remote`: unchanged programs attach to the lease's GPUs.

With GPUPOOL_LEASE, GPUPOOL_WORKERS and GPUPOOL_LEASE_TOKEN set (or GPUPOOL_LAZY, the request
of a lease to take at the first GPU op: `gpupool run --remote --lazy`), the program attaches
the moment it first imports torch (programs that never do pay nothing: this file imports only
the standard library). The variables then leave the environment, so that subprocesses (spawned
DataLoader workers, tools the program runs) do not try to be a second client of the same workers.
Any sitecustomize this one shadows still runs afterwards.
"""

import gc
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

_ENV = ("GPUPOOL_LEASE", "GPUPOOL_WORKERS", "GPUPOOL_LEASE_TOKEN")
_LAZY_ENV = ("GPUPOOL_LAZY", "GPUPOOL_LAZY_TOKEN", "GPUPOOL_LAZY_LEASE_FILE")


def _attach_from_environment() -> None:
    if os.environ.get("GPUPOOL_LAZY"):
        import gpupool.torch

        try:
            gpupool.torch.attach(lazy=True)  # reads the request, token and lease file
        finally:
            for name in _ENV + _LAZY_ENV:
                os.environ.pop(name, None)
        return
    settings = {name: os.environ.pop(name, None) for name in _ENV + _LAZY_ENV}
    if not settings["GPUPOOL_WORKERS"]:
        return
    import gpupool.torch

    workers = [w for w in (settings["GPUPOOL_WORKERS"] or "").split(",") if w]
    ranks = gpupool.torch.rank_from_environment(len(workers))
    gpupool.torch.attach(
        settings["GPUPOOL_LEASE"] or "",
        workers=workers,
        token=settings["GPUPOOL_LEASE_TOKEN"],
        rank=None if ranks is None else ranks[0],
        local_rank=None if ranks is None else ranks[1],
    )


def _launcher() -> bool:
    """torchrun (or `python -m torch.distributed.run`) itself: it starts the ranks, which
    attach one GPU each, and must neither attach nor take the variables from them."""
    argv = getattr(sys, "orig_argv", [])
    if len(argv) > 1 and os.path.basename(argv[1]) == "torchrun":
        return True
    return argv[1:3] in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"])


class _AttachAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps torch's loader so that attaching follows its import."""

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            # torch's import and the attach make ~10^6 objects and no garbage cycles: with the
            # cyclic collector off meanwhile, the program starts a third of a second sooner
            # (gpupool/startup.py; not imported here, this file uses the standard library only).
            enabled = gc.isenabled()
            gc.disable()
            try:
                load(module)
                _attach_from_environment()
            finally:
                if enabled:
                    gc.enable()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if (os.environ.get("GPUPOOL_WORKERS") or os.environ.get("GPUPOOL_LAZY")) and not _launcher():
    sys.meta_path.insert(0, _AttachAfterTorch())

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here]
)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
