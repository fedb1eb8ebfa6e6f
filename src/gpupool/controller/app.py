"""The controller's FastAPI application: routes under /api/v1, errors as clear 4xx bodies."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from gpupool import __version__
from gpupool.controller.background import history, reconcile
from gpupool.controller.db import make_engine, migrate
from gpupool.controller.routers import dashboard, gpus, leases, metrics, nodes, pool, tenants
from gpupool.controller.services.metrics import SchedulingTimer
from gpupool.controller.services.tenants import ensure_default
from gpupool.controller.services.watch import open_watch
from gpupool.controller.settings import ControllerSettings
from gpupool.controller.store import Store
from gpupool.core import PoolError
from gpupool.protocol.v1 import API_PREFIX
from gpupool.protocol.v1.api import ErrorOut, ValidationErrorOut

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorOut, "description": "Malformed request (the body is not JSON)"},
    403: {"model": ErrorOut, "description": "Refused by the tenant's quota"},
    404: {"model": ErrorOut, "description": "No such object"},
    409: {"model": ErrorOut, "description": "Conflicts with the pool's state"},
    422: {"model": ValidationErrorOut, "description": "Invalid request"},
}
"""What any route may answer besides its success, so the OpenAPI document says all of it."""


def open_store(settings: ControllerSettings) -> Store:
    engine = make_engine(settings.database_url())
    migrate(engine)
    store = Store(engine, settings)
    store.start()
    store.write_sync(lambda s: ensure_default(store, s))
    return store


def create_app(settings: ControllerSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = await asyncio.to_thread(open_store, settings)
        app.state.store = store
        stop = asyncio.Event()
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
    for module in (leases, gpus, nodes, tenants, pool, dashboard):
        app.include_router(module.router, prefix=API_PREFIX, responses=ERROR_RESPONSES)
    app.include_router(metrics.router, responses=ERROR_RESPONSES)
    app.include_router(dashboard.pages)
    app.add_middleware(SchedulingTimer)
    app.add_exception_handler(PoolError, _pool_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    return app


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
    return JSONResponse({"error": exc.code, "detail": exc.message}, status_code=exc.http_status)


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
