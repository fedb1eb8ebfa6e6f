"""The device plugin's questions to the controller, through the SDK's client."""

from __future__ import annotations

import asyncio

from gpupool.client.sdk import ApiError, ControllerUnreachable, PoolClient
from gpupool.k8s.deviceplugin.server import ClaimError
from gpupool.k8s.resources import ResourceKind
from gpupool.protocol.v1.k8s import ClaimAllocate, ClaimOut, WaitingPod


class ControllerClaims:
    """Claims of one node, asked of the controller (blocking calls run in threads)."""

    def __init__(self, client: PoolClient, node: str) -> None:
        self.client = client
        self.node = node

    async def allocate(
        self, kind: ResourceKind, devices: int, waiting: list[WaitingPod] | None
    ) -> ClaimOut:
        request = ClaimAllocate(resource=kind, devices=devices, waiting=waiting)
        try:
            return await asyncio.to_thread(self.client.allocate_claim, self.node, request)
        except (ApiError, ControllerUnreachable) as exc:
            raise ClaimError(str(exc)) from exc

    async def pending(self) -> ClaimOut | None:
        try:
            return await asyncio.to_thread(self.client.pending_claim, self.node)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise ClaimError(str(exc)) from exc
        except ControllerUnreachable as exc:
            raise ClaimError(str(exc)) from exc
