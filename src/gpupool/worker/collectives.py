"""torch.distributed among the workers of one lease: process groups whose collectives run in
each worker's op stream, worker to worker, never through the clients.

Each rank of a program attaches to one worker of the lease. The client's process group
(`gpupool.torch.distributed`) only places DIST records in its stream; the workers form the
real group among themselves: gloo on CPU workers, NCCL on CUDA workers. They meet through a
rendezvous store that rank 0's worker keeps and the others reach over the lease's peer path
(role `peer`, the lease's worker secret, which no tenant holds; only the endpoints the agents
named), so nothing of the rendezvous is open to the tenant network.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d_C
from torch._C._distributed_c10d import HashStore, PrefixStore, Store

from gpupool.protocol.v1.dataplane import (
    Connection,
    DataPlaneError,
    ErrorBody,
    ErrorKind,
    Kind,
    ProtocolError,
    parse_address,
)
from gpupool.worker.memory import NO_RESERVATION, MemoryLimit, Reservation
from gpupool.worker.transfer import dial_peer

log = logging.getLogger(__name__)


DEFAULT_TIMEOUT_S = 300.0
"""A collective (and the rendezvous) that has not finished in this long fails on every rank."""
MAX_TIMEOUT_S = 3600.0
MAX_GROUPS = 64
"""Process groups one worker keeps (its own, and the stores it hosts for others)."""
MAX_STORE_KEYS = 16384
MAX_STORE_VALUE_BYTES = 1 << 20
MAX_KEY_CHARS = 512
COLLECTIVES = frozenset(
    {
        "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
        "scatter", "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "barrier",
        "all_to_all_single", "all_to_all",
    }
)  # fmt: skip
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.AVG,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}


class CollectiveFailed(RuntimeError):
    """A collective or a group's rendezvous failed: a peer worker died or timed out."""


# ---- the rendezvous store ---------------------------------------------------------------


class HostedStores:
    """The rendezvous stores this worker keeps, one per process group whose rank 0 it serves.

    A store comes into being when it is first asked for, by this worker's own DIST init or by
    a peer that got there first. Only workers of the lease reach it (the peer role's secret);
    its size is bounded all the same."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()
        self.timeout_s = timeout_s

    def store(self, group: str) -> Store:
        _check_group(group)
        with self._lock:
            store = self._stores.get(group)
            if store is None:
                if len(self._stores) >= MAX_GROUPS:
                    raise ProtocolError(f"more than {MAX_GROUPS} process groups on one worker")
                store = HashStore()
                store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
                self._stores[group] = store
            return store

    def drop(self, group: str) -> None:
        with self._lock:
            self._stores.pop(group, None)

    def clear(self) -> None:
        with self._lock:
            self._stores.clear()

    def serve(self, conn: Connection, head: list[Any]) -> None:
        """One STORE request of a peer worker (its connection's thread): answer it."""
        if len(head) != 6 or not isinstance(head[1], int):
            raise ProtocolError("a STORE frame is [STORE, req, group, op, key, value]")
        _, req, group, op, key, value = head
        try:
            answer = self._answer(self.store(str(group)), op, key, value)
        except ProtocolError:
            raise
        except Exception as exc:  # a timeout or a bad value: the asking worker raises it
            body = ErrorBody(ErrorKind.OP, f"store {op}: {exc}", None, "RuntimeError")
            conn.send([Kind.ERROR, req, body.to_wire()])
            return
        conn.send([Kind.RESULT, req, answer])

    def _answer(self, store: Store, op: Any, key: Any, value: Any) -> Any:
        if op == "num_keys":
            return store.num_keys()
        keys = key if isinstance(key, list) else [key]
        if not keys or not all(isinstance(k, str) and len(k) <= MAX_KEY_CHARS for k in keys):
            raise ProtocolError("a store key is a string")
        if op == "set":
            _check_value(value)
            if store.num_keys() >= MAX_STORE_KEYS:
                raise ProtocolError(f"a rendezvous store holds at most {MAX_STORE_KEYS} keys")
            store.set(key, value)
            return None
        if op == "get":
            # wait first: get() would block with the timeout of the store, not the asker's.
            store.wait([key], _seconds(value))
            return bytes(store.get(key))
        if op == "add":
            if not isinstance(value, int):
                raise ProtocolError("store add takes an int")
            return int(store.add(key, value))
        if op == "check":
            return bool(store.check(keys))
        if op == "wait":
            store.wait(keys, _seconds(value))
            return None
        if op == "compare_set":
            if not isinstance(value, list) or len(value) != 2:
                raise ProtocolError("store compare_set takes [expected, desired]")
            for part in value:
                _check_value(part)
            return bytes(store.compare_set(key, value[0], value[1]))
        if op == "delete":
            return bool(store.delete_key(key))
        raise ProtocolError(f"unknown store op {op!r:.40}")


def _check_group(group: str) -> None:
    if not group or len(group) > 128 or not all(c.isalnum() or c in "-_." for c in group):
        raise ProtocolError("a process group's name is up to 128 letters, digits, '-_.'")


def _check_value(value: Any) -> None:
    if not isinstance(value, bytes) or len(value) > MAX_STORE_VALUE_BYTES:
        raise ProtocolError(f"a store value is bytes, at most {MAX_STORE_VALUE_BYTES}")


def _seconds(value: Any) -> datetime.timedelta:
    if not isinstance(value, int | float) or not 0 < value <= MAX_TIMEOUT_S:
        raise ProtocolError(f"a store wait takes 0 < seconds <= {MAX_TIMEOUT_S:g}")
    return datetime.timedelta(seconds=float(value))


class PeerStore(Store):
    """The rendezvous store of a group, kept by rank 0's worker, as torch's process groups use
    a store: each call one STORE request over a peer connection of its own."""

    def __init__(self, open_conn: Callable[[], Connection], group: str, timeout_s: float) -> None:
        super().__init__()
        self._open = open_conn
        self._conn: Connection | None = None
        self._group = group
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._requests = 0

    def _ask(self, op: str, key: Any, value: Any = None) -> Any:
        with self._lock:
            if self._conn is None:
                self._conn = self._open()
            self._requests += 1
            req = self._requests
            try:
                self._conn.send([Kind.STORE, req, self._group, op, key, value])
                head = self._conn.recv().head()
            except (DataPlaneError, OSError) as exc:
                self._conn.close()
                self._conn = None
                raise CollectiveFailed(f"the group's rendezvous store is gone: {exc}") from exc
        if head[0] == Kind.ERROR:
            raise CollectiveFailed(ErrorBody.from_wire(head[2] if len(head) > 2 else None).message)
        if head[0] != Kind.RESULT or head[1] != req:
            raise CollectiveFailed(f"the rendezvous store answered {head!r:.200}")
        return head[2]

    def set(self, key: str, value: Any) -> None:
        self._ask("set", key, bytes(value))

    def get(self, key: str) -> bytes:
        return bytes(self._ask("get", key, self._timeout_s))

    def add(self, key: str, value: int) -> int:
        return int(self._ask("add", key, int(value)))

    def check(self, keys: list[str]) -> bool:
        return bool(self._ask("check", list(keys)))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        self._ask("wait", list(keys), min(max(seconds, 0.001), MAX_TIMEOUT_S))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self._ask("compare_set", key, [bytes(expected), bytes(desired)]))

    def delete_key(self, key: str) -> bool:
        return bool(self._ask("delete", key))

    def num_keys(self) -> int:
        return int(self._ask("num_keys", ""))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def open_store_connection(address: str, lease: str, token: str) -> Connection:
    """A peer connection to the worker that keeps a group's store (an endpoint its agent
    named: the caller checks)."""
    return dial_peer(address, lease, token, CollectiveFailed, "the group's rank 0 worker")


# ---- the groups -------------------------------------------------------------------------


@dataclass
class Group:
    name: str
    rank: int
    size: int
    pg: Any
    timeout_s: float
    backend: str
    store: PeerStore | None = None
    held: Reservation = field(default_factory=lambda: NO_RESERVATION)
    """The group's communication buffers, charged to the lease (NCCL's, measured at init)."""


PeerCheck = Callable[[str], str]
"""The endpoint as its agent named it, or raises: only the lease's workers are reached."""


class Collectives:
    """This worker's process groups, and the collectives its stream runs on them."""

    def __init__(
        self,
        lease: str,
        device: torch.device,
        memory: MemoryLimit,
        token: str = "",
        own_address: str | None = None,
    ) -> None:
        self.lease = lease
        self.device = device
        self.memory = memory
        self.token = token
        self.own_address = own_address
        self.hosted = HostedStores()
        self.groups: dict[str, Group] = {}
        self.check_peer: PeerCheck | None = None

    # ---- joining -----------------------------------------------------------------------

    def init(self, name: str, body: dict[str, Any]) -> None:
        _check_group(name)
        rank, size, host = body.get("rank"), body.get("size"), body.get("host")
        timeout_s = body.get("timeout_s", DEFAULT_TIMEOUT_S)
        if not isinstance(size, int) or not 1 <= size <= 4096:
            raise ProtocolError("a group's size is 1 to 4096")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ProtocolError(f"a rank of a group of {size} is 0 to {size - 1}")
        if not isinstance(timeout_s, int | float) or not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ProtocolError(f"a group's timeout is 0 to {MAX_TIMEOUT_S:g} s")
        if name in self.groups:
            raise ProtocolError(f"this worker is in process group {name} already")
        if len(self.groups) >= MAX_GROUPS:
            raise ProtocolError(f"more than {MAX_GROUPS} process groups on one worker")
        timeout_s = float(timeout_s)
        store: Store
        peer_store: PeerStore | None = None
        if rank == 0:
            store = self.hosted.store(name)
        else:
            if not isinstance(host, str):
                raise ProtocolError("a group's rank > 0 needs the address of rank 0's worker")
            address = self._named(host)
            peer_store = PeerStore(
                lambda: open_store_connection(address, self.lease, self.token), name, timeout_s
            )
            store = peer_store
        prefixed = PrefixStore(f"gpupool/{name}", store)
        try:
            pg, backend, held = self._make_group(prefixed, rank, size, timeout_s)
        except Exception as exc:
            if peer_store is not None:
                peer_store.close()
            raise CollectiveFailed(
                f"lease {self.lease}: rank {rank} of {size} could not join process group "
                f"{name}: {_first_line(exc)}"
            ) from exc
        # The store object must outlive the group: torch calls back into it (pybind keeps
        # only the C++ half alive).
        self.groups[name] = Group(name, rank, size, pg, timeout_s, backend, peer_store, held)
        log.info("lease %s: rank %d of %d in group %s (%s)", self.lease, rank, size, name, backend)

    def _named(self, host: str) -> str:
        if self.check_peer is None:
            raise CollectiveFailed("this worker was started without its lease's peers")
        return self.check_peer(host)

    def _make_group(
        self, store: Store, rank: int, size: int, timeout_s: float
    ) -> tuple[Any, str, Reservation]:
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.device.type == "cuda":
            # Comm aborts surface as errors of the collective; the worker lives on.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            nccl = dist.ProcessGroupNCCL
            options = nccl.Options()
            options._timeout = timeout
            free_before = torch.cuda.mem_get_info(self.device)[0]
            pg = nccl(store, rank, size, options)
            # The communicator now, not at the first collective: its buffers are measured
            # and charged to the lease before any tensor of the program's depends on them.
            pg.eager_connect_single_device(self.device)
            torch.cuda.synchronize(self.device)
            used = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
            try:
                held = self.memory.hold_outside(used, "NCCL's buffers for the process group")
            except Exception:
                with contextlib.suppress(Exception):
                    pg.shutdown()
                raise
            return pg, "nccl", held
        gloo = dist.ProcessGroupGloo
        options = gloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [self._gloo_device()]
        return gloo(store, rank, size, options), "gloo", NO_RESERVATION

    def _gloo_device(self) -> Any:
        """gloo's endpoint on the interface the worker's own data-plane address is on (the
        one its peers reach), loopback for a worker on a Unix socket."""
        gloo = dist.ProcessGroupGloo
        interface = os.environ.get("GLOO_SOCKET_IFNAME")
        if interface:
            return gloo.create_device(interface=interface)
        host = "127.0.0.1"
        if self.own_address is not None:
            address = parse_address(self.own_address)
            if not address.is_unix and address.host not in ("", "0.0.0.0", "::"):
                host = address.host
        return gloo.create_device(hostname=host)

    def describe(self) -> dict[str, Any]:
        """The groups this worker is in, as its stats show them."""
        return {
            name: {
                "backend": g.backend,
                "rank": g.rank,
                "size": g.size,
                "held_bytes": g.held.nbytes,
                "timeout_s": g.timeout_s,
            }
            for name, g in self.groups.items()
        }

    def destroy(self, name: str) -> None:
        group = self.groups.pop(name, None)
        self.hosted.drop(name)
        if group is None:
            return
        with contextlib.suppress(Exception):
            group.pg.shutdown()
        if group.store is not None:
            group.store.close()
        group.held.release()

    def clear(self) -> None:
        """The client left: every group goes (its peers' collectives fail fast)."""
        for name in list(self.groups):
            self.destroy(name)
        self.hosted.clear()

    # ---- running ------------------------------------------------------------------------

    def run(self, action: str, name: str, body: dict[str, Any]) -> None:
        group = self.groups.get(name)
        if group is None:
            raise CollectiveFailed(f"{action}: this worker is in no process group {name}")
        # Past the limit, the lease's out-of-memory error (LimitExceeded) as it is.
        scratch = self._scratch(action, body)
        try:
            with scratch:
                self._run(group, action, body)
        except Exception as exc:
            raise CollectiveFailed(
                f"lease {self.lease}: {action} failed on rank {group.rank} of {group.size} "
                f"(process group {name}): {_first_line(exc)}"
            ) from exc

    def _scratch(self, action: str, body: dict[str, Any]) -> Reservation:
        """gloo's working buffers of a collective, charged to a CPU worker's lease while it
        runs: a buffer the size of its largest tensor, or one flat copy of its lists of
        tensors, which gloo makes for gather, all_gather, reduce_scatter and all_to_all. A CUDA
        worker's NCCL buffers are held by the group."""
        if self.device.type == "cuda":
            return NO_RESERVATION
        tensors = [t for t in _tensors(body) if isinstance(t, torch.Tensor)]
        largest = max((_nbytes(t) for t in tensors), default=0)
        listed = sum(
            _nbytes(t)
            for key in ("inputs", "outputs")
            if isinstance(body.get(key), list)
            for t in body[key]
            if isinstance(t, torch.Tensor)
        )
        return self.memory.hold_outside(max(largest, listed), f"the buffers of {action}")

    def _run(self, group: Group, action: str, body: dict[str, Any]) -> None:
        pg = group.pg
        gloo = group.backend == "gloo"
        tensors = _tensor_list(body.get("tensors", []))
        if action == "barrier":
            barrier = _c10d_C.BarrierOptions()
            barrier.timeout = datetime.timedelta(seconds=group.timeout_s)
            if not gloo:
                barrier.device_ids = [self.device.index or 0]
            _wait(pg.barrier(barrier))
            return
        if action == "all_reduce":
            op = _reduce_op(body.get("op"))
            average = gloo and op == dist.ReduceOp.AVG
            options = _c10d_C.AllreduceOptions()
            options.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM) if average else op
            with _dense(tensors) as dense:
                _wait(pg.allreduce(dense, options))
                if average:
                    for t in dense:
                        _average(t, group.size)
            return
        if action == "broadcast":
            broadcast = _c10d_C.BroadcastOptions()
            broadcast.rootRank = _rank(body.get("root"), group.size)
            with _dense(tensors) as dense:
                _wait(pg.broadcast(dense, broadcast))
            return
        if action == "reduce":
            self._reduce(group, tensors, body)
            return
        if action == "gather":
            self._gather(group, body)
            return
        if action == "scatter":
            self._scatter(group, body)
            return
        if action == "all_gather":
            outputs = _tensor_list(body.get("outputs", []))
            if len(outputs) != group.size or len(tensors) != 1:
                raise ValueError(f"all_gather takes one input and {group.size} outputs")
            with _dense(outputs) as dense:
                _wait(pg.allgather([dense], tensors_contiguous(tensors)))
            return
        if action == "all_gather_into_tensor":
            output, given = _one(body.get("output")), _one(body.get("input"))
            with _dense([output]) as dense:
                _wait(pg._allgather_base(dense[0], given.contiguous()))
            return
        if action in ("reduce_scatter", "reduce_scatter_tensor"):
            op = _reduce_op(body.get("op"))
            average = gloo and op == dist.ReduceOp.AVG
            scatter = _c10d_C.ReduceScatterOptions()
            scatter.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM) if average else op
            output = _one(body.get("output"))
            with _dense([output]) as dense:
                if action == "reduce_scatter":
                    inputs = _tensor_list(body.get("inputs", []))
                    if len(inputs) != group.size:
                        raise ValueError(f"reduce_scatter takes {group.size} inputs")
                    _wait(pg.reduce_scatter(dense, [tensors_contiguous(inputs)], scatter))
                else:
                    given = _one(body.get("input")).contiguous()
                    _wait(pg._reduce_scatter_base(dense[0], given, scatter))
                if average:
                    _average(dense[0], group.size)
            return
        if action == "all_to_all_single":
            output, given = _one(body.get("output")), _one(body.get("input"))
            out_splits = _sizes(body.get("output_splits"))
            in_splits = _sizes(body.get("input_splits"))
            with _dense([output]) as dense:
                _wait(
                    pg.alltoall_base(
                        dense[0],
                        given.contiguous(),
                        out_splits,
                        in_splits,
                        _c10d_C.AllToAllOptions(),
                    )
                )
            return
        if action == "all_to_all":
            outputs = _tensor_list(body.get("outputs", []))
            inputs = _tensor_list(body.get("inputs", []))
            if len(outputs) != group.size or len(inputs) != group.size:
                raise ValueError(f"all_to_all takes {group.size} inputs and {group.size} outputs")
            if any(t.dtype != inputs[0].dtype for t in [*outputs, *inputs]):
                raise ValueError("all_to_all's inputs and outputs have one dtype")
            with _dense(outputs) as dense:
                _wait(pg.alltoall(dense, tensors_contiguous(inputs), _c10d_C.AllToAllOptions()))
            return
        if action in ("send", "recv"):
            peer = _rank(body.get("peer"), group.size)
            tag = body.get("tag", 0)
            if not isinstance(tag, int):
                raise ProtocolError("a send or recv tag is an int")
            if action == "send":
                _wait(pg.send(tensors_contiguous(tensors), peer, tag))
            else:
                with _dense(tensors) as dense:
                    _wait(pg.recv(dense, peer, tag))
            return
        raise ProtocolError(f"unknown collective {action!r:.40}")

    def _reduce(self, group: Group, tensors: list[torch.Tensor], body: dict[str, Any]) -> None:
        """gloo has no AVG: a sum, and the root divides (as all_reduce does)."""
        if len(tensors) != 1:
            raise ValueError("reduce takes one tensor")
        op = _reduce_op(body.get("op"))
        average = group.backend == "gloo" and op == dist.ReduceOp.AVG
        options = _c10d_C.ReduceOptions()
        options.rootRank = _rank(body.get("root"), group.size)
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM) if average else op
        with _dense(tensors) as dense:
            _wait(group.pg.reduce(dense, options))
            if average and group.rank == options.rootRank:
                _average(dense[0], group.size)

    def _gather(self, group: Group, body: dict[str, Any]) -> None:
        """The root's outputs are checked against its own input: NCCL copies each rank's
        bytes into them by that size."""
        options = _c10d_C.GatherOptions()
        options.rootRank = _rank(body.get("root"), group.size)
        given = _one(body.get("input"))
        outputs = _rooted_list(group, options.rootRank, body.get("outputs"), given, "gather")
        with _dense(outputs) as dense:
            _wait(group.pg.gather([dense] if dense else [], [given.contiguous()], options))

    def _scatter(self, group: Group, body: dict[str, Any]) -> None:
        options = _c10d_C.ScatterOptions()
        options.rootRank = _rank(body.get("root"), group.size)
        output = _one(body.get("output"))
        inputs = _rooted_list(group, options.rootRank, body.get("inputs"), output, "scatter")
        with _dense([output]) as dense:
            given = [tensors_contiguous(inputs)] if inputs else []
            _wait(group.pg.scatter(dense, given, options))


def new_group_name() -> str:
    return uuid.uuid4().hex


def _wait(work: Any) -> None:
    """gloo: the host waits until the collective is done (it runs on host memory). NCCL: the
    worker's stream waits for it, in order with the ops after it; the host goes on."""
    work.wait()


def _average(t: torch.Tensor, size: int) -> None:
    if t.is_floating_point() or t.is_complex():
        t.div_(size)
    else:
        t.floor_divide_(size)


def _rooted_list(
    group: Group, root: int, value: Any, like: torch.Tensor, what: str
) -> list[torch.Tensor]:
    """The list only the root of a gather or scatter passes: one tensor per rank, each of
    `like`'s dtype and shape, on the root; none on the others."""
    tensors = _tensor_list([] if value is None else value)
    if group.rank != root:
        if tensors:
            raise ValueError(f"{what}: only the root (rank {root}) passes a list of tensors")
        return tensors
    if len(tensors) != group.size:
        raise ValueError(
            f"{what}: the root takes {group.size} tensors, one per rank, not {len(tensors)}"
        )
    for t in tensors:
        if t.dtype != like.dtype or t.shape != like.shape:
            raise ValueError(
                f"{what}: the root's tensors are {like.dtype} of shape {list(like.shape)}; "
                f"one is {t.dtype} of shape {list(t.shape)}"
            )
    return tensors


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(body: dict[str, Any]) -> list[Any]:
    found: list[Any] = []
    for key in ("tensors", "outputs", "inputs"):
        value = body.get(key)
        if isinstance(value, list):
            found.extend(value)
    for key in ("output", "input"):
        if key in body:
            found.append(body[key])
    return found


def _tensor_list(value: Any) -> list[torch.Tensor]:
    if not isinstance(value, list) or len(value) > 4096:
        raise ProtocolError("a collective's tensors are a list")
    return [_one(t) for t in value]


def _one(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(
            "a collective's tensor is not held by this worker (an op before it failed)"
        )
    return value


def tensors_contiguous(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous() for t in tensors]


@contextlib.contextmanager
def _dense(tensors: list[torch.Tensor]) -> Any:
    """Tensors a collective writes: contiguous ones as they are, others through a contiguous
    copy written back afterwards (gloo and NCCL take dense tensors only)."""
    dense = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    yield dense
    for original, written in zip(tensors, dense, strict=True):
        if written is not original:
            original.copy_(written)


def _reduce_op(name: Any) -> Any:
    op = _REDUCE_OPS.get(name) if isinstance(name, str) else None
    if op is None:
        raise ProtocolError(f"unknown reduce op {name!r:.40}")
    return op


def _rank(value: Any, size: int) -> int:
    if not isinstance(value, int) or not 0 <= value < size:
        raise ProtocolError(f"a rank of this group is 0 to {size - 1}")
    return value


def _sizes(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise ProtocolError("split sizes are a list of sizes")
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
