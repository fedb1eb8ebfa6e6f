"""`gpupool k8s serve`: the scheduler extender and the admission webhook in one HTTP(S) server.

Both are stateless fronts of the controller, so one Deployment serves both; the API server
calls the webhook over HTTPS only, hence --tls-cert/--tls-key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gpupool.client.sdk import ApiError, ControllerUnreachable, PoolClient
from gpupool.k8s.extender import Extender
from gpupool.k8s.kube import KubeApi, KubeError
from gpupool.k8s.webhook import WebhookSettings, review

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeSettings:
    controller_url: str
    kube_api: str | None = None
    """None: the API server of the cluster this runs in (service account)."""
    host: str = "0.0.0.0"
    port: int = 8443
    tls_cert: str | None = None
    tls_key: str | None = None
    sweep_interval_s: float = 10.0
    admit_timeout_s: float = 300.0
    webhook: WebhookSettings = field(default_factory=WebhookSettings)


def create_app(settings: ServeSettings, pool: PoolClient, kube: KubeApi) -> FastAPI:
    extender = Extender(pool, kube, settings.admit_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        sweeper = asyncio.create_task(_sweep_forever(extender, settings.sweep_interval_s, stop))
        try:
            yield
        finally:
            stop.set()
            await sweeper
            await kube.close()

    app = FastAPI(title="gpupool Kubernetes extender and webhook", lifespan=lifespan)
    app.state.extender = extender

    async def body_of(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"Error": "body is not JSON"}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"Error": "body must be a JSON object"}, status_code=400)
        return body

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/extender/filter")
    async def filter_(request: Request) -> Any:
        body = await body_of(request)
        return body if isinstance(body, JSONResponse) else await extender.filter(body)

    @app.post("/extender/prioritize")
    async def prioritize(request: Request) -> Any:
        body = await body_of(request)
        return body if isinstance(body, JSONResponse) else await extender.prioritize(body)

    @app.post("/extender/bind")
    async def bind(request: Request) -> Any:
        body = await body_of(request)
        return body if isinstance(body, JSONResponse) else await extender.bind(body)

    @app.post("/webhook/mutate")
    async def mutate(request: Request) -> Any:
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        if body.get("kind") != "AdmissionReview" or not isinstance(body.get("request"), dict):
            return JSONResponse({"error": "expected an AdmissionReview"}, status_code=400)
        return review(body, settings.webhook)

    return app


async def _sweep_forever(extender: Extender, interval_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await extender.sweep()
        except (ApiError, ControllerUnreachable, KubeError) as exc:
            log.warning("claims sweep: %s; trying again in %gs", exc, interval_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


def serve(settings: ServeSettings) -> None:
    """Run until SIGINT/SIGTERM; the entry point of `gpupool k8s serve`."""
    import uvicorn

    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    kube = KubeApi(settings.kube_api) if settings.kube_api else KubeApi.in_cluster()
    pool = PoolClient(settings.controller_url, actor="k8s-extender")
    app = create_app(settings, pool, kube)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        ssl_certfile=settings.tls_cert,
        ssl_keyfile=settings.tls_key,
        log_level="warning",
    )
