"""The controller's FastAPI application: routes under /api/v1, errors as clear 4xx bodies."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException

from gpupool import __version__
from gpupool.controller import ha
from gpupool.controller.background import history, reconcile
from gpupool.controller.db import make_engine, migrate
from gpupool.controller.routers import (
    dashboard,
    gpus,
    k8s,
    leases,
    metrics,
    nodes,
    pool,
    tenants,
    tokens,
)
from gpupool.controller.routers import ha as ha_routes
from gpupool.controller.services import auth
from gpupool.controller.services.metrics import SchedulingTimer
from gpupool.controller.services.tenants import ensure_default
from gpupool.controller.services.watch import open_watch
from gpupool.controller.settings import ControllerSettings
from gpupool.controller.store import StorageUnavailable, Store, storage_reason
from gpupool.core import PoolError
from gpupool.protocol.bodylimit import BodyLimit
from gpupool.protocol.v1 import API_PREFIX
from gpupool.protocol.v1.api import ErrorOut, ValidationErrorOut

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorOut, "description": "Malformed request (the body is not JSON)"},
    401: {"model": ErrorOut, "description": "No token, or one that is not valid"},
    403: {"model": ErrorOut, "description": "Not allowed for this token, or by the quota"},
    404: {"model": ErrorOut, "description": "No such object"},
    409: {"model": ErrorOut, "description": "Conflicts with the pool's state"},
    413: {"model": ErrorOut, "description": "The request body is over the size limit"},
    422: {"model": ValidationErrorOut, "description": "Invalid request"},
    503: {
        "model": ErrorOut,
        "description": "The database cannot take the change now (a storage fault), or a "
        "standby has no leader to forward it to; nothing was changed",
    },
}
"""What any route may answer besides its success, so the OpenAPI document says all of it."""

log = logging.getLogger(__name__)


def open_store(settings: ControllerSettings) -> Store:
    url = settings.database_url()
    if settings.ha and not url.startswith("postgresql"):
        raise ha.HaUnsupported(
            "high availability needs PostgreSQL shared by the controllers (--db postgresql://...)"
        )
    engine = make_engine(url, ha.engine_connect_args() if settings.ha else None)
    migrate(engine)
    store = Store(engine, settings)
    store.start()
    if not settings.ha:  # an HA controller does both when it takes the lead
        store.write_sync(lambda s: ensure_default(store, s))
        written = store.write_sync(
            lambda s: auth.bootstrap(s, settings.data_dir, settings.admin_token)
        )
        if written:
            log.warning("first admin token written to %s (readable by its owner only)", written)
    return store


def create_app(settings: ControllerSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = await asyncio.to_thread(open_store, settings)
        app.state.store = store
        store.on_fatal = getattr(app.state, "on_fatal", None)
        app.state.tokens = auth.TokenCache()
        stop = asyncio.Event()
        if settings.ha:
            app.state.ha = group = ha.Group(store, settings)
            loop_task = asyncio.create_task(
                group.run(stop, lambda until: reconcile.run(store, until))
            )
        else:
            app.state.ha = None
            loop_task = asyncio.create_task(reconcile.run(store, stop))
        app.state.watch = watch = await asyncio.to_thread(open_watch, store, settings)
        watch_task = asyncio.create_task(history.run(store, watch, stop))
        try:
            yield
        finally:
            stop.set()
            await loop_task
            await watch_task
            await asyncio.to_thread(store.stop)
            store.engine.dispose()

    app = FastAPI(
        title="gpupool",
        version=__version__,
        description="Pool every GPU of a cluster: slices or whole GPUs on demand.",
        lifespan=lifespan,
        openapi_url=f"{API_PREFIX}/openapi.json",
        docs_url=f"{API_PREFIX}/docs",
    )
    for module in (leases, gpus, nodes, tenants, pool, dashboard, tokens, ha_routes, k8s):
        app.include_router(module.router, prefix=API_PREFIX, responses=ERROR_RESPONSES)
    app.include_router(metrics.router, responses=ERROR_RESPONSES)
    app.include_router(dashboard.pages)
    app.add_middleware(SchedulingTimer)
    # Outermost: a standby forwards a write before anything else of it runs.
    app.add_middleware(ha.Standby, group=lambda: getattr(app.state, "ha", None))
    # Outside even that: an oversized body is refused before a standby would forward it.
    app.add_middleware(BodyLimit, limit_bytes=settings.max_body_bytes)
    app.add_exception_handler(PoolError, _pool_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(OperationalError, _storage_error)
    return app


async def _storage_error(request: Request, exc: Exception) -> JSONResponse:
    """A read (or the HA fence) that the database could not answer: 503 with the reason,
    rather than a 500 and a traceback; the writer's faults come as StorageUnavailable."""
    reason = storage_reason(exc)
    log.warning("%s %s: the database did not answer: %s", request.method, request.url.path, reason)
    error = StorageUnavailable(
        f"the controller's database cannot answer now ({reason}); try again shortly"
    )
    return JSONResponse({"error": error.code, "detail": error.message}, status_code=503)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (unknown path, wrong method, unreadable body) in our format."""
    assert isinstance(exc, HTTPException)
    code = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}.get(
        exc.status_code, "http_error"
    )
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        # Starlette names only the first route that matched the path; a client told to use
        # another method must see every method the path has (GET and DELETE on a lease).
        headers["Allow"] = ", ".join(_methods_of(request))
    return JSONResponse(
        {"error": code, "detail": str(exc.detail)}, status_code=exc.status_code, headers=headers
    )


def _methods_of(request: Request) -> list[str]:
    """Every method the OpenAPI document lists for the request's path."""
    app: FastAPI = request.app
    table: list[tuple[re.Pattern[str], list[str]]] | None = getattr(app.state, "methods", None)
    if table is None:
        table = [
            (
                re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(path)) + "$"),
                [method.upper() for method in operations],
            )
            for path, operations in app.openapi()["paths"].items()
        ]
        app.state.methods = table
    path = request.url.path
    return sorted({m for pattern, methods in table if pattern.match(path) for m in methods})


async def _pool_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, PoolError)
    headers = {"WWW-Authenticate": 'Bearer realm="gpupool"'} if exc.http_status == 401 else None
    return JSONResponse(
        {"error": exc.code, "detail": exc.message}, status_code=exc.http_status, headers=headers
    )


async def _validation_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first: dict[str, Any] = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = f"malformed JSON: {first.get('ctx', {}).get('error', 'cannot parse body')}"
        return JSONResponse({"error": "malformed_json", "detail": detail}, status_code=400)
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = str(first.get("msg", "invalid request"))
    message = message.removeprefix("Value error, ")
    detail = f"{where}: {message}" if where else message
    if len(errors) > 1:
        detail += f" (and {len(errors) - 1} more problem(s))"
    body = {"error": "invalid_request", "detail": detail, "problems": errors}
    # ASCII JSON (json.dumps escapes): the problems echo the input, which may hold text that is
    # not UTF-8 (a lone surrogate sent as `\\udXXX`); escaped, it answers instead of a 500.
    return Response(json.dumps(body, default=str), status_code=422, media_type="application/json")
