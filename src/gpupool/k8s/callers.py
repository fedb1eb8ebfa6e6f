"""Who may call `gpupool k8s serve`: the scheduler (/extender/...) and the API server
(/webhook/...), each by a client certificate or a bearer token it is configured to send.

What the callers can send (Kubernetes' own configuration):
- kube-scheduler: an extender's `tlsConfig` in KubeSchedulerConfiguration has `certFile`/
  `keyFile` (or `certData`/`keyData`) for a client certificate, besides `caFile`/`caData` to
  check ours. It has no field for a token.
- kube-apiserver: the kubeconfig named by its AdmissionConfiguration (`WebhookAdmission`,
  `kubeConfigFile`) gives, per webhook host (`<service>.<namespace>.svc`), a user with
  `client-certificate`/`client-key` or a `token`.

So each group of endpoints accepts a client certificate (verified against `--client-ca` in
the TLS handshake, then its names matched against the group's allowed names) or a bearer
token (compared in constant time). A group with no credential configured is refused at
start, unless an `--insecure-...` flag says otherwise in so many words.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool.protocol.bodylimit import App, Receive, Scope, Send

log = logging.getLogger(__name__)

CLIENT_NAMES_EXTENSION = "gpupool.client_certificate"
"""The ASGI scope extension where the HTTP protocol puts the names of a caller's verified
client certificate (`{"names": frozenset}`; empty: no certificate)."""

EXTENDER_PREFIX = "/extender/"
WEBHOOK_PREFIX = "/webhook/"
OPEN_PATHS = frozenset({"/healthz"})
"""Answered to anyone: the kubelet's readiness probe presents no credential."""


@dataclass(frozen=True, slots=True)
class CallerRule:
    """Who may call one group of endpoints (the extender's, or the webhook's)."""

    role: str
    """The caller it is meant for, as refusals name it: `scheduler`, `API server`."""
    certificate_names: frozenset[str] = frozenset()
    """Names (subject CN or DNS SAN) of client certificates accepted; with `any_certificate`
    False and this empty, no certificate is accepted."""
    any_certificate: bool = False
    """Accept every client certificate that the client CA signed."""
    token_sha256: bytes | None = None
    """SHA-256 of the bearer token accepted; None: no token is."""
    insecure: bool = False
    """Accept every caller (an operator said so, explicitly)."""

    @property
    def configured(self) -> bool:
        return self.insecure or self.any_certificate or bool(self.certificate_names) or (
            self.token_sha256 is not None
        )

    def refusal(self, names: frozenset[str], authorization: str | None) -> str | None:
        """None where the caller may call; else why not, in words for the 401."""
        if self.insecure:
            return None
        if authorization is not None and self.token_sha256 is not None:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(
                hashlib.sha256(token.strip().encode()).digest(), self.token_sha256
            ):
                return None
        if names and (self.any_certificate or names & self.certificate_names):
            return None
        if names:
            return (
                f"client certificate {sorted(names)} is not one the {self.role} may use "
                f"(accepted: {sorted(self.certificate_names) or 'none'})"
            )
        if authorization is not None:
            return f"the bearer token is not the {self.role}'s"
        return f"the {self.role} must present its client certificate or bearer token"


def token_digest(token: str) -> bytes:
    """What a CallerRule keeps of a bearer token: its SHA-256, never the token."""
    return hashlib.sha256(token.strip().encode()).digest()


@dataclass(frozen=True, slots=True)
class Callers:
    """The rules of every protected group, by path prefix. The default admits no caller:
    a server built without rules refuses every protected path."""

    rules: Mapping[str, CallerRule] = field(default_factory=dict)

    @classmethod
    def of(cls, extender: CallerRule, webhook: CallerRule) -> Callers:
        return cls({EXTENDER_PREFIX: extender, WEBHOOK_PREFIX: webhook})

    @classmethod
    def insecure(cls) -> Callers:
        """Every caller admitted: what `--insecure-...` flags ask for, and in-process tests."""
        return cls.of(
            CallerRule("scheduler", insecure=True), CallerRule("API server", insecure=True)
        )

    def rule_for(self, path: str) -> CallerRule | None:
        """The rule of the group `path` is in; None for paths anyone may call."""
        if path in OPEN_PATHS:
            return None
        for prefix, rule in self.rules.items():
            if path.startswith(prefix):
                return rule
        # Nothing else is served, but a path nobody configured must not be open by default.
        return CallerRule(role="caller")


def certificate_names(cert: Mapping[str, Any] | None) -> frozenset[str]:
    """The subject common names and DNS SANs of a verified peer certificate
    (`ssl.SSLObject.getpeercert()`'s dict); empty for no certificate."""
    if not cert:
        return frozenset()
    names: set[str] = set()
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                names.add(str(value))
    for kind, value in cert.get("subjectAltName", ()):
        if kind == "DNS":
            names.add(str(value))
    return frozenset(names)


class CallerCheck:
    """ASGI middleware: refuse (401, with the reason) callers a group's rule does not admit."""

    def __init__(self, app: App, callers: Callers) -> None:
        self.app = app
        self.callers = callers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        rule = self.callers.rule_for(path)
        if rule is None:
            await self.app(scope, receive, send)
            return
        names = client_names(scope)
        authorization = _header(scope.get("headers") or [], b"authorization")
        why = rule.refusal(names, authorization)
        if why is None:
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        log.warning("refused %s %s from %s: %s", scope.get("method"), path, client[0], why)
        body = json.dumps({"error": "unauthenticated", "detail": why, "Error": why}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="gpupool-k8s"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def client_names(scope: Scope) -> frozenset[str]:
    """The names of the caller's verified client certificate, as the protocol put them."""
    extension = (scope.get("extensions") or {}).get(CLIENT_NAMES_EXTENSION) or {}
    names = extension.get("names")
    return names if isinstance(names, frozenset) else frozenset()


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def peer_certificate_protocol() -> type:
    """uvicorn's HTTP protocol, with the names of the caller's verified client certificate
    put in each request's scope (CLIENT_NAMES_EXTENSION): uvicorn itself does not pass them on."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class PeerCertificateProtocol(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            ssl_object = transport.get_extra_info("ssl_object")
            cert = ssl_object.getpeercert() if ssl_object is not None else None
            self.peer_names = certificate_names(cert)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            extensions = dict(self.scope.get("extensions") or {})
            extensions[CLIENT_NAMES_EXTENSION] = {"names": self.peer_names}
            self.scope["extensions"] = extensions

    return PeerCertificateProtocol
