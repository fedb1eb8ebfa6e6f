"""The few Kubernetes API calls gpupool makes: read, bind and list pods.

Credentials are a bearer token read from a file, as in-cluster clients do: the kubelet
rotates a pod's projected service-account token (by default about every 48 minutes of its
hour), so the file is read again whenever it changes, never once at start.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 10.0
MAX_TOKEN_BYTES = 64 * 1024


class KubeError(Exception):
    """The API server refused a call or could not be reached; the message says which."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status of the API server's refusal; None when it was not reached."""


class TokenFileAuth(httpx.Auth):
    """`Authorization: Bearer <the file's token>`, read again when the file changes.

    Projected tokens are replaced by an atomic symlink swap (the kubelet's `..data`), so the
    file's identity and modification time tell a new token from the old one.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._token = ""
        self._read()

    def _read(self) -> str:
        try:
            info = self.path.stat()
            seen = (info.st_ino, info.st_mtime_ns, info.st_size)
            if seen != self._seen:
                if info.st_size > MAX_TOKEN_BYTES:
                    raise KubeError(f"token file {self.path} is larger than 64 KiB")
                token = self.path.read_text().strip()
                if not token:
                    raise KubeError(f"token file {self.path} is empty")
                self._token, self._seen = token, seen
        except OSError as exc:
            raise KubeError(f"cannot read token file {self.path}: {exc.strerror}") from exc
        return self._token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self._read()}"
        yield request


@dataclass(frozen=True, slots=True)
class KubeCredentials:
    """Where the API server is and how to prove who we are to it."""

    url: str
    token_file: Path | None = None
    ca_file: Path | None = None
    """CA bundle that signed the API server's certificate; None: the system's CAs."""

    @classmethod
    def in_cluster(cls, environ: Mapping[str, str] = os.environ) -> KubeCredentials:
        """What every pod has: KUBERNETES_SERVICE_HOST/PORT, its service account's token and
        the cluster's CA, at /var/run/secrets/kubernetes.io/serviceaccount."""
        host = environ.get("KUBERNETES_SERVICE_HOST")
        port = environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubeError(
                "not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): give --kube-api URL"
            )
        token, ca = SERVICE_ACCOUNT / "token", SERVICE_ACCOUNT / "ca.crt"
        for path in (token, ca):
            if not path.is_file():
                raise KubeError(
                    f"in a pod without {path}: is automountServiceAccountToken false? "
                    "(give --kube-api and --kube-token-file instead)"
                )
        if ":" in host:
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", token, ca)


class KubeApi:
    """A client of the API server: in the cluster, with the pod's service account."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        ca_file: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        token_file: Path | None = None,
    ) -> None:
        if token and token_file is not None:
            raise ValueError("give a token or a token file, not both")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        auth = TokenFileAuth(token_file) if token_file is not None else None
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            auth=auth,
            verify=ssl.create_default_context(cafile=ca_file) if ca_file else True,
            timeout=TIMEOUT_S,
            transport=transport,
        )

    @classmethod
    def of(cls, credentials: KubeCredentials) -> KubeApi:
        ca = str(credentials.ca_file) if credentials.ca_file is not None else None
        return cls(credentials.url, ca_file=ca, token_file=credentials.token_file)

    @classmethod
    def in_cluster(cls) -> KubeApi:
        """From the environment every pod has: KUBERNETES_SERVICE_HOST/PORT and its token."""
        return cls.of(KubeCredentials.in_cluster())

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str | None = None,
        **params: str,
    ) -> Any:
        headers = {"Content-Type": content_type} if content_type else None
        try:
            response = await self._http.request(
                method, path, json=body, params=params or None, headers=headers
            )
        except httpx.TransportError as exc:
            raise KubeError(f"API server {self.url} unreachable: {exc}") from exc
        if response.is_error:
            try:
                message = response.json().get("message") or response.text
            except ValueError:
                message = response.text
            raise KubeError(
                f"{method} {path}: HTTP {response.status_code}: {message[:300]}",
                response.status_code,
            )
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

    async def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Secret, or None where there is none."""
        try:
            secret: dict[str, Any] = await self._call(
                "GET", f"/api/v1/namespaces/{quote(namespace)}/secrets/{quote(name)}"
            )
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        return secret

    async def create_secret(self, namespace: str, secret: dict[str, Any]) -> bool:
        """Create the Secret; False when one of its name exists already (it is not changed)."""
        try:
            await self._call("POST", f"/api/v1/namespaces/{quote(namespace)}/secrets", secret)
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def get_webhook_configuration(self, name: str) -> dict[str, Any]:
        path = f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{quote(name)}"
        config: dict[str, Any] = await self._call("GET", path)
        return config

    async def patch_webhook_configuration(self, name: str, patch: list[dict[str, Any]]) -> None:
        """Apply a JSON patch (RFC 6902) to the MutatingWebhookConfiguration."""
        path = f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{quote(name)}"
        await self._call("PATCH", path, patch, content_type="application/json-patch+json")
