"""torch.cuda answered from the attached lease: availability, count, names, memory, seeds, sync."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import torch

from gpupool.torch import runtime
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


def mem_get_info(device: Any = None) -> tuple[int, int]:
    stream = runtime.stream(_index(device))
    stats = stream.stats()
    total = stats["memory_limit_bytes"] or stream.welcome.get("total_memory_bytes", 0)
    return int(total) - int(stats["memory_held_bytes"]), int(total)


def manual_seed(seed: int) -> None:
    if runtime.pending():  # torch.manual_seed at a program's top must not take the lease
        runtime.defer_seed(runtime.current_index(), int(seed))
        return
    runtime.stream().seed(int(seed))


def manual_seed_all(seed: int) -> None:
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
    "_maybe_exchange_device": _exchange_device,
    "get_device_name": get_device_name,
    "get_device_properties": get_device_properties,
    "get_device_capability": get_device_capability,
    "is_bf16_supported": is_bf16_supported,
    "synchronize": synchronize,
    "memory_allocated": memory_allocated,
    "max_memory_allocated": max_memory_allocated,
    "memory_reserved": memory_allocated,
    "max_memory_reserved": max_memory_allocated,
    "mem_get_info": mem_get_info,
    "empty_cache": _nothing,
    "reset_peak_memory_stats": _nothing,
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
    # Streams, events and graphs of the remote device are the worker's own.
    "Stream": _not_supported_class("Stream"),
    "Event": _not_supported_class("Event"),
    "stream": _not_supported("stream"),
    "current_stream": _not_supported("current_stream"),
    "default_stream": _not_supported("default_stream"),
    "CUDAGraph": _not_supported_class("CUDAGraph"),
    # Optimizers ask this before every step; no graph is ever captured on the client.
    "is_current_stream_capturing": lambda: False,
    "graph": _not_supported("graph"),
}


def install() -> None:
    if _ORIGINALS:
        return
    for name, replacement in REPLACEMENTS.items():
        _ORIGINALS[name] = getattr(torch.cuda, name, None)
        setattr(torch.cuda, name, replacement)


def uninstall() -> None:
    for name, original in _ORIGINALS.items():
        if original is None:
            delattr(torch.cuda, name)
        else:
            setattr(torch.cuda, name, original)
    _ORIGINALS.clear()
