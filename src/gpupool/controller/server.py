"""Runs the controller under uvicorn."""

from __future__ import annotations

import gc
import logging

import uvicorn

from gpupool.controller.app import create_app
from gpupool.controller.settings import ControllerSettings


def serve(settings: ControllerSettings) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(settings)
    # Every request makes short-lived objects by the thousand; collecting the old generation
    # less often keeps tail latency flat, and freezing start-up objects takes them out of it.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        ssl_certfile=str(settings.tls_cert) if settings.tls_cert else None,
        ssl_keyfile=str(settings.tls_key) if settings.tls_key else None,
    )
