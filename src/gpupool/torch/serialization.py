"""torch.save / torch.load with remote tensors, in PyTorch's own checkpoint format.

A saved remote tensor is an ordinary storage tagged `cuda:N`, so the checkpoint loads on a
real GPU without gpupool. Loading while attached puts `cuda:N` storages back on remote cuda:N
(map_location is honoured); tensors that shared a storage come back as separate copies.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

from gpupool.torch.tensor import RemoteTensor, bind_reduce

_ORIGINALS: dict[str, Any] = {}
_state = threading.local()


def reduce_remote(tensor: RemoteTensor, protocol: Any) -> Any:
    """Pickle a remote tensor as its host copy; inside torch.save the copy's storage is tagged
    with the remote device. A sparse COO tensor pickles as PyTorch pickles one: its indices
    and values (remote tensors themselves, so tagged alike) and how to rebuild it."""
    if tensor.layout == torch.sparse_coo:
        with torch.no_grad():
            parts = (tensor._indices(), tensor._values(), tensor.size(), tensor.is_coalesced())
        return (torch._utils._rebuild_sparse_tensor, (tensor.layout, parts))
    with torch.no_grad():
        host = tensor._gp.stream.read(tensor._gp.ext)
    saving: dict[int, tuple[int, torch.Tensor]] | None = getattr(_state, "saving", None)
    if saving is not None:
        saving[host.untyped_storage().data_ptr()] = (tensor._gp.stream.index, host)
    if getattr(tensor, "_is_param", False):
        return (
            torch._utils._rebuild_parameter,
            (host, tensor.requires_grad, collections.OrderedDict()),
        )
    if tensor.requires_grad:
        host.requires_grad_(True)
    return host.__reduce_ex__(protocol)


bind_reduce(reduce_remote)


def _tag(storage: Any) -> str | None:
    saving = getattr(_state, "saving", None)
    if not saving:
        return None
    entry = saving.get(storage.data_ptr())
    return None if entry is None else f"cuda:{entry[0]}"


def _never(storage: Any, location: str) -> None:
    return None


def save(obj: object, f: Any, *args: Any, **kwargs: Any) -> None:
    outer = getattr(_state, "saving", None)
    _state.saving = {} if outer is None else outer
    try:
        _ORIGINALS["save"](obj, f, *args, **kwargs)
    finally:
        if outer is None:
            _state.saving = None


def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
    if callable(map_location):
        return _ORIGINALS["load"](f, map_location, *args, **kwargs)
    remote: dict[int, int] = {}

    def restore(storage: Any, location: str) -> Any:
        target = _target(location, map_location)
        if target.type == "cuda":
            remote[storage.data_ptr()] = 0 if target.index is None else target.index
        return storage

    loaded = _ORIGINALS["load"](f, restore, *args, **kwargs)
    return _place(loaded, remote, {}) if remote else loaded


def _target(location: str, map_location: Any) -> torch.device:
    if isinstance(map_location, dict):
        location = map_location.get(location, location)
    elif map_location is not None:
        location = str(map_location)
    return torch.device(location)


def _place(value: Any, remote: dict[int, int], memo: dict[int, Any]) -> Any:
    if id(value) in memo:
        return memo[id(value)]
    placed: Any = value
    if isinstance(value, torch.Tensor) and not isinstance(value, RemoteTensor):
        # A sparse tensor was saved as its indices and values: where they were, it goes.
        held = value._values() if value.layout == torch.sparse_coo else value
        index = (
            remote.get(held.untyped_storage().data_ptr()) if value.device.type == "cpu" else None
        )
        if index is not None:
            with torch.no_grad():
                moved = value.to(torch.device("cuda", index))
            if isinstance(value, torch.nn.Parameter):
                placed = torch.nn.Parameter(moved, requires_grad=value.requires_grad)
            else:
                placed = moved.requires_grad_(value.requires_grad) if value.is_leaf else moved
    elif isinstance(value, torch.nn.Module):
        value._apply(lambda t: _place(t, remote, memo))
    elif isinstance(value, dict):
        memo[id(value)] = value  # in place: a state_dict keeps its _metadata
        for k, v in value.items():
            value[k] = _place(v, remote, memo)
    elif isinstance(value, list):
        placed = [_place(v, remote, memo) for v in value]
    elif isinstance(value, tuple) and type(value) is tuple:
        placed = tuple(_place(v, remote, memo) for v in value)
    memo[id(value)] = placed
    return placed


def install() -> None:
    if _ORIGINALS:
        return
    _ORIGINALS["save"], _ORIGINALS["load"] = torch.save, torch.load
    torch.save, torch.load = save, load
    if not getattr(torch.serialization, "_gpupool_tagger", False):
        torch.serialization.register_package(5, _tag, _never)
        torch.serialization._gpupool_tagger = True  # type: ignore[attr-defined]


def uninstall() -> None:
    if _ORIGINALS:
        torch.save, torch.load = _ORIGINALS["save"], _ORIGINALS["load"]
        _ORIGINALS.clear()
