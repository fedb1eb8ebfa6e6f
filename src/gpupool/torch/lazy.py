"""Lazy acquisition: a program attached with `lazy=True` takes its lease at its first GPU op.

Until then it holds nothing: `torch.cuda.is_available()` and `device_count()` answer from the
request, and seeds wait for the streams. The first op that needs a worker asks the controller
for the lease, waits in the queue (one status line on stderr), waits for the workers, connects,
and goes on; from then on this process heartbeats the lease, and gives it back when it detaches
(at exit). A refusal (quota, a request no GPU of the pool can hold, a queue wait past
`max_wait_s`) raises `LeaseRefused` at that first op.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError

from gpupool.client.sdk import (
    ApiError,
    ControllerUnreachable,
    LeaseFailed,
    LeaseKeeper,
    PoolClient,
)
from gpupool.core.errors import InvalidRequest
from gpupool.protocol.v1.api import LeaseCreate, LeaseOut
from gpupool.torch.stream import AttachError, DeviceStream

LAZY_ENV = "GPUPOOL_LAZY"
"""The lease request (LeaseCreate as JSON) of a lazy attach, as `gpupool run --lazy` sets it."""
LAZY_TOKEN_ENV = "GPUPOOL_LAZY_TOKEN"
"""The API token that asks for the lease (the runner's own)."""
LAZY_LEASE_FILE_ENV = "GPUPOOL_LAZY_LEASE_FILE"
"""Where the program writes its lease's id once it has one, so that the runner can give it back
should the program die without doing so."""
DEFAULT_TTL_S = 30.0
WORKER_START_TIMEOUT_S = 180.0

OpenStreams = Callable[[str, list[str], str], list[DeviceStream]]


class LeaseRefused(AttachError):
    """The lease a lazy attach asked for at its first GPU op was refused or ended while queued.

    `code` is the controller's (`quota_exceeded`, `no_capacity`, ...) or `ended`/`unreachable`.
    """

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def lease_request(request: LeaseCreate | Mapping[str, Any] | None) -> LeaseCreate:
    """The remote lease to ask for: the caller's request, else $GPUPOOL_LAZY, else one GPU.

    A mapping takes LeaseCreate's fields (`compute` is accepted for `compute_pct`). Raises
    ValueError for a request the controller would refuse as malformed, or a physical one.
    """
    if request is None:
        text = os.environ.get(LAZY_ENV)
        try:
            request = json.loads(text) if text else {}
        except ValueError:
            raise ValueError(f"{LAZY_ENV} is not a JSON lease request: {text!r:.200}") from None
        if not isinstance(request, Mapping):
            raise ValueError(f"{LAZY_ENV} must be a JSON object, got {text!r:.200}")
    if isinstance(request, Mapping):
        fields = dict(request)
        if "compute" in fields:
            fields["compute_pct"] = fields.pop("compute")
        fields.setdefault("access", "remote")
        try:
            request = LeaseCreate.model_validate(fields)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:3]
            )
            raise ValueError(f"bad lazy lease request: {problems}") from None
        except InvalidRequest as exc:
            raise ValueError(f"bad lazy lease request: {exc.message}") from None
    if request.physical or request.access != "remote":
        raise ValueError(
            "lazy acquisition takes a remote lease (its GPUs are reached through workers); "
            "physical and direct leases are taken before the program starts"
        )
    updates: dict[str, Any] = {}
    if not request.holder:
        updates["holder"] = _holder()
    if request.ttl_s is None:
        updates["ttl_s"] = DEFAULT_TTL_S
    return request.model_copy(update=updates) if updates else request


def _holder() -> str:
    program = " ".join(sys.argv)[:160] or "python"
    return f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()}: {program} (lazy)"


class LazyLease:
    """A remote lease taken at the first GPU op (runtime.Pending), held until release()."""

    def __init__(
        self,
        request: LeaseCreate,
        open_streams: OpenStreams,
        url: str | None = None,
        api_token: str | None = None,
        lease_file: str | None = None,
        status: TextIO | None = None,
    ) -> None:
        self.request = request
        self._open = open_streams
        self.url = url
        self.api_token = api_token
        self.lease_file = Path(lease_file) if lease_file else None
        self._status = status if status is not None else sys.stderr
        self.lease: LeaseOut | None = None
        """The lease once acquired."""
        self.waited_s = 0.0
        """Time the first GPU op spent taking the lease (queue, workers, connecting)."""
        self._token = ""
        """The lease's data-plane token: only in the answer that made the lease."""
        self._keeper: LeaseKeeper | None = None
        self._lock = threading.Lock()

    @property
    def device_count(self) -> int:
        return self.request.gpus

    def acquire(self) -> list[DeviceStream]:
        started = time.monotonic()
        with PoolClient(self.url, token=self.api_token) as client:
            lease = self._create(client)
            try:
                if lease.state == "queued":
                    lease = self._queue(client, lease, started)
                if lease.state not in ("granted", "active", "idle"):
                    raise LeaseRefused(
                        f"gpupool: lease {lease.id} ended while queued "
                        f"({lease.release_reason or lease.state})",
                        "ended",
                    )
                lease = client.wait_for_workers(lease.id, timeout=WORKER_START_TIMEOUT_S)
                addresses = [piece.endpoint or "" for piece in lease.slices]
                streams = self._open(lease.id, addresses, self._token)
            except LeaseFailed as exc:
                self._give_back(client, lease.id)
                raise LeaseRefused(f"gpupool: {exc.reason}", "ended") from None
            except BaseException:
                # Interrupted while queued, or the workers refused: leave nothing queued.
                self._give_back(client, lease.id)
                raise
        self.lease = lease
        self.waited_s = time.monotonic() - started
        self._keeper = LeaseKeeper.for_lease(
            client.url, lease, token=self.api_token, on_end=self._lost
        ).start()
        return streams

    def _create(self, client: PoolClient) -> LeaseOut:
        try:
            lease = client.create_lease(self.request)
        except ApiError as exc:
            raise LeaseRefused(
                f"gpupool: the controller refused this program's lease: {exc.detail}", exc.code
            ) from None
        except ControllerUnreachable as exc:
            raise LeaseRefused(
                f"gpupool: no lease for this program: {exc}", "unreachable"
            ) from None
        self._token = lease.token or ""
        if self.lease_file is not None:
            with contextlib.suppress(OSError):
                self.lease_file.write_text(lease.id)
        return lease

    def _queue(self, client: PoolClient, lease: LeaseOut, started: float) -> LeaseOut:
        """Wait for the grant with one status line on stderr (rewritten in a terminal)."""
        terminal = self._status.isatty()
        shown: set[tuple[int | None, str | None]] = set()

        def show(now: LeaseOut) -> None:
            if now.state != "queued":
                return
            key = (now.queue_position, now.waiting_reason)
            if not terminal and key in shown:
                return
            shown.add(key)
            position = f"#{now.queue_position}" if now.queue_position is not None else "?"
            why = f" - {now.waiting_reason}" if now.waiting_reason else ""
            text = (
                f"gpupool: waiting for a GPU: lease {now.id} queued at position {position}, "
                f"{time.monotonic() - started:.0f}s{why}"
            )
            self._write(f"\r\x1b[K{text}" if terminal else text + "\n")

        show(lease)
        lease = client.wait_for_grant(lease.id, on_update=show)
        if lease.state in ("granted", "active", "idle"):
            done = f"gpupool: lease {lease.id} granted after {time.monotonic() - started:.1f}s"
            self._write(f"\r\x1b[K{done}\n" if terminal else done + "\n")
        elif terminal:
            self._write("\n")
        return lease

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._status.write(text)
            self._status.flush()

    def _lost(self, lease: LeaseOut | None, reason: str) -> None:
        """The keeper's news: the next op fails with WorkerLost, this line says why."""
        lease_id = self.lease.id if self.lease is not None else "?"
        self._write(f"gpupool: lease {lease_id} was taken away: {reason}\n")

    @staticmethod
    def _give_back(client: PoolClient, lease_id: str) -> None:
        with contextlib.suppress(ApiError, ControllerUnreachable):
            client.release_lease(lease_id)

    def release(self) -> None:
        with self._lock:
            keeper, self._keeper = self._keeper, None
            lease, self.lease = self.lease, None
        if keeper is not None:
            keeper.stop()
        if lease is not None:
            with PoolClient(self.url, token=self.api_token) as client:
                self._give_back(client, lease.id)
