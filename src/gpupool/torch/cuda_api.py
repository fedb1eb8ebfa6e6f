"""torch.cuda and torch.accelerator answered from the attached lease: availability, count, names,
memory, seeds, sync."""

from __future__ import annotations

import random
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import torch

from gpupool.torch import runtime, streams
from gpupool.torch.tensor import BACKEND

_ORIGINALS: dict[str, Any] = {}


def _index(device: Any = None) -> int:
    if device is None:
        return runtime.current_index()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type not in ("cuda", "meta", BACKEND):
            raise ValueError(f"expected a cuda device, got {device}")
        return runtime.current_index() if device.index is None else device.index
    raise TypeError(f"not a device: {device!r}")


def _streams(device: Any = None) -> list[Any]:
    return list(runtime.streams()) if device is None else [runtime.stream(_index(device))]


def is_available() -> bool:
    return runtime.attached()


def device_count() -> int:
    return runtime.device_count()


def current_device() -> int:
    return runtime.current_index()


def set_device(device: Any) -> None:
    runtime.set_current(_index(device))


def _exchange_device(index: int) -> int:
    previous = runtime.current_index()
    if index >= 0:
        runtime.set_current(index)
    return previous


def _maybe_exchange_device(index: int) -> int:
    """A function of its own, not an alias of _exchange_device: torch.compile keeps a table of
    torch.cuda's functions and refuses one registered twice ("Handler already registered")."""
    return _exchange_device(index)


def get_device_name(device: Any = None) -> str:
    return runtime.stream(_index(device)).name


def get_device_properties(device: Any = None) -> Any:
    facts = runtime.stream(_index(device)).welcome
    major, minor = facts.get("capability", [0, 0])
    limit = facts.get("memory_limit_bytes")
    total = int(limit if limit is not None else facts.get("total_memory_bytes", 0))
    return SimpleNamespace(
        name=facts.get("device_name", "gpupool remote device"),
        total_memory=total,
        major=major,
        minor=minor,
        multi_processor_count=facts.get("multi_processor_count", 1),
        is_integrated=False,
        is_multi_gpu_board=False,
        gpupool_lease=facts.get("lease"),
        gpupool_worker=facts.get("host"),
    )


def get_device_capability(device: Any = None) -> tuple[int, int]:
    props = get_device_properties(device)
    return props.major, props.minor


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return bool(runtime.stream().welcome.get("bf16", True))


def synchronize(device: Any = None) -> None:
    for stream in _streams(device):
        stream.sync()


def memory_allocated(device: Any = None) -> int:
    if runtime.pending():  # a lazy lease not taken yet holds nothing (asking must not take it)
        return 0
    return int(runtime.stream(_index(device)).stats()["memory_held_bytes"])


def max_memory_allocated(device: Any = None) -> int:
    if runtime.pending():
        return 0
    return int(runtime.stream(_index(device)).stats()["memory_peak_bytes"])


def memory_stats(device: Any = None) -> OrderedDict[str, Any]:
    """The allocator statistics PyTorch's own functions read, as the lease's worker counts its
    tensors: allocated and reserved are the same (a worker's cache is not the tenant's)."""
    flat: OrderedDict[str, Any] = OrderedDict()
    for key, value in sorted(_flatten("", _device_stats(device)).items()):
        flat[key] = value
    return flat


def _device_stats(device: Any = None) -> dict[str, Any]:
    """Nested as torch._C._accelerator_getDeviceStats answers."""
    held, peak = memory_allocated(device), max_memory_allocated(device)
    pool = {"current": held, "peak": peak}
    return {
        "allocated_bytes": {"all": pool},
        "reserved_bytes": {"all": dict(pool)},
        "active_bytes": {"all": dict(pool)},
    }


def _flatten(prefix: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, item in value.items():
        flat.update(_flatten(f"{prefix}.{key}" if prefix else key, item))
    return flat


def reset_peak_memory_stats(device: Any = None) -> None:
    if runtime.pending():
        return
    runtime.stream(_index(device)).reset_peak()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    stream = runtime.stream(_index(device))
    stats = stream.stats()
    total = stats["memory_limit_bytes"] or stream.welcome.get("total_memory_bytes", 0)
    return int(total) - int(stats["memory_held_bytes"]), int(total)


def manual_seed(seed: int) -> None:
    if runtime.forked_child():  # a DataLoader worker seeds the parent's devices: nothing to do
        return
    if runtime.pending():  # torch.manual_seed at a program's top must not take the lease
        runtime.defer_seed(runtime.current_index(), int(seed))
        return
    runtime.stream().seed(int(seed))


def manual_seed_all(seed: int) -> None:
    if runtime.forked_child():
        return
    if runtime.pending():
        runtime.defer_seed(None, int(seed))
        return
    for stream in runtime.streams():
        stream.seed(int(seed))


def seed() -> None:
    manual_seed(random.getrandbits(63))


def seed_all() -> None:
    manual_seed_all(random.getrandbits(63))


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return runtime.stream(_index(device)).rng_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    runtime.stream(_index(device)).set_rng_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [stream.rng_state() for stream in runtime.streams()]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for stream, state in zip(runtime.streams(), new_states, strict=True):
        stream.set_rng_state(state)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _not_supported(name: str) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"torch.cuda.{name} is not supported on gpupool remote GPUs")

    return fail


def _not_supported_class(name: str) -> type:
    """A class, not a function: libraries use these in annotations (`CUDAGraph | None`) and
    isinstance checks at import time; only making one fails."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"torch.cuda.{name} is not supported on gpupool remote GPUs")

    return type(name, (), {"__init__": __init__, "__module__": "gpupool.torch.cuda_api"})


REPLACEMENTS: dict[str, Any] = {
    "is_available": is_available,
    "device_count": device_count,
    "current_device": current_device,
    "set_device": set_device,
    "_exchange_device": _exchange_device,
    "_maybe_exchange_device": _maybe_exchange_device,
    "get_device_name": get_device_name,
    "get_device_properties": get_device_properties,
    "get_device_capability": get_device_capability,
    "is_bf16_supported": is_bf16_supported,
    "synchronize": synchronize,
    "memory_allocated": memory_allocated,
    "max_memory_allocated": max_memory_allocated,
    "memory_reserved": lambda device=None: memory_allocated(device),
    "max_memory_reserved": lambda device=None: max_memory_allocated(device),
    "mem_get_info": mem_get_info,
    "memory_stats": memory_stats,
    "empty_cache": _nothing,
    "reset_peak_memory_stats": reset_peak_memory_stats,
    "reset_max_memory_allocated": lambda device=None: reset_peak_memory_stats(device),
    "reset_max_memory_cached": lambda device=None: reset_peak_memory_stats(device),
    "manual_seed": manual_seed,
    "manual_seed_all": manual_seed_all,
    "seed": seed,
    "seed_all": seed_all,
    "is_initialized": lambda: True,
    # Activation checkpointing saves the device RNG state only of an initialized device.
    "_initialized": True,
    "init": _nothing,
    # A CPU-only torch calls this before making anything on `cuda`; our kernels need no init.
    "_lazy_init": _nothing,
    "get_rng_state": get_rng_state,
    "set_rng_state": set_rng_state,
    "get_rng_state_all": get_rng_state_all,
    "set_rng_state_all": set_rng_state_all,
    # Streams and events of the remote device are the worker's own (gpupool.torch.streams).
    "Stream": streams.Stream,
    "Event": streams.Event,
    "stream": streams.stream,
    "StreamContext": streams.StreamContext,
    "current_stream": streams.current_stream,
    "default_stream": streams.default_stream,
    "set_stream": streams.set_stream,
    "ExternalStream": _not_supported_class("ExternalStream"),
    # CUDA graphs: gpupool.torch.capture records a step and the worker replays it as one.
    "CUDAGraph": _not_supported_class("CUDAGraph"),
    # Optimizers ask this before every step; no graph is ever captured on the client.
    "is_current_stream_capturing": lambda: False,
    "graph": _not_supported("graph"),
}


# ---- torch.accelerator ------------------------------------------------------------------------
# Its Python functions call these torch._C functions by name at each call (torch 2.11 and 2.13),
# and ask torch.cuda (the module of the accelerator these report) for availability and count.


def _accelerator() -> torch.device:
    return torch.device("cuda")


def _index_or_current(index: int | None) -> int:
    return runtime.current_index() if index is None or index < 0 else index


def _accelerator_set_index(index: int) -> None:
    if index >= 0:
        set_device(index)


def _accelerator_synchronize(index: int | None = None) -> None:
    synchronize(_index_or_current(index))


def _accelerator_stream(index: int | None = None) -> streams.Stream:
    return streams.current_stream(_index_or_current(index))


def _accelerator_capability(index: int | None = None) -> dict[str, Any]:
    from gpupool.protocol.v1.tensors import DTYPES

    runtime.stream(_index_or_current(index))  # an ordinal the lease does not have raises
    return {"supported_dtypes": set(DTYPES.values())}


def _accelerator_stats(index: int | None = None) -> dict[str, Any]:
    return _device_stats(_index_or_current(index))


def _accelerator_memory_info(index: int | None = None) -> tuple[int, int]:
    return mem_get_info(_index_or_current(index))


def _accelerator_reset_peak(index: int | None = None) -> None:
    reset_peak_memory_stats(_index_or_current(index))


ACCELERATOR_REPLACEMENTS: dict[str, Any] = {
    "_accelerator_getAccelerator": _accelerator,
    # What torch.distributed and FSDP ask (a function of its own, as for _exchange_device).
    "_get_accelerator": lambda: torch.device("cuda"),
    "_accelerator_getDeviceIndex": current_device,
    "_accelerator_setDeviceIndex": _accelerator_set_index,
    "_accelerator_exchangeDevice": _exchange_device,
    "_accelerator_maybeExchangeDevice": _maybe_exchange_device,
    "_accelerator_synchronizeDevice": _accelerator_synchronize,
    "_accelerator_getDeviceCapability": _accelerator_capability,
    "_accelerator_getStream": _accelerator_stream,
    "_accelerator_setStream": streams.set_stream,
    "_accelerator_isAllocatorInitialized": lambda: True,
    "_accelerator_getDeviceStats": _accelerator_stats,
    "_accelerator_getMemoryInfo": _accelerator_memory_info,
    "_accelerator_resetPeakStats": _accelerator_reset_peak,
    "_accelerator_resetAccumulatedStats": lambda index=None: _accelerator_reset_peak(index),
    "_accelerator_emptyCache": _nothing,
    "_accelerator_emptyHostCache": lambda: None,
}


def _jiterator(*args: Any, **kwargs: Any) -> Any:
    """`torch.cuda.jiterator` compiles CUDA C++ that the program supplies: on a worker that would
    be a tenant's own code in the worker's process, with every kernel's access to the lease's
    memory and none of the op policy's checks, so no worker runs it. The call fails here,
    naming it, before anything is sent (it failed with an unrelated CUDAGuardImpl error)."""
    raise NotImplementedError(
        "torch.cuda.jiterator is not supported on gpupool remote GPUs: a worker does not "
        "compile or run CUDA source from a program; write the function with torch ops"
    )


ACCELERATOR_REPLACEMENTS["_cuda_jiterator_compile_and_launch_kernel"] = _jiterator

_ORIGINALS_C: dict[str, Any] = {}


def install() -> None:
    if _ORIGINALS:
        return
    for name, replacement in REPLACEMENTS.items():
        _ORIGINALS[name] = getattr(torch.cuda, name, None)
        setattr(torch.cuda, name, replacement)
    for name, replacement in ACCELERATOR_REPLACEMENTS.items():
        _ORIGINALS_C[name] = getattr(torch._C, name, None)
        setattr(torch._C, name, replacement)
    streams.install()


def uninstall() -> None:
    streams.uninstall()
    for name, original in _ORIGINALS.items():
        if original is None:
            delattr(torch.cuda, name)
        else:
            setattr(torch.cuda, name, original)
    _ORIGINALS.clear()
    for name, original in _ORIGINALS_C.items():
        if original is None:
            delattr(torch._C, name)
        else:
            setattr(torch._C, name, original)
    _ORIGINALS_C.clear()
