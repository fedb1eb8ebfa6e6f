"""Python SDK of the controller's REST API `/api/v1`: one method per endpoint, typed answers."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar
from urllib.parse import quote, urlsplit
from uuid import uuid4

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from gpupool.client import config
from gpupool.protocol.failover import DEFAULT_BUDGET_S as DEFAULT_FAILOVER_S
from gpupool.protocol.failover import FailoverTransport, split_urls
from gpupool.protocol.tls import CA_ENV, tls_verify
from gpupool.protocol.v1.api import (
    EventOut,
    GpuIsolate,
    GpuModeSet,
    GpuOut,
    HaOut,
    LeaseCreate,
    LeaseHeartbeat,
    LeaseMigrate,
    LeaseOut,
    LeaseResize,
    NodeHeartbeat,
    NodeOut,
    NodeRegister,
    PoolSummary,
    QueueEntryOut,
    TenantCreate,
    TenantOut,
    TenantUpdate,
    TokenCreate,
    TokenCreated,
    TokenOut,
    WhoAmI,
)
from gpupool.protocol.v1.k8s import (
    ClaimAllocate,
    ClaimCreate,
    ClaimOut,
    PlacementAnswer,
    PlacementQuery,
    PreemptionAnswer,
    PreemptionQuery,
)

DEFAULT_URL = "http://127.0.0.1:8900"
URL_ENV = "GPUPOOL_URL"
API_PREFIX = "/api/v1"
ACTOR_HEADER = "X-Gpupool-Actor"
TOKEN_ENV = "GPUPOOL_TOKEN"
TOKEN_FILE_ENV = "GPUPOOL_TOKEN_FILE"
LOCAL_ADMIN_TOKEN = Path(".gpupool") / "admin.token"
USER_TOKEN = Path("~/.config/gpupool/token")

_Model = TypeVar("_Model", bound=BaseModel)
_Params = Mapping[str, str | int | float | None]


class ApiError(Exception):
    """The controller answered a request with an error (4xx or 5xx)."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(f"{detail} ({code}, HTTP {status})")
        self.status = status
        self.code = code
        self.detail = detail

    @property
    def is_client_error(self) -> bool:
        return 400 <= self.status < 500


class LeaseFailed(Exception):
    """A lease ended before its holder could use it, or its workers did not start."""

    def __init__(self, lease_id: str, reason: str) -> None:
        super().__init__(reason)
        self.lease_id = lease_id
        self.reason = reason


class ControllerUnreachable(Exception):
    """No answer from the controller: not running, wrong URL, or the network is down."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(
            f"cannot reach the gpupool controller at {url} ({reason}); is it running? "
            f"Start one with `gpupool up`, or point to it with --url or {URL_ENV}"
        )
        self.url = url
        self.reason = reason


def resolve_url(url: str | None = None) -> str:
    """The controller's base URL: the argument, else $GPUPOOL_URL, else the current context's
    (`gpupool context`), else the local default.

    Several controllers of one pool (high availability) are given comma-separated; each is
    normalised and the list comes back comma-joined, ready for `PoolClient` or a child's
    environment. Raises ValueError for a value that names no controller (`,`), and
    `ConfigError` (a ValueError) for a config file that cannot be read.
    """
    chosen = url or os.environ.get(URL_ENV)
    if not chosen:
        context = config.current()
        chosen = context.url if context is not None else DEFAULT_URL
    return ",".join(split_urls(chosen))


def resolve_token(url: str, token: str | None = None) -> str | None:
    """The API token to send: the argument, else $GPUPOOL_TOKEN, else the file named by
    $GPUPOOL_TOKEN_FILE, else the token file of the context of `url` (`gpupool up` records
    its admin token there), else ~/.config/gpupool/token, else, for a controller on this
    machine, the admin token `gpupool up` wrote to ./.gpupool/admin.token."""
    if token:
        return token.strip()
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    candidates = []
    if os.environ.get(TOKEN_FILE_ENV):
        candidates.append(Path(os.environ[TOKEN_FILE_ENV]))
    try:
        context = config.context_for(url)
    except config.ConfigError:
        context = None  # resolve_url has said so already where the context mattered
    if context is not None and context.token_file is not None:
        candidates.append(context.token_file)
    candidates.append(USER_TOKEN.expanduser())
    host = urlsplit(url).hostname or ""
    if host in ("127.0.0.1", "localhost", "::1"):
        candidates.append(LOCAL_ADMIN_TOKEN)
    for path in candidates:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return None


SEGMENT_MAX = 256
"""No id or name of the API is longer (lease ids 32, names 128): a longer one names nothing."""


def _q(segment: str) -> str:
    """Quote one path segment: names and ids are user input (of any length: a 120 kB id
    would make a URL no HTTP client sends, so it is answered here as what it is, not found)."""
    if len(segment) > SEGMENT_MAX:
        raise ApiError(
            404,
            "not_found",
            f"no such id or name: {segment[:20]}... is {len(segment)} characters long, and "
            f"none is longer than {SEGMENT_MAX}",
        )
    return quote(segment, safe="")


def _error_detail(body: object) -> tuple[str | None, str | None]:
    """Read `{"error", "detail"}`, and FastAPI's own `{"detail": [...]}` for validation errors."""
    if not isinstance(body, dict):
        return None, None
    code = body.get("error")
    detail = body.get("detail")
    if isinstance(detail, list):
        parts = []
        for item in detail[:3]:
            if isinstance(item, dict):
                where = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
                parts.append(f"{where}: {item.get('msg', '')}" if where else str(item.get("msg")))
            else:
                parts.append(str(item))
        detail = "; ".join(parts)
    return (
        str(code) if code is not None else None,
        str(detail) if detail is not None else None,
    )


def _unreachable_reason(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectTimeout):
        return "connection timed out"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    if isinstance(exc, httpx.ConnectError):
        text = str(exc)
        if "CERTIFICATE_VERIFY_FAILED" in text:
            return f"its TLS certificate is not trusted here; give its CA with {CA_ENV}=ca.pem"
        if "refused" in text.lower() or not text:
            return "connection refused"
        return text
    return str(exc) or type(exc).__name__


class PoolClient:
    """A synchronous client of one controller, or of several of one pool (high availability).

    Every method returns the API's pydantic models and raises `ApiError` for an error
    answer or `ControllerUnreachable` when no answer comes. Given comma-separated URLs, a
    request moves on to the next controller while one is down or does not lead, for up to
    `failover_s` seconds.
    """

    def __init__(
        self,
        url: str | None = None,
        actor: str | None = None,
        timeout: float = 10,
        transport: httpx.BaseTransport | None = None,
        token: str | None = None,
        failover_s: float = DEFAULT_FAILOVER_S,
    ) -> None:
        self.url = resolve_url(url)
        self.urls = split_urls(self.url)
        self.actor = actor
        headers = {ACTOR_HEADER: actor} if actor else {}
        self.token = resolve_token(self.url, token)
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if len(self.urls) > 1:
            # Several controllers: the request moves on while one is down or does not lead.
            transport = FailoverTransport(self.urls, transport, budget_s=failover_s)
        self._http = httpx.Client(
            base_url=self.urls[0] + API_PREFIX,
            headers=headers,
            timeout=timeout,
            transport=transport,
            verify=tls_verify(),
        )

    # ---- plumbing ------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _request(
        self,
        method: str,
        path: str,
        body: BaseModel | None = None,
        params: _Params | None = None,
        only_set: bool = False,
    ) -> Any:
        """Send one request; `only_set` sends just the fields the caller set (for PATCH)."""
        content = body.model_dump_json(exclude_unset=only_set) if body is not None else None
        query = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self._http.request(
                method,
                path,
                content=content,
                params=query,
                headers={"Content-Type": "application/json"} if content is not None else None,
            )
        except httpx.TransportError as exc:
            raise ControllerUnreachable(self.url, _unreachable_reason(exc)) from exc
        except httpx.InvalidURL as exc:
            raise ApiError(400, "invalid_request", f"cannot send this request: {exc}") from None
        return self._answer(response)

    @staticmethod
    def _answer(response: httpx.Response) -> Any:
        try:
            body: Any = response.json() if response.content else None
        except ValueError:
            body = None
        if response.status_code >= 400:
            code, detail = _error_detail(body)
            raise ApiError(
                response.status_code,
                code or ("http_error" if response.status_code >= 500 else "bad_request"),
                detail or response.reason_phrase or response.text[:200] or "no detail",
            )
        return body

    def _one(self, model: type[_Model], data: Any) -> _Model:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise ApiError(
                502, "bad_answer", f"controller answered an unexpected {model.__name__}: {exc}"
            ) from exc

    def _many(self, model: type[_Model], data: Any) -> list[_Model]:
        try:
            return TypeAdapter(list[model]).validate_python(data)  # type: ignore[valid-type]
        except ValidationError as exc:
            raise ApiError(
                502, "bad_answer", f"controller answered an unexpected {model.__name__} list: {exc}"
            ) from exc

    # ---- pool ----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """`{"status", "version", "db", "simulated"}`."""
        data = self._request("GET", "/health")
        return dict(data) if isinstance(data, dict) else {"status": str(data)}

    def pool(self) -> PoolSummary:
        return self._one(PoolSummary, self._request("GET", "/pool"))

    def ha(self) -> HaOut:
        """Which controller leads the pool, and the state of the others."""
        return self._one(HaOut, self._request("GET", "/ha"))

    # ---- nodes ---------------------------------------------------------------------------

    def register_node(self, node: NodeRegister) -> NodeOut:
        return self._one(NodeOut, self._request("POST", "/nodes", node))

    def heartbeat_node(self, name: str, beat: NodeHeartbeat) -> Any:
        return self._request("POST", f"/nodes/{_q(name)}/heartbeat", beat)

    def nodes(self) -> list[NodeOut]:
        return self._many(NodeOut, self._request("GET", "/nodes"))

    def node(self, name: str) -> NodeOut:
        return self._one(NodeOut, self._request("GET", f"/nodes/{_q(name)}"))

    def remove_node(self, name: str) -> None:
        self._request("DELETE", f"/nodes/{_q(name)}")

    # ---- GPUs ----------------------------------------------------------------------------

    def gpus(self, node: str | None = None, mode: str | None = None) -> list[GpuOut]:
        data = self._request("GET", "/gpus", params={"node": node, "mode": mode})
        return self._many(GpuOut, data)

    def gpu(self, uuid: str) -> GpuOut:
        return self._one(GpuOut, self._request("GET", f"/gpus/{_q(uuid)}"))

    def set_gpu_mode(self, uuid: str, mode: Literal["virtual", "physical"]) -> GpuOut:
        body = GpuModeSet(mode=mode)
        return self._one(GpuOut, self._request("POST", f"/gpus/{_q(uuid)}/mode", body))

    def drain_gpu(self, uuid: str) -> GpuOut:
        return self._one(GpuOut, self._request("POST", f"/gpus/{_q(uuid)}/drain"))

    def isolate_gpu(self, uuid: str, reason: str) -> GpuOut:
        body = GpuIsolate(reason=reason)
        return self._one(GpuOut, self._request("POST", f"/gpus/{_q(uuid)}/isolate", body))

    def clear_gpu(self, uuid: str) -> GpuOut:
        return self._one(GpuOut, self._request("POST", f"/gpus/{_q(uuid)}/clear"))

    # ---- leases --------------------------------------------------------------------------

    def create_lease(self, request: LeaseCreate) -> LeaseOut:
        """Ask for a lease; it comes back `granted`, or `queued` with its queue position.

        Only the fields the caller set are sent: a tenant left out means "my token's tenant".
        The request carries a `request_id` (a fresh one unless the caller set it), so that
        sending it again after a lost answer returns the same lease.
        """
        if request.request_id is None:
            request = request.model_copy(update={"request_id": "r-" + uuid4().hex})
        return self._one(LeaseOut, self._request("POST", "/leases", request, only_set=True))

    def leases(
        self,
        state: str | None = None,
        tenant: str | None = None,
        gpu: str | None = None,
        node: str | None = None,
        limit: int | None = None,
    ) -> list[LeaseOut]:
        """Live leases by default; `state="all"` for every lease, ended ones included."""
        params = {"state": state, "tenant": tenant, "gpu": gpu, "node": node, "limit": limit}
        return self._many(LeaseOut, self._request("GET", "/leases", params=params))

    def lease(self, lease_id: str) -> LeaseOut:
        return self._one(LeaseOut, self._request("GET", f"/leases/{_q(lease_id)}"))

    def heartbeat_lease(self, lease_id: str, active: bool | None = None) -> LeaseOut:
        """Keep a lease (granted or queued) alive for another `ttl_s`."""
        body = LeaseHeartbeat(active=active)
        return self._one(LeaseOut, self._request("POST", f"/leases/{_q(lease_id)}/heartbeat", body))

    def release_lease(self, lease_id: str) -> LeaseOut:
        """Give a lease back (or cancel it while queued); releasing twice is harmless."""
        return self._one(LeaseOut, self._request("DELETE", f"/leases/{_q(lease_id)}"))

    def release_lease_as_operator(self, lease_id: str) -> LeaseOut:
        """Take a lease away from its holder; recorded as released by an operator."""
        return self._one(LeaseOut, self._request("POST", f"/leases/{_q(lease_id)}/release"))

    def migrate_lease(self, lease_id: str, to: str | None = None) -> LeaseOut:
        """Move a running remote lease to the GPU or node `to` (None: wherever has room)."""
        body = LeaseMigrate(to=to)
        return self._one(LeaseOut, self._request("POST", f"/leases/{_q(lease_id)}/migrate", body))

    def resize_lease(
        self, lease_id: str, compute_pct: int | None = None, memory: str | None = None
    ) -> LeaseOut:
        """Change a running remote lease's compute share (%) and memory (`40GiB`) live."""
        body = LeaseResize(compute_pct=compute_pct, memory=memory)
        return self._one(LeaseOut, self._request("POST", f"/leases/{_q(lease_id)}/resize", body))

    def drain_node(self, name: str) -> list[str]:
        """Stop new leases on a node and migrate its remote leases away; returns those."""
        answer = self._request("POST", f"/nodes/{_q(name)}/drain")
        return [str(x) for x in answer] if isinstance(answer, list) else []

    def undrain_node(self, name: str) -> None:
        self._request("POST", f"/nodes/{_q(name)}/undrain")

    def queue(self) -> list[QueueEntryOut]:
        return self._many(QueueEntryOut, self._request("GET", "/queue"))

    def wait_for_grant(
        self,
        lease_id: str,
        on_update: Callable[[LeaseOut], None] | None = None,
        timeout: float | None = None,
        poll_interval_s: float = 0.5,
        unreachable_grace_s: float = 30.0,
    ) -> LeaseOut:
        """Poll a queued lease until it leaves the queue, heartbeating it meanwhile.

        Returns the lease in its new state: usually `granted`, but `released` when it was
        cancelled while waiting (the caller decides what that means). Raises TimeoutError
        after `timeout` seconds, leaving the lease queued. A controller that does not answer
        (a restart) is retried for `unreachable_grace_s` before ControllerUnreachable.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        answered_at = time.monotonic()
        pause = poll_interval_s
        while True:
            try:
                lease = self.heartbeat_lease(lease_id)
            except ControllerUnreachable:
                if time.monotonic() - answered_at > unreachable_grace_s:
                    raise
            else:
                answered_at = time.monotonic()
                if on_update is not None:
                    on_update(lease)
                if lease.state != "queued":
                    return lease
                pause = min(poll_interval_s, max(lease.ttl_s / 3, 0.05))
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"lease {lease_id} still queued after {timeout:g} s")
            if deadline is not None:
                pause = max(0.0, min(pause, deadline - time.monotonic()))
            time.sleep(pause)

    def wait_for_workers(
        self,
        lease_id: str,
        timeout: float = 180.0,
        poll_interval_s: float = 0.1,
    ) -> LeaseOut:
        """Wait until the agents run a worker for every slice of a granted remote lease.

        Polled often: with a ready worker the endpoint is there a few milliseconds after the
        agent heard of the lease (`gpupool agent --ready-workers`), and each poll is one small
        request for the few seconds a start takes at most.

        Returns the lease with every slice's `endpoint` set, heartbeating it meanwhile. Raises
        LeaseFailed when the lease ended, a worker failed to start, or `timeout` passed. A
        controller that does not answer (a restart) is asked again until the deadline: the
        lease is in its database.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                lease = self.heartbeat_lease(lease_id)
            except ControllerUnreachable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(poll_interval_s)
                continue
            if lease.state not in ("granted", "active", "idle"):
                why = lease.release_reason or lease.state
                raise LeaseFailed(
                    lease_id, f"lease {lease_id} ended before its workers ran ({why})"
                )
            if all(piece.endpoint for piece in lease.slices):
                return lease
            errors = lease.activity.get("errors") or []
            if errors:
                raise LeaseFailed(
                    lease_id, f"the worker of lease {lease_id} did not start: {errors[0]}"
                )
            if time.monotonic() > deadline:
                raise LeaseFailed(
                    lease_id, f"the workers of lease {lease_id} did not start in {timeout:.0f} s"
                )
            time.sleep(poll_interval_s)

    # ---- tenants -------------------------------------------------------------------------

    def tenants(self) -> list[TenantOut]:
        return self._many(TenantOut, self._request("GET", "/tenants"))

    def tenant(self, name: str) -> TenantOut:
        return self._one(TenantOut, self._request("GET", f"/tenants/{_q(name)}"))

    def create_tenant(self, tenant: TenantCreate) -> TenantOut:
        return self._one(TenantOut, self._request("POST", "/tenants", tenant))

    def update_tenant(self, name: str, update: TenantUpdate) -> TenantOut:
        data = self._request("PATCH", f"/tenants/{_q(name)}", update, only_set=True)
        return self._one(TenantOut, data)

    def delete_tenant(self, name: str) -> None:
        self._request("DELETE", f"/tenants/{_q(name)}")

    # ---- tokens --------------------------------------------------------------------------

    def create_token(self, request: TokenCreate) -> TokenCreated:
        return self._one(TokenCreated, self._request("POST", "/tokens", request))

    def tokens(self, include_revoked: bool = False) -> list[TokenOut]:
        params = {"all": "true"} if include_revoked else None
        return self._many(TokenOut, self._request("GET", "/tokens", params=params))

    def revoke_token(self, token_id: str) -> TokenOut:
        return self._one(TokenOut, self._request("DELETE", f"/tokens/{_q(token_id)}"))

    def whoami(self) -> WhoAmI:
        return self._one(WhoAmI, self._request("GET", "/whoami"))

    # ---- events --------------------------------------------------------------------------

    def events(
        self,
        since_id: int | None = None,
        limit: int | None = None,
        kind: str | None = None,
        subject: str | None = None,
    ) -> list[EventOut]:
        params = {"since_id": since_id, "limit": limit, "kind": kind, "subject": subject}
        return self._many(EventOut, self._request("GET", "/events", params=params))

    # ---- Kubernetes (scheduler extender, device plugin) ------------------------------------

    def k8s_placement(self, query: PlacementQuery) -> PlacementAnswer:
        """Where a pod's request fits now among some nodes, and the node the pool prefers."""
        return self._one(PlacementAnswer, self._request("POST", "/k8s/placement", query))

    def k8s_preemption(self, query: PreemptionQuery) -> PreemptionAnswer:
        """Which claims on each node must end for a pod's request to fit there."""
        return self._one(PreemptionAnswer, self._request("POST", "/k8s/preemption", query))

    def create_claim(self, claim: ClaimCreate) -> ClaimOut:
        """Grant a pod's request on the node the scheduler chose, as the pod's claim."""
        return self._one(ClaimOut, self._request("POST", "/k8s/claims", claim))

    def claims(self, node: str | None = None) -> list[ClaimOut]:
        return self._many(ClaimOut, self._request("GET", "/k8s/claims", params={"node": node}))

    def claim(self, claim_id: str) -> ClaimOut:
        return self._one(ClaimOut, self._request("GET", f"/k8s/claims/{_q(claim_id)}"))

    def heartbeat_claim(self, claim_id: str) -> ClaimOut:
        """The claim's pod lives: keep its lease for another ttl."""
        data = self._request("POST", f"/k8s/claims/{_q(claim_id)}/heartbeat")
        return self._one(ClaimOut, data)

    def release_claim(self, claim_id: str) -> ClaimOut:
        return self._one(ClaimOut, self._request("DELETE", f"/k8s/claims/{_q(claim_id)}"))

    def pending_claim(self, node: str) -> ClaimOut:
        """The claim bound to `node` that no container got yet (ApiError 404 when none)."""
        return self._one(ClaimOut, self._request("GET", f"/k8s/nodes/{_q(node)}/pending"))

    def allocate_claim(self, node: str, request: ClaimAllocate) -> ClaimOut:
        """The claim waiting on `node` goes to the container the kubelet admits now."""
        data = self._request("POST", f"/k8s/nodes/{_q(node)}/allocate", request)
        return self._one(ClaimOut, data)


class LeaseKeeper:
    """Heartbeats one lease from a background thread until stopped or until the lease ends.

    `on_end(lease)` runs (on the keeper's thread) when the controller says the lease is no
    longer held (released, preempted, or unknown); `on_error(exc)` when a heartbeat got no
    answer — the keeper keeps trying, since the lease survives until its ttl runs out.

    With `expire_after_s` (the lease's ttl), a controller that has not answered for that long
    ends the lease here too: cut off from this holder, the controller released it by now and
    may grant its GPUs again, so the holder must stop using them (a fence, as with any lease).

    Heartbeats go at a fixed rate, each `interval_s` after the previous one was sent, not after
    it was answered; a heartbeat that failed is tried again after `retry_s`. A slow controller
    (a loaded server answering in seconds) then costs one late heartbeat, not the whole of an
    interval on top of the wait, which with three heartbeats a ttl let two slow answers in a row
    expire a lease whose holder was alive.
    """

    def __init__(
        self,
        url: str,
        lease_id: str,
        interval_s: float,
        actor: str | None = None,
        on_end: Callable[[LeaseOut | None, str], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
        token: str | None = None,
        expire_after_s: float | None = None,
        retry_s: float | None = None,
    ) -> None:
        self.lease_id = lease_id
        self.interval_s = interval_s
        self.retry_s = min(interval_s, 1.0) if retry_s is None else retry_s
        self.expire_after_s = expire_after_s
        self._client = PoolClient(
            url, actor=actor, timeout=max(1.0, min(10.0, interval_s)), token=token
        )
        self._on_end = on_end
        self._on_error = on_error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease_id}", daemon=True)
        self.ended: LeaseOut | None = None
        self.end_reason: str | None = None

    @classmethod
    def for_lease(
        cls,
        url: str,
        lease: LeaseOut,
        actor: str | None = None,
        on_end: Callable[[LeaseOut | None, str], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
        token: str | None = None,
    ) -> LeaseKeeper:
        """A keeper for a lease its holder must fence: four heartbeats per ttl (as the kubelet
        renews its node lease), and the lease ends here once the controller has not answered
        for a whole ttl."""
        return cls(
            url,
            lease.id,
            interval_s=max(lease.ttl_s / 4, 0.2),
            actor=actor,
            on_end=on_end,
            on_error=on_error,
            token=token,
            expire_after_s=lease.ttl_s,
        )

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=15)
        self._client.close()

    def _run(self) -> None:
        answered_at = time.monotonic()
        next_at = answered_at + self.interval_s
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            sent_at = time.monotonic()
            try:
                lease = self._client.heartbeat_lease(self.lease_id)
            except ApiError as exc:
                if exc.status == 404:
                    self._end(None, f"lease {self.lease_id} is unknown to the controller")
                    return
                self._report(exc)
                next_at = self._retry_at(sent_at)
                continue
            except ControllerUnreachable as exc:
                self._report(exc)
                next_at = self._retry_at(sent_at)
                silent_s = time.monotonic() - answered_at
                if self.expire_after_s is not None and silent_s > self.expire_after_s:
                    self._end(
                        None,
                        f"no answer from the controller for {silent_s:.0f} s, longer than the "
                        f"lease's ttl ({self.expire_after_s:g} s): the controller has released "
                        "it",
                    )
                    return
                continue
            answered_at = time.monotonic()
            next_at = sent_at + self.interval_s
            if lease.state in ("released", "preempted"):
                reason = lease.release_reason or lease.state
                self._end(lease, reason)
                return

    def _retry_at(self, sent_at: float) -> float:
        return min(sent_at + self.interval_s, time.monotonic() + self.retry_s)

    def _end(self, lease: LeaseOut | None, reason: str) -> None:
        self.ended = lease
        self.end_reason = reason
        if self._on_end is not None and not self._stop.is_set():
            self._on_end(lease, reason)

    def _report(self, exc: Exception) -> None:
        if self._on_error is not None:
            self._on_error(exc)
