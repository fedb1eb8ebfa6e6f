"""Runs the controller under uvicorn."""

from __future__ import annotations

import faulthandler
import gc
import logging
import sys

import uvicorn

from gpupool.controller.app import create_app
from gpupool.controller.settings import ControllerSettings


def serve(settings: ControllerSettings) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # A fault no Python code can catch (SIGBUS when SQLite's shared-memory file is made
    # read-only under its mapping, SIGSEGV) must not end the process silently: the log
    # gets the fatal error and every thread's stack, and the exit status is non-zero.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    app = create_app(settings)
    # Every request makes short-lived objects by the thousand; collecting the old generation
    # less often keeps tail latency flat, and freezing start-up objects takes them out of it.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        ssl_certfile=str(settings.tls_cert) if settings.tls_cert else None,
        ssl_keyfile=str(settings.tls_key) if settings.tls_key else None,
    )
    server = uvicorn.Server(config)

    def stop_for(_reason: str) -> None:
        server.should_exit = True  # read by uvicorn's main loop: a clean shutdown follows

    app.state.on_fatal = stop_for
    server.run()
    store = getattr(app.state, "store", None)
    fatal = getattr(store, "fatal", None)
    if fatal is not None:
        raise SystemExit(f"gpupool controller stopped: {fatal}")
