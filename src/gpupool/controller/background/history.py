"""The watch loop: every second, measure the pool, keep the sample in the history and
evaluate the alert rules; tell the webhook when an alert fires or ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from gpupool.controller.services import history as histories
from gpupool.controller.services.watch import PoolWatch, tick
from gpupool.controller.store import Store

log = logging.getLogger("gpupool.controller")

TICK_S = 1.0
SAVE_EVERY_S = 60.0


async def run(store: Store, watch: PoolWatch, stop: asyncio.Event) -> None:
    sender = asyncio.create_task(watch.webhook.run(), name="alert-webhook")
    last_save = time.monotonic()
    try:
        while not stop.is_set():
            try:
                notices = await asyncio.to_thread(tick, store, watch, time.time())
                if store.leading:  # an HA standby judges alerts too, but only one sends them
                    watch.webhook.send(notices)
                if watch.history_file and time.monotonic() - last_save > SAVE_EVERY_S:
                    await asyncio.to_thread(histories.save, watch.history, watch.history_file)
                    last_save = time.monotonic()
            except Exception:
                log.exception("watching the pool failed; retrying")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=TICK_S)
    finally:
        await watch.webhook.drain()
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        if watch.history_file:
            try:
                await asyncio.to_thread(histories.save, watch.history, watch.history_file)
            except OSError as exc:
                log.warning("could not save the history: %s", exc)
