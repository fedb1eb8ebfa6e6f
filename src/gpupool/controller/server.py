"""Runs the controller under uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from gpupool.controller.app import create_app
from gpupool.controller.settings import ControllerSettings


def serve(settings: ControllerSettings) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
