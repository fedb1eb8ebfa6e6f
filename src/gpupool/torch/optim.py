"""The optimizers' fast paths (foreach, fused) for remote tensors.

PyTorch takes them only for listed tensor types, and groups tensors by their C++ device
(`gpupool:N` for a RemoteTensor): here each group is keyed by the device the program sees
(`cuda:N`), so a step of a model spread over cuda:0 and cuda:1 sends one foreach op to each.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from gpupool.torch.tensor import RemoteTensor

_TYPE_LISTS = ("torch.optim.optimizer", "torch.utils._foreach_utils")
_ORIGINAL_GROUP: Any = None


def _group_by_device_and_dtype(tensorlistlist: Any, with_indices: bool = False) -> Any:
    groups = _ORIGINAL_GROUP(tensorlistlist, with_indices)
    refined: dict[Any, Any] = {}
    for (device, dtype), (lists, indices) in groups.items():
        first = lists[0] if lists else []
        if not first or not isinstance(first[0], RemoteTensor):
            refined[(device, dtype)] = (lists, indices)
            continue
        positions: dict[torch.device, list[int]] = {}
        for position, tensor in enumerate(first):
            positions.setdefault(tensor.device, []).append(position)
        for remote_device, picked in positions.items():
            sub_lists = [
                [tensors[p] for p in picked] if len(tensors) == len(first) else tensors
                for tensors in lists
            ]
            sub_indices = [indices[p] for p in picked] if with_indices and indices else indices
            refined[(remote_device, dtype)] = (sub_lists, sub_indices)
    return refined


def install() -> None:
    global _ORIGINAL_GROUP
    for module_name in _TYPE_LISTS:
        types = getattr(importlib.import_module(module_name), "_foreach_supported_types", None)
        if types is not None and RemoteTensor not in types:
            types.append(RemoteTensor)
    if _ORIGINAL_GROUP is None:
        _ORIGINAL_GROUP = torch._C._group_tensors_by_device_and_dtype
        torch._C._group_tensors_by_device_and_dtype = _group_by_device_and_dtype  # type: ignore[assignment]


def uninstall() -> None:
    global _ORIGINAL_GROUP
    for module_name in _TYPE_LISTS:
        types = getattr(importlib.import_module(module_name), "_foreach_supported_types", None)
        if types is not None and RemoteTensor in types:
            types.remove(RemoteTensor)
    if _ORIGINAL_GROUP is not None:
        torch._C._group_tensors_by_device_and_dtype = _ORIGINAL_GROUP
        _ORIGINAL_GROUP = None
