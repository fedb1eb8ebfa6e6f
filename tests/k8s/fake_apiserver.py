"""A Kubernetes API server for tests: pods in memory, the binding subresource, label selectors.

Only what the extender calls, over a real HTTP socket on loopback.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

WEBHOOKS = ["apis", "admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations"]


class FakeApiServer:
    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.bindings: list[dict[str, Any]] = []
        self.refuse_bindings: str | None = None
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.webhook_configurations: dict[str, dict[str, Any]] = {}
        self.patches: list[tuple[str, str | None, Any]] = []
        """(path, Content-Type, body) of every PATCH."""
        self.authorizations: list[str | None] = []
        """The Authorization header of every request, in order."""
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                server.authorizations.append(self.headers.get("Authorization"))
                url = urlparse(self.path)
                parts = url.path.strip("/").split("/")
                with server.lock:
                    found = server._get_other(parts)
                    if found is not None:
                        self._send(*found)
                        return
                    if parts == ["api", "v1", "pods"]:
                        selector = parse_qs(url.query).get("labelSelector", [""])[0]
                        items = [p for p in server.pods.values() if _matches(p, selector)]
                        self._send(200, {"kind": "PodList", "apiVersion": "v1", "items": items})
                        return
                    if (
                        len(parts) == 6
                        and parts[:3] == ["api", "v1", "namespaces"]
                        and parts[4] == "pods"
                    ):
                        pod = server.pods.get((parts[3], parts[5]))
                        if pod is None:
                            self._send(
                                404, {"kind": "Status", "message": f'pods "{parts[5]}" not found'}
                            )
                        else:
                            self._send(200, pod)
                        return
                self._send(404, {"kind": "Status", "message": "not found"})

            def do_POST(self) -> None:
                server.authorizations.append(self.headers.get("Authorization"))
                parts = urlparse(self.path).path.strip("/").split("/")
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if len(parts) == 5 and parts[4] == "secrets":
                    with server.lock:
                        key = (parts[3], body["metadata"]["name"])
                        if key in server.secrets:
                            self._send(409, {"kind": "Status", "message": "already exists"})
                            return
                        server.secrets[key] = body
                    self._send(201, body)
                    return
                if len(parts) == 7 and parts[6] == "binding":
                    with server.lock:
                        pod = server.pods.get((parts[3], parts[5]))
                        if server.refuse_bindings:
                            self._send(409, {"kind": "Status", "message": server.refuse_bindings})
                            return
                        if pod is None:
                            self._send(404, {"kind": "Status", "message": "pod not found"})
                            return
                        if pod["spec"].get("nodeName"):
                            self._send(
                                409, {"kind": "Status", "message": "pod is already assigned"}
                            )
                            return
                        pod["spec"]["nodeName"] = body["target"]["name"]
                        server.bindings.append(body)
                    self._send(201, {"kind": "Status", "status": "Success"})
                    return
                self._send(404, {"kind": "Status", "message": "not found"})

            def do_PATCH(self) -> None:
                server.authorizations.append(self.headers.get("Authorization"))
                parts = urlparse(self.path).path.strip("/").split("/")
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with server.lock:
                    server.patches.append((self.path, self.headers.get("Content-Type"), body))
                    config = server.webhook_configurations.get(parts[-1])
                    if parts[:4] != WEBHOOKS or config is None:
                        self._send(404, {"kind": "Status", "message": "not found"})
                        return
                    for op in body:
                        assert op["op"] in ("add", "replace"), op
                        *parents, last = op["path"].strip("/").split("/")
                        target: Any = config
                        for part in parents:
                            target = target[int(part)] if isinstance(target, list) else target[part]
                        target[last] = op["value"]
                self._send(200, config)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self._thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    def start(self) -> FakeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    def _get_other(self, parts: list[str]) -> tuple[int, Any] | None:
        """Secrets and webhook configurations (GET); None for the pod paths."""
        if len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "secrets":
            secret = self.secrets.get((parts[3], parts[5]))
            if secret is None:
                return 404, {"kind": "Status", "message": f'secrets "{parts[5]}" not found'}
            return 200, secret
        if len(parts) == 5 and parts[:4] == WEBHOOKS:
            config = self.webhook_configurations.get(parts[4])
            return (200, config) if config else (404, {"kind": "Status", "message": "not found"})
        return None

    def add_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        with self.lock:
            self.pods[(meta.get("namespace", "default"), meta["name"])] = pod

    def set_phase(self, namespace: str, name: str, phase: str) -> None:
        with self.lock:
            self.pods[(namespace, name)].setdefault("status", {})["phase"] = phase

    def delete_pod(self, namespace: str, name: str) -> None:
        with self.lock:
            del self.pods[(namespace, name)]


def _matches(pod: dict[str, Any], selector: str) -> bool:
    """Label selectors of the forms `key` (exists) and `key=value`."""
    labels = pod.get("metadata", {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, eq, value = term.partition("=")
        if key not in labels or (eq and labels[key] != value):
            return False
    return True
