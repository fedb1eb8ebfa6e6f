"""`gpupool k8s serve`: the scheduler extender and the admission webhook in one HTTP(S) server.

Both are stateless fronts of the controller, so one Deployment serves both; the API server
calls the webhook over HTTPS only, hence --tls-cert/--tls-key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gpupool.client.sdk import ApiError, ControllerUnreachable, PoolClient
from gpupool.k8s.callers import CallerCheck, Callers, peer_certificate_protocol
from gpupool.k8s.extender import Extender
from gpupool.k8s.kube import KubeApi, KubeCredentials, KubeError
from gpupool.k8s.payloads import (
    MalformedPayload,
    check_admission_review,
    check_binding_args,
    check_extender_args,
    check_preemption_args,
)
from gpupool.k8s.webhook import WebhookSettings, review
from gpupool.protocol.bodylimit import MIB, BodyLimit

DEFAULT_MAX_BODY_BYTES = 16 * MIB
"""The largest request `k8s serve` takes by default. The API server stores objects of at most
1.5 MiB (etcd) and takes request bodies of at most 3 MiB; an AdmissionReview of an UPDATE
carries the object twice (object, oldObject). ExtenderArgs with node names (the chart sets
nodeCacheCapable) are a Pod and a list of names. 16 MiB is more than twice the largest."""

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeSettings:
    controller_url: str
    kube: KubeCredentials | None = None
    """None: the API server of the cluster this runs in (its service account)."""
    host: str = "0.0.0.0"
    port: int = 8443
    tls_cert: str | None = None
    tls_key: str | None = None
    sweep_interval_s: float = 10.0
    admit_timeout_s: float = 300.0
    webhook: WebhookSettings = field(default_factory=WebhookSettings)
    callers: Callers = field(default_factory=Callers)
    """Who may call the extender and the webhook; the default admits no one."""
    client_ca: str | None = None
    """CA file whose client certificates the TLS handshake verifies (callers may then
    present one; which names each path accepts is in `callers`)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    webhook_configuration: str | None = None
    """MutatingWebhookConfiguration whose caBundle is set to `tls_ca` at start (the chart's
    CA is made in the cluster, so no rendered manifest can carry it)."""
    tls_ca: str | None = None


def create_app(settings: ServeSettings, pool: PoolClient, kube: KubeApi) -> FastAPI:
    extender = Extender(pool, kube, settings.admit_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        sweeper = asyncio.create_task(_sweep_forever(extender, settings.sweep_interval_s, stop))
        injector = None
        if settings.webhook_configuration and settings.tls_ca:
            injector = asyncio.create_task(
                _inject_until_done(kube, settings.webhook_configuration, settings.tls_ca, stop)
            )
        try:
            yield
        finally:
            stop.set()
            await sweeper
            if injector is not None:
                await injector
            await kube.close()

    # No /docs or /openapi.json: the only callers are the scheduler and the API server.
    app = FastAPI(
        title="gpupool Kubernetes extender and webhook",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.extender = extender
    app.add_middleware(
        BodyLimit,
        limit_bytes=settings.max_body_bytes,
        error_body=lambda code, detail: {"Error": detail, "error": code, "detail": detail},
    )
    # Outermost: a caller that is not admitted gets nothing else of the server.
    app.add_middleware(CallerCheck, callers=settings.callers)

    async def body_of(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _malformed("body is not JSON")
        if not isinstance(body, dict):
            return _malformed("body must be a JSON object")
        return body

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/extender/filter")
    async def filter_(request: Request) -> Any:
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            check_extender_args(body)
        except MalformedPayload as exc:
            return _malformed(f"ExtenderArgs: {exc}")
        return await extender.filter(body)

    @app.post("/extender/prioritize")
    async def prioritize(request: Request) -> Any:
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            check_extender_args(body)
        except MalformedPayload as exc:
            return _malformed(f"ExtenderArgs: {exc}")
        return await extender.prioritize(body)

    @app.post("/extender/preempt")
    async def preempt(request: Request) -> Any:
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            check_preemption_args(body)
        except MalformedPayload as exc:
            return _malformed(f"ExtenderPreemptionArgs: {exc}")
        return await extender.preempt(body)

    @app.post("/extender/bind")
    async def bind(request: Request) -> Any:
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            check_binding_args(body)
        except MalformedPayload as exc:
            return _malformed(f"ExtenderBindingArgs: {exc}")
        return await extender.bind(body)

    @app.post("/webhook/mutate")
    async def mutate(request: Request) -> Any:
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            check_admission_review(body)
        except MalformedPayload as exc:
            return _malformed(f"AdmissionReview: {exc}")
        return review(body, settings.webhook)

    return app


def _malformed(reason: str) -> JSONResponse:
    """400 with the reason, in the fields both callers read (`Error`: the scheduler's)."""
    log.info("refused a malformed payload: %s", reason)
    return JSONResponse(
        {"Error": reason, "error": "malformed_payload", "detail": reason}, status_code=400
    )


async def _sweep_forever(extender: Extender, interval_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await extender.sweep()
        except (ApiError, ControllerUnreachable, KubeError) as exc:
            log.warning("claims sweep: %s; trying again in %gs", exc, interval_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def _inject_until_done(
    kube: KubeApi, configuration: str, ca_file: str, stop: asyncio.Event
) -> None:
    """Set the webhooks' caBundle, retrying (the configuration may not exist yet)."""
    from pathlib import Path

    from gpupool.k8s.secrets import inject_ca_bundle

    delay_s = 1.0
    while not stop.is_set():
        try:
            ca = await asyncio.to_thread(Path(ca_file).read_bytes)
            changed = await inject_ca_bundle(kube, configuration, ca)
        except (KubeError, OSError) as exc:
            log.warning("caBundle of %s: %s; trying again in %gs", configuration, exc, delay_s)
        else:
            log.info("caBundle of %s: %d webhook(s) set", configuration, changed)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay_s)
        delay_s = min(delay_s * 2, 60.0)


def serve(settings: ServeSettings) -> None:
    """Run until SIGINT/SIGTERM; the entry point of `gpupool k8s serve`."""
    import uvicorn

    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    kube = KubeApi.of(settings.kube or KubeCredentials.in_cluster())
    pool = PoolClient(settings.controller_url, actor="k8s-extender")
    app = create_app(settings, pool, kube)
    for prefix, rule in settings.callers.rules.items():
        if rule.insecure:
            log.warning("%s* admits every caller (insecure, as its flag asked)", prefix)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        ssl_certfile=settings.tls_cert,
        ssl_keyfile=settings.tls_key,
        # Optional at the handshake, so that the kubelet's probe of /healthz (which has no
        # certificate) gets in; a certificate given must chain to the client CA, and the
        # protected paths want one (or a token): CallerCheck.
        ssl_ca_certs=settings.client_ca,
        ssl_cert_reqs=ssl.CERT_OPTIONAL if settings.client_ca else ssl.CERT_NONE,
        http=peer_certificate_protocol(),
        log_level="warning",
    )
