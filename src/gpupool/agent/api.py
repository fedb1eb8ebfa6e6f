"""The agent's own HTTP API on loopback: its local view, and faults for simulated GPUs."""

from __future__ import annotations

import asyncio
from typing import Any, Literal, Protocol

from fastapi import FastAPI, HTTPException, Response
from pydantic import BaseModel, ConfigDict

from gpupool.agent import metrics
from gpupool.agent.backends import Backend
from gpupool.agent.metrics import AgentView


class ServedAgent(Protocol):
    """What the API serves of the agent (gpupool.agent.service.Agent, which starts the API)."""

    @property
    def backend(self) -> Backend | None: ...

    def status(self) -> dict[str, Any]:
        """The agent's local view, as /agent/v1/status answers it."""
        ...

    def wake(self) -> bool: ...

    def metrics_view(self) -> AgentView:
        """Blocks (the backend reads the GPUs): call it in a thread."""
        ...


class FaultIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int
    kind: Literal["xid", "ecc", "overheat", "lost", "clear"]
    value: float | None = None


def create_agent_app(agent: ServedAgent) -> FastAPI:
    app = FastAPI(title="gpupool agent", docs_url=None, redoc_url=None)

    @app.get("/agent/v1/status")
    async def status() -> dict[str, Any]:
        return agent.status()

    @app.post("/agent/v1/wake", status_code=202)
    async def wake() -> dict[str, bool]:
        """The controller's word that a remote lease was granted here: heartbeat now, so its
        worker starts at once (at most one early heartbeat per WAKE_GAP_S, whoever asks)."""
        return {"heartbeat": agent.wake()}

    @app.get("/metrics")
    async def scrape() -> Response:
        view = await asyncio.to_thread(agent.metrics_view)
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
