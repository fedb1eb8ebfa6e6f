"""The reconcile loop: expire silent leases, mark silent nodes down, serve the queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from sqlalchemy.orm import Session

from gpupool.controller.services import leases, nodes
from gpupool.controller.store import Store

log = logging.getLogger("gpupool.controller")

FLUSH_EVERY_S = 5.0


def reconcile_once(store: Store, session: Session) -> None:
    leases.expire(store, session)
    nodes.mark_silent_down(store, session)
    leases.serve(store, session)


async def run(store: Store, stop: asyncio.Event) -> None:
    last_flush = time.monotonic()
    while not stop.is_set():
        try:
            await store.write(lambda s: reconcile_once(store, s))
            if time.monotonic() - last_flush > FLUSH_EVERY_S:
                await store.write(lambda s: nodes.flush_liveness(store, s))
                last_flush = time.monotonic()
        except Exception:
            log.exception("reconcile failed; retrying")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=store.settings.reconcile_interval_s)
