"""The few Kubernetes API calls gpupool makes: read, bind and list pods."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 10.0


class KubeError(Exception):
    """The API server refused a call or could not be reached; the message says which."""


class KubeApi:
    """A client of the API server: in the cluster, with the pod's service account."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        ca_file: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            verify=ssl.create_default_context(cafile=ca_file) if ca_file else True,
            timeout=TIMEOUT_S,
            transport=transport,
        )

    @classmethod
    def in_cluster(cls) -> KubeApi:
        """From the environment every pod has: KUBERNETES_SERVICE_HOST/PORT and its token."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubeError(
                "not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): give --kube-api URL"
            )
        token = (SERVICE_ACCOUNT / "token").read_text().strip()
        if ":" in host:
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", token, str(SERVICE_ACCOUNT / "ca.crt"))

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, body: Any = None, **params: str) -> Any:
        try:
            response = await self._http.request(method, path, json=body, params=params or None)
        except httpx.TransportError as exc:
            raise KubeError(f"API server {self.url} unreachable: {exc}") from exc
        if response.is_error:
            try:
                message = response.json().get("message") or response.text
            except ValueError:
                message = response.text
            raise KubeError(f"{method} {path}: HTTP {response.status_code}: {message[:300]}")
        return response.json() if response.content else None

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod: dict[str, Any] = await self._call(
            "GET", f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(name)}"
        )
        return pod

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        """Bind the pod to the node (what the default binder does), naming its uid."""
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        await self._call(
            "POST", f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(name)}/binding", body
        )

    async def pods_on_node(self, node: str) -> list[dict[str, Any]]:
        """Every pod bound to `node` (the device plugin's view of its node)."""
        answer = await self._call("GET", "/api/v1/pods", fieldSelector=f"spec.nodeName={node}")
        return list((answer or {}).get("items") or [])

    async def pods_with_label(self, label: str) -> list[dict[str, Any]]:
        """Every pod, in any namespace, that carries `label`."""
        answer = await self._call("GET", "/api/v1/pods", labelSelector=label)
        return list((answer or {}).get("items") or [])
