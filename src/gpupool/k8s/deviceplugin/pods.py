"""The pods of the plugin's node that the kubelet may be admitting: what Allocate checks.

The kubelet's Allocate names devices, never the pod. The controller gives the claim waiting
on the node only when every pod there that asks for the resource and has not started holds
a claim of its own (services/k8s.py), so the plugin reads those pods from the API server.
"""

from __future__ import annotations

from typing import Any

from gpupool.k8s.kube import KubeApi, KubeError
from gpupool.k8s.pods import claim_of
from gpupool.protocol.v1.k8s import WaitingPod

NOT_STARTED = "Pending"


class PodsUnavailable(Exception):
    """The API server could not be asked; Allocate then gives nothing."""


def waiting_pods(pods: list[dict[str, Any]], resource: str) -> list[WaitingPod]:
    """Pods that ask for `resource` (a container's limit) and have not started."""
    waiting = []
    for pod in pods:
        if ((pod.get("status") or {}).get("phase") or NOT_STARTED) != NOT_STARTED:
            continue
        spec = pod.get("spec") or {}
        every = list(spec.get("containers") or []) + list(spec.get("initContainers") or [])
        if not any(resource in ((c.get("resources") or {}).get("limits") or {}) for c in every):
            continue
        meta = pod.get("metadata") or {}
        name = f"{meta.get('namespace', 'default')}/{meta.get('name', '?')}"
        waiting.append(WaitingPod(pod=name[:317], claim=_claim_label(pod)))
    return waiting


def _claim_label(pod: dict[str, Any]) -> str | None:
    claim = claim_of(pod)
    return claim[:63] if claim else None


class NodePods:
    """The node's pods, listed from the API server with the agent's service account."""

    def __init__(self, kube: KubeApi, node: str) -> None:
        self.kube = kube
        self.node = node

    async def waiting(self, resource: str) -> list[WaitingPod]:
        try:
            pods = await self.kube.pods_on_node(self.node)
        except KubeError as exc:
            raise PodsUnavailable(str(exc)) from exc
        return waiting_pods(pods, resource)

    async def close(self) -> None:
        await self.kube.close()
