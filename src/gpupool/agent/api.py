"""The agent's own HTTP API on loopback: its local view, and faults for simulated GPUs."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, HTTPException, Response
from pydantic import BaseModel, ConfigDict

from gpupool.agent import metrics

if TYPE_CHECKING:
    from gpupool.agent.service import Agent


class FaultIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int
    kind: Literal["xid", "ecc", "overheat", "lost", "clear"]
    value: float | None = None


def create_agent_app(agent: Agent) -> FastAPI:
    app = FastAPI(title="gpupool agent", docs_url=None, redoc_url=None)

    @app.get("/agent/v1/status")
    async def status() -> dict[str, Any]:
        backend = agent.backend
        return {
            "node": agent.settings.node_name,
            "backend": backend.name if backend else None,
            "simulated": bool(backend and backend.simulated),
            "registered": agent.registered,
            "controller_reachable": agent.controller_reachable,
            "faults_reported": agent.faults_reported,
            "mps": {
                uuid: {
                    "workers": agent.mps.pipe_dir(uuid),
                    "direct": agent.mps.direct_pipe_dir(uuid),
                }
                for uuid in agent.mps.daemons
            },
            "direct_watch": {
                "mode": agent.watch.mode.value,
                "socket": str(agent.settings.attach_path) if agent.attach_server else None,
                "attached": [{"pid": r.pid, "lease_id": r.lease_id} for r in agent.watch.roots()],
                "stopped": dict(agent.watch.stopped),
                "reported": dict(agent.watch.reported),
                "events": [
                    e.model_dump(mode="json", exclude_none=True)
                    for e in list(agent.watch.events)[-50:]
                ],
            },
            "ready_workers": _ready_status(agent),
            "health_events": [
                {"gpu_uuid": e.gpu_uuid, "kind": e.kind, "value": e.value, "message": e.message}
                for e in list(agent.health_events)[-50:]
            ],
        }

    @app.post("/agent/v1/wake", status_code=202)
    async def wake() -> dict[str, bool]:
        """The controller's word that a remote lease was granted here: heartbeat now, so its
        worker starts at once (at most one early heartbeat per WAKE_GAP_S, whoever asks)."""
        return {"heartbeat": agent.wake()}

    @app.get("/metrics")
    async def scrape() -> Response:
        view = await asyncio.to_thread(metrics.read_view, agent)
        return Response(metrics.exposition(view), media_type=metrics.CONTENT_TYPE)

    @app.post("/agent/v1/faults")
    async def inject(fault: FaultIn) -> dict[str, Any]:
        from gpupool.agent.backends import FakeBackend

        backend = agent.backend
        if not isinstance(backend, FakeBackend):
            raise HTTPException(409, "faults can be injected only into simulated GPUs")
        try:
            if fault.kind == "xid":
                event = backend.inject_xid(fault.index, int(fault.value or 79))
            elif fault.kind == "ecc":
                event = backend.inject_ecc(fault.index)
            elif fault.kind == "overheat":
                event = backend.inject_overheat(fault.index, fault.value or 95.0)
            elif fault.kind == "lost":
                event = backend.inject_lost(fault.index)
            else:
                backend.clear_faults(fault.index)
                return {"cleared": fault.index}
        except IndexError as exc:
            raise HTTPException(404, str(exc)) from None
        return {"gpu_uuid": event.gpu_uuid, "kind": event.kind, "message": event.message}

    return app


def _ready_status(agent: Agent) -> dict[str, Any]:
    """The ready pool: per GPU, workers ready now; the setting; what it has done."""
    workers = agent.workers
    if workers is None:
        return {"per_gpu": agent.settings.ready_per_gpu(agent.mps.enabled), "gpus": {}}
    pool = workers.ready
    return {
        "per_gpu": pool.per_gpu,
        "wanted": pool.wanted,
        "gpus": pool.counts(),
        "started": pool.started,
        "handed_over": pool.handed_over,
        "replaced": pool.replaced,
        "problem": pool.problem,
        "workers": workers.starts(),
    }
