"""The reconcile loop: expire silent leases, mark silent nodes down (and, by policy, release
their leases), end preemptions whose grace is over, fail requests past the maximum wait,
rebalance the dual pool, serve the queue, and preempt for blocked higher-priority requests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from gpupool.controller.db import checkpoint
from gpupool.controller.services import gpus, leases, nodes
from gpupool.controller.services.events import record
from gpupool.controller.store import StorageUnavailable, Store, storage_reason

log = logging.getLogger("gpupool.controller")

FLUSH_EVERY_S = 5.0
CHECKPOINT_EVERY_S = 2.0


def reconcile_once(store: Store, session: Session) -> None:
    forgive_stall(store, session)
    leases.expire(store, session)
    nodes.mark_silent_down(store, session)
    nodes.release_lost(store, session)
    leases.end_preempted(store, session)
    leases.fail_overdue(store, session)
    gpus.rebalance(store, session)
    leases.serve(store, session)
    leases.preempt(store, session)


def forgive_stall(store: Store, session: Session) -> None:
    """After the loop stalled, every holder and node gets its timeout again before anything
    expires: a stall is treated like a restart (see Store.regrace)."""
    stall_s = store.stall_s(time.monotonic())
    if stall_s is None:
        return
    leases_n, nodes_n = store.regrace()
    message = (
        f"the controller did not run for {stall_s:.1f} s (its loop runs every "
        f"{store.settings.reconcile_interval_s:g} s): {leases_n} lease(s) and {nodes_n} "
        "node(s) get their heartbeat timeout again from now, as after a restart"
    )
    log.warning("%s", message)
    record(session, "controller", "controller.stalled", "controller", message, stall_s=stall_s)


async def run(store: Store, stop: asyncio.Event) -> None:
    last_flush = last_checkpoint = time.monotonic()
    while not stop.is_set():
        if time.monotonic() - last_checkpoint > CHECKPOINT_EVERY_S:
            try:
                await asyncio.to_thread(checkpoint, store.engine)
            except OperationalError as exc:
                log.warning("SQLite checkpoint failed (%s); retrying", storage_reason(exc))
            last_checkpoint = time.monotonic()
        try:
            await store.write(lambda s: reconcile_once(store, s))
            if time.monotonic() - last_flush > FLUSH_EVERY_S:
                await store.write(lambda s: nodes.flush_liveness(store, s))
                last_flush = time.monotonic()
        except StorageUnavailable as exc:
            # The store logged the fault when it began; once a round is enough here.
            log.debug("reconcile: %s", exc.message)
        except Exception:
            log.exception("reconcile failed; retrying")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=store.settings.reconcile_interval_s)
