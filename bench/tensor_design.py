"""Which C++ device a remote tensor's wrapper should have: the options, each tried on the idioms.

A remote tensor is a `__torch_dispatch__` wrapper subclass. PyTorch's C++ composites and
autograd formulas make new tensors with the *input's* options (its C++ device), without any
tensor argument a subclass could catch: `x[0] = 5` wraps 5 with x's options, the backward of
`clamp(a, b)` makes a zeros tensor like `a`. Each option below is a toy wrapper whose values
live in a CPU tensor (a simulated device, no worker), so only the design differs:

- `meta`: the C++ device is meta (gpupool until now). New tensors are plain meta tensors.
- `meta+factories`: the same, plus Python kernels for the Meta dispatch key's factories that
  make wrappers: composites work, but every `device="meta"` tensor of the program (model
  initialisation on meta, shape checks) becomes a device tensor.
- `privateuse1`: the C++ device is PrivateUse1, with a Python device guard
  (torch.utils.backend_registration) and the factory kernels registered for that key: every
  tensor made with a remote tensor's options goes through those kernels.
- `cuda`: the C++ device is cuda: on a CPU-only torch autograd aborts the process in
  AccumulateGrad's device guard (tried in a child process).

    python bench/tensor_design.py [--option privateuse1]   # one option per process

prints, per option, which idioms run with the values a CPU run gives, and the cost of one
dispatched op. Each option needs a process of its own (dispatch registrations and the
PrivateUse1 backend are process-wide), so without --option it runs each in a child.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

OPTIONS = ("meta", "meta+factories", "privateuse1", "cuda")


def idioms() -> dict[str, Callable[[Any, Any], Any]]:
    """name → fn(make, torch): make(host tensor) puts it on the device; fn returns host values."""
    import torch
    import torch.nn.functional as F

    def setitem(make: Any) -> Any:
        x = make(torch.arange(6.0).reshape(2, 3))
        x[0] = 5
        x[:, 0] = 7
        return x

    def mask_fill(make: Any) -> Any:
        x = make(torch.arange(6.0))
        x[x > 2] = 0
        return x

    def backward(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(make: Any) -> Any:
            a = make(torch.linspace(-2, 2, 7)).requires_grad_(True)
            fn(a).sum().backward()
            return a.grad

        return run

    return {
        "x[0] = 5; x[:, 0] = 7": setitem,
        "x[mask] = 0": mask_fill,
        "x[[0, 2]]": lambda make: make(torch.arange(6.0))[[0, 2]],
        "torch.where(m, 0.0, x)": lambda make: torch.where(
            make(torch.tensor([True, False])), 0.0, make(torch.tensor([1.0, 2.0]))
        ),
        "clamp(a, b) backward": backward(lambda a: a.clamp(-1, 1)),
        "prod backward": backward(lambda a: a.prod()),
        "pow(tensor) backward": backward(lambda a: a.pow(a.detach().abs())),
        "F.normalize backward": backward(lambda a: F.normalize(a.reshape(1, -1))),
        "torch.where backward": backward(lambda a: torch.where(a > 0, a, a * 2)),
        "cov": lambda make: torch.cov(make(torch.arange(6.0).reshape(2, 3))),
        "zeros(device=meta) stays a plain meta tensor": lambda make: torch.tensor(
            float(type(torch.zeros(2, device="meta")) is torch.Tensor)
        ),
    }


def build(option: str) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """(make: host tensor → device tensor, read: device tensor → host tensor) for an option."""
    import torch
    from torch.utils._pytree import tree_map

    device = {"meta": "meta", "meta+factories": "meta", "cuda": "cuda"}.get(option)
    if option == "privateuse1":
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend("gpsim")
        device = "gpsim"
    assert device is not None
    cxx_device = torch.device(device, 0) if device != "meta" else torch.device("meta")

    class Simulated(torch.Tensor):
        """A toy device tensor: the values in a CPU tensor (simulated, for this comparison)."""

        @staticmethod
        def __new__(cls, data: torch.Tensor) -> Any:
            t = torch.Tensor._make_wrapper_subclass(
                cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
                dtype=data.dtype, device=cxx_device, requires_grad=False,
            )  # fmt: skip
            t.data_ = data
            return t

        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            def unwrap(v: Any) -> Any:
                if isinstance(v, Simulated):
                    return v.data_
                if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                    raise RuntimeError(f"{func}: received a plain {v.device.type} tensor")
                if isinstance(v, torch.device):
                    return torch.device("cpu")
                return v

            out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
            if func is torch.ops.aten._local_scalar_dense.default:
                return out
            return tree_map(lambda v: Simulated(v) if isinstance(v, torch.Tensor) else v, out)

    def factory(op: Any) -> Any:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            kwargs["device"] = torch.device("cpu")
            return Simulated(op(*args, **kwargs))

        return kernel

    def copy_kernel(dst: Any, src: Any, non_blocking: bool = False) -> Any:
        source = src.data_ if isinstance(src, Simulated) else src
        dst.data_.copy_(source)
        return dst

    libraries = []
    key = {"meta+factories": "Meta", "privateuse1": "PrivateUse1"}.get(option)
    if key is not None:
        library = torch.library.Library("aten", "IMPL", key)
        for name, op in (
            ("empty.memory_format", torch.ops.aten.empty.memory_format),
            ("empty_strided", torch.ops.aten.empty_strided.default),
        ):
            library.impl(name, factory(op))
        if key == "PrivateUse1":
            # Host data turned into an index (`x[[0, 2]]`) is copied to the device with the
            # Python key excluded: the copy itself must be a kernel of the device's key.
            library.impl("copy_", copy_kernel)
        libraries.append(library)
    build.libraries = libraries  # type: ignore[attr-defined]  # kept alive

    def read(t: Any) -> Any:
        return t.data_.clone() if isinstance(t, Simulated) else t

    return Simulated, read


def run_option(option: str) -> dict[str, Any]:
    import torch

    make, read = build(option)
    results: dict[str, str] = {}
    for name, fn in idioms().items():
        try:
            expected = fn(lambda t: t.clone())
            actual = read(fn(make))
            torch.testing.assert_close(actual, expected, check_device=False, equal_nan=True)
            results[name] = "ok"
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    x = make(torch.ones(8))
    for _ in range(200):
        x = x + 1
    started = time.perf_counter()
    for _ in range(2000):
        x = x + 1
    per_op_us = (time.perf_counter() - started) / 2000 * 1e6
    return {"idioms": results, "toy_op_us": round(per_op_us, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--option", choices=OPTIONS)
    options = parser.parse_args()
    if options.option:
        print(json.dumps(run_option(options.option)))
        return
    for option in OPTIONS:
        child = subprocess.run(
            [sys.executable, __file__, "--option", option], capture_output=True, text=True
        )
        lines = child.stdout.strip().splitlines()
        if child.returncode or not lines:
            tail = (child.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{option}: the process died (exit {child.returncode}): {tail[:160]}")
            continue
        report = json.loads(lines[-1])
        ok = sum(v == "ok" for v in report["idioms"].values())
        print(f"{option}: {ok}/{len(report['idioms'])} idioms, toy op {report['toy_op_us']} us")
        for name, verdict in report["idioms"].items():
            print(f"    {name}: {verdict}")


if __name__ == "__main__":
    main()
