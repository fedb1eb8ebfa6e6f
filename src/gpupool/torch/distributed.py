"""torch.distributed on remote GPUs: a process group that forwards each collective into its
rank's op stream; the lease's workers run it among themselves.

    torchrun --nproc-per-node 2 train.py        # under gpupool run --remote --gpus 2
    dist.init_process_group("nccl")             # or "gloo", or no backend
    model = DDP(model.to(f"cuda:{local_rank}"), device_ids=[local_rank])

While a process is attached, `init_process_group` and `new_group` with backend "nccl",
"gloo", a "device:backend" list of those, or none, get the `gpupool` backend: a Python
`ProcessGroup` whose collectives on remote tensors become DIST records in the device's
stream (lazy, in order with the ops around them; the Work is done when the stream reaches
it, as an NCCL Work is once the current stream waits for it), and whose collectives on host
tensors run on a gloo group of the clients, as they would under "cpu:gloo". The workers form
the real group (gloo on CPU workers, NCCL on CUDA workers) through a rendezvous that only the
lease's workers reach: see `gpupool.worker.collectives`.
"""

from __future__ import annotations

import datetime
import functools
import os
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d_C
from torch._C._distributed_c10d import PrefixStore, ProcessGroup, Work
from torch.distributed import distributed_c10d as c10d

from gpupool.protocol.v1.dataplane import Rec
from gpupool.torch import runtime
from gpupool.torch.stream import DeviceStream
from gpupool.torch.tensor import RemoteTensor

TIMEOUT_S = float(os.environ.get("GPUPOOL_DIST_TIMEOUT_S", "600") or 600)
"""The longest a collective may wait on the workers (torch's default for a custom backend is
30 minutes): a worker that vanished without closing its connections (a host gone) fails every
rank's collective after this, or after the program's own timeout if shorter."""
BACKEND = "gpupool"
"""The backend's name in torch.distributed (also PrivateUse1's: the remote tensors' C++ device)."""
ASKED = frozenset({None, "", "nccl", "gloo", "cuda:nccl,cpu:gloo", "cpu:gloo,cuda:nccl"})
"""Backends a program asks for that mean "the GPUs": remote devices get the gpupool backend."""
ROOTED_VERSION = 2
"""The workers' DIST version that runs reduce, gather, scatter and all_to_all."""

_REDUCE_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}


class StreamWork(Work):
    """A collective placed in a device's stream: every later op of that device sees its
    result, so the program never waits for it (a read waits, as for any op)."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future


if TYPE_CHECKING:  # torch's stubs type the C++ overloads, not a Python group's methods
    _GroupBase = object
else:
    _GroupBase = ProcessGroup


class RemoteGroup(_GroupBase):
    """One rank's process group on a remote device (the rank's worker is a member of the
    workers' group of the same name); host tensors go to a gloo group of the clients."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank, self._size = rank, size
        self._group_name = self._group_desc = ""
        self.stream: DeviceStream = runtime.stream()
        if not self.stream.welcome.get("dist"):
            raise RuntimeError(
                f"the worker of {self.stream.device} takes no torch.distributed collectives "
                "(an older worker): upgrade the pool's agents"
            )
        self._cpu: Any = dist.ProcessGroupGloo(PrefixStore("cpu", store), rank, size, timeout)
        # Rank 0 names the group and says where its worker is: the workers' rendezvous store
        # lives there. The client store carries only these two names; the worker checks the
        # address is one of its lease's, and the lease's worker secret opens it.
        if rank == 0:
            store.set("gpupool/group", uuid.uuid4().hex)
            store.set("gpupool/host", str(self.stream.address))
        self.group_id = bytes(store.get("gpupool/group")).decode()
        host = bytes(store.get("gpupool/host")).decode()
        self.timeout_s = max(1.0, min(timeout.total_seconds(), TIMEOUT_S))
        body = {"rank": rank, "size": size, "host": host, "timeout_s": self.timeout_s}
        self.stream.emit([Rec.DIST, "init", self.group_id, body])
        self.stream.flush()  # the other ranks' workers wait for this one to join
        if self.stream.dist_rank is None:
            self.stream.dist_rank = rank
        _patch_fsdp()

    # ---- what torch asks of a group ----------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    # torch names a group after making it (a Python group keeps the names itself)
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    # ---- collectives ---------------------------------------------------------------------

    def _place(self, action: str, body: dict[str, Any], result: list[torch.Tensor]) -> StreamWork:
        self.stream.emit([Rec.DIST, action, self.group_id, body])
        self.stream.flush()  # the other ranks' workers may be waiting in this collective
        return StreamWork(result)

    def _on_remote(self, tensors: Sequence[torch.Tensor], what: str) -> bool:
        """True: all on this group's remote device; False: all host tensors; else an error."""
        remote = [isinstance(t, RemoteTensor) for t in tensors]
        if remote and all(remote):
            for t in tensors:
                if t._gp.stream is not self.stream:  # type: ignore[attr-defined]
                    raise ValueError(
                        f"{what}: a tensor on {t.device}, but this rank's process group is on "
                        f"{self.stream.device}"
                    )
            return True
        if any(remote):
            raise ValueError(f"{what}: tensors on a remote GPU and on the host in one collective")
        return False

    def _root(self, root: int, what: str) -> int:
        root = int(root)
        if not 0 <= root < self._size:
            raise ValueError(f"{what}: rank {root} is not in this group of {self._size}")
        return root

    def _needs_rooted(self, what: str) -> None:
        """An older worker would drop the stream on an action it does not know."""
        version = self.stream.welcome.get("dist")
        if not isinstance(version, int) or version < ROOTED_VERSION:
            raise RuntimeError(
                f"{what}: the worker of {self.stream.device} runs torch.distributed collectives "
                f"of version {version}, without {what} (an older worker): upgrade the pool's agents"
            )

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else _c10d_C.AllreduceOptions()
        if not self._on_remote(tensors, "all_reduce"):
            return self._cpu.allreduce(tensors, opts)
        op = _reduce_op(opts.reduceOp)
        for t in tensors:
            self._place("all_reduce", {"tensors": [_ext(t)], "op": op}, [t])
        return StreamWork(list(tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        if not self._on_remote(tensors, "all_reduce_coalesced"):
            return self._cpu.allreduce_coalesced(tensors, opts)
        options = _c10d_C.AllreduceOptions()
        if opts is not None:
            options.reduceOp = opts.reduceOp
        return self.allreduce(tensors, options)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else _c10d_C.BroadcastOptions()
        if not self._on_remote(tensors, "broadcast"):
            return self._cpu.broadcast(tensors, opts)
        for t in tensors:
            self._place("broadcast", {"tensors": [_ext(t)], "root": int(opts.rootRank)}, [t])
        return StreamWork(list(tensors))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """Every rank's tensor reduced into the root's; the others' are left undefined, as
        torch says of them."""
        opts = opts if opts is not None else _c10d_C.ReduceOptions()
        if not self._on_remote(tensors, "reduce"):
            return self._cpu.reduce(tensors, opts)
        if len(tensors) != 1:
            raise ValueError("reduce takes one tensor")
        self._needs_rooted("reduce")
        body = {
            "tensors": [_ext(tensors[0])],
            "root": self._root(opts.rootRank, "reduce"),
            "op": _reduce_op(opts.reduceOp),
        }
        return self._place("reduce", body, list(tensors))

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        opts = opts if opts is not None else _c10d_C.AllgatherOptions()
        flat = [t for group in outputs for t in group]
        if not self._on_remote([*flat, *inputs], "all_gather"):
            return self._cpu.allgather(outputs, inputs, opts)
        if len(outputs) != 1 or len(inputs) != 1:
            raise ValueError("all_gather takes one input tensor and one list of outputs")
        body = {"tensors": [_ext(inputs[0])], "outputs": [_ext(t) for t in outputs[0]]}
        return self._place("all_gather", body, outputs[0])

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """The root gets one output per rank; the other ranks pass none (torch hands them []
        or, with torchcomms, [[]])."""
        opts = opts if opts is not None else _c10d_C.GatherOptions()
        flat = [t for group in outputs for t in group]
        if not self._on_remote([*flat, *inputs], "gather"):
            return self._cpu.gather(outputs, inputs, opts)
        if len(inputs) != 1:
            raise ValueError("gather takes one input tensor")
        self._needs_rooted("gather")
        root = self._root(opts.rootRank, "gather")
        if self._rank == root:
            if len(outputs) != 1:
                raise ValueError("gather's root takes one list of outputs")
            _check_like(inputs[0], outputs[0], self._size, "gather")
        elif flat:
            raise ValueError(f"gather: only the root (rank {root}) takes output tensors")
        body = {"input": _ext(inputs[0]), "outputs": [_ext(t) for t in flat], "root": root}
        return self._place("gather", body, flat)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        """The root passes one input per rank; the other ranks pass none."""
        opts = opts if opts is not None else _c10d_C.ScatterOptions()
        flat = [t for group in inputs for t in group]
        if not self._on_remote([*outputs, *flat], "scatter"):
            return self._cpu.scatter(outputs, inputs, opts)
        if len(outputs) != 1:
            raise ValueError("scatter takes one output tensor")
        self._needs_rooted("scatter")
        root = self._root(opts.rootRank, "scatter")
        if self._rank == root:
            if len(inputs) != 1:
                raise ValueError("scatter's root takes one list of inputs")
            _check_like(outputs[0], inputs[0], self._size, "scatter")
        elif flat:
            raise ValueError(f"scatter: only the root (rank {root}) takes input tensors")
        body = {"output": _ext(outputs[0]), "inputs": [_ext(t) for t in flat], "root": root}
        return self._place("scatter", body, list(outputs))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else _c10d_C.AllgatherOptions()
        if not self._on_remote([output, input], "all_gather_into_tensor"):
            return self._cpu._allgather_base(output, input, opts)
        body = {"output": _ext(output), "input": _ext(input)}
        return self._place("all_gather_into_tensor", body, [output])

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        if not self._on_remote([*outputs, *inputs], "all_gather_into_tensor_coalesced"):
            return self._cpu.allgather_into_tensor_coalesced(outputs, inputs, opts)
        for output, given in zip(outputs, inputs, strict=True):
            self._allgather_base(output, given)
        return StreamWork(list(outputs))

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        opts = opts if opts is not None else _c10d_C.ReduceScatterOptions()
        flat = [t for group in inputs for t in group]
        if not self._on_remote([*outputs, *flat], "reduce_scatter"):
            return self._cpu.reduce_scatter(outputs, inputs, opts)
        if len(outputs) != 1 or len(inputs) != 1:
            raise ValueError("reduce_scatter takes one output tensor and one list of inputs")
        body = {
            "output": _ext(outputs[0]),
            "inputs": [_ext(t) for t in inputs[0]],
            "op": _reduce_op(opts.reduceOp),
        }
        return self._place("reduce_scatter", body, outputs)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        opts = opts if opts is not None else _c10d_C.ReduceScatterOptions()
        if not self._on_remote([output, input], "reduce_scatter_tensor"):
            return self._cpu._reduce_scatter_base(output, input, opts)
        body = {"output": _ext(output), "input": _ext(input), "op": _reduce_op(opts.reduceOp)}
        return self._place("reduce_scatter_tensor", body, [output])

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        if not self._on_remote([*outputs, *inputs], "reduce_scatter_tensor_coalesced"):
            return self._cpu.reduce_scatter_tensor_coalesced(outputs, inputs, opts)
        for output, given in zip(outputs, inputs, strict=True):
            self._reduce_scatter_base(output, given, opts)
        return StreamWork(list(outputs))

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: Any = None,
    ) -> Any:
        opts = opts if opts is not None else _c10d_C.AllToAllOptions()
        if not self._on_remote([output, input], "all_to_all_single"):
            return self._cpu.alltoall_base(output, input, output_splits, input_splits, opts)
        body = {
            "output": _ext(output),
            "input": _ext(input),
            "output_splits": [int(s) for s in output_splits],
            "input_splits": [int(s) for s in input_splits],
        }
        return self._place("all_to_all_single", body, [output])

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """Input i goes to rank i, output i comes from rank i (sizes may differ per rank)."""
        opts = opts if opts is not None else _c10d_C.AllToAllOptions()
        if not self._on_remote([*outputs, *inputs], "all_to_all"):
            return self._cpu.alltoall(outputs, inputs, opts)
        if len(outputs) != self._size or len(inputs) != self._size:
            raise ValueError(
                f"all_to_all takes {self._size} inputs and {self._size} outputs, one per rank"
            )
        self._needs_rooted("all_to_all")
        if any(t.dtype != inputs[0].dtype for t in [*outputs, *inputs]):
            raise ValueError("all_to_all: the inputs and outputs have one dtype")
        body = {"outputs": [_ext(t) for t in outputs], "inputs": [_ext(t) for t in inputs]}
        return self._place("all_to_all", body, list(outputs))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        if not self._on_remote(tensors, "send"):
            return self._cpu.send(tensors, dst, tag)
        body = {"tensors": [_ext(t) for t in tensors], "peer": int(dst), "tag": int(tag)}
        return self._place("send", body, list(tensors))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        if not self._on_remote(tensors, "recv"):
            return self._cpu.recv(tensors, src, tag)
        body = {"tensors": [_ext(t) for t in tensors], "peer": int(src), "tag": int(tag)}
        return self._place("recv", body, list(tensors))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        """`recv(t)` without a source. NCCL has no receive from any source, and the program
        learns the sender from the Work at once, while the worker would know it only when its
        stream got there: on remote tensors this fails at the call, rather than hang."""
        if not self._on_remote(tensors, "recv"):
            return self._cpu.recv_anysource(tensors, tag)
        raise NotImplementedError(
            "recv from any source (src=None) does not run on remote GPUs: NCCL has none, "
            "and the sender would be known only when the worker's stream reaches the receive; "
            "name the sender: dist.recv(tensor, src=rank)"
        )

    # torch >= 2.13 calls these; older torch the underscored names
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def barrier(self, opts: Any = None) -> Any:
        """Every rank's host waits until every worker got here (and the ops before ran)."""
        self._place("barrier", {}, [])
        self.stream.sync()
        return StreamWork([])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        return self.barrier()

    def shutdown(self) -> None:
        if self.stream.open:
            self.stream.emit([Rec.DIST, "destroy", self.group_id, {}])
        self._cpu.shutdown()

    def abort(self) -> None:
        self.shutdown()


def _check_like(t: torch.Tensor, others: list[torch.Tensor], size: int, what: str) -> None:
    """A root's list: one tensor per rank, each of `t`'s dtype and shape (NCCL copies each
    rank's bytes by `t`'s size)."""
    if len(others) != size:
        raise ValueError(f"{what}: the root takes {size} tensors, one per rank, not {len(others)}")
    for other in others:
        if other.dtype != t.dtype or other.shape != t.shape:
            raise ValueError(
                f"{what}: the root's tensors are {t.dtype} of shape {list(t.shape)}, as the "
                f"rank's own; one is {other.dtype} of shape {list(other.shape)}"
            )


def _ext(t: torch.Tensor) -> Any:
    return t._gp.ext  # type: ignore[attr-defined]


def _reduce_op(op: Any) -> str:
    for value, name in _REDUCE_OPS.items():
        if op == value:
            return name
    raise ValueError(f"reduce op {op} is not supported on remote GPUs (PREMUL_SUM is not)")


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> RemoteGroup:
    return RemoteGroup(store, rank, size, timeout)


# ---- FSDP2's unsharded parameters ---------------------------------------------------------


def resize_storage(tensor: torch.Tensor, nbytes: int) -> None:
    """Free (0) or allocate again the worker's storage under `tensor`, keeping its shape."""
    tensor._gp.stream.emit([Rec.STORAGE, tensor._gp.ext, int(nbytes)])  # type: ignore[attr-defined]


def _patch_fsdp() -> None:
    """FSDP2 frees an unsharded parameter's storage after its forward and backward and
    allocates it again before the next all-gather (`storage.resize_`); a remote tensor's
    storage is on its worker, so these become STORAGE records there."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    except ImportError:  # another torch: FSDP2 is not there, nothing to follow
        return
    if getattr(_fsdp_param.free_storage, "__gpupool__", False):
        return
    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor: torch.Tensor) -> None:
        if isinstance(tensor, RemoteTensor):
            resize_storage(tensor, tensor.numel() * tensor.itemsize)
        else:
            alloc(tensor)

    def free_storage(tensor: torch.Tensor) -> None:
        if isinstance(tensor, RemoteTensor):
            resize_storage(tensor, 0)
        else:
            free(tensor)

    for function in (alloc_storage, free_storage):
        function.__gpupool__ = True  # type: ignore[attr-defined]
    _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc_storage, free_storage
    if getattr(_fsdp_param_group, "alloc_storage", None) is alloc:
        setattr(_fsdp_param_group, "alloc_storage", alloc_storage)  # noqa: B010 - no stub


# ---- installing ---------------------------------------------------------------------------

_originals: dict[str, Callable[..., Any]] = {}


def _translate(backend: Any) -> Any:
    """The program's backend, as it applies to remote devices."""
    if backend is None or (isinstance(backend, str) and backend.lower() in ASKED):
        return BACKEND
    return backend


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not runtime.attached():
            return original(*args, **kwargs)
        if original.__name__ == "init_process_group":
            backend = args[0] if args else kwargs.pop("backend", None)
            args = (_translate(backend), *args[1:])
            # Eager NCCL initialisation names a CUDA device: the workers' groups are formed
            # at init anyway.
            kwargs.pop("device_id", None)
        else:  # new_group(ranks=None, timeout=None, backend=None, ...)
            if len(args) >= 3:
                args = (*args[:2], _translate(args[2]), *args[3:])
            elif "backend" in kwargs:
                kwargs["backend"] = _translate(kwargs["backend"])
        return original(*args, **kwargs)

    return call


def install() -> None:
    """Register the backend (once per process: torch cannot unregister one) and route the
    program's GPU backends to it."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=[BACKEND])
    for name in ("init_process_group", "new_group"):
        if name in _originals:
            continue
        original = getattr(c10d, name)
        _originals[name] = original
        wrapped = _wrap(original)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)


def uninstall() -> None:
    for name, original in _originals.items():
        setattr(c10d, name, original)
        setattr(dist, name, original)
    _originals.clear()
