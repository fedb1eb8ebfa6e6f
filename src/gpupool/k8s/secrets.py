"""`gpupool k8s init-secrets`: the chart's credentials, made once inside the cluster.

A chart that makes random secrets while it renders (`randAlphaNum`, `genCA`, kept only by
`lookup`) renders new ones on every `helm template`, and GitOps tools (Argo CD, Flux's
post-renderers) render that way: every sync would rotate the CA and the tokens and break
the webhook and the agents. So the chart renders no secret at all; a Job of its own (a
pre-install and pre-upgrade hook, as ingress-nginx does for its admission certificates)
runs this command, which creates each Secret that is missing and never changes one that
exists. What it makes is whatever the operator did not give (an `existingSecret`).

The certificates: one CA (ECDSA P-256, 10 years) signs the server certificate of the
webhook's Service and the scheduler's client certificate. The CA's key is not kept: nothing
signs again, and a lost key cannot sign a false scheduler.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpupool.k8s.kube import KubeApi
from gpupool.protocol.v1.tokens import new_token

log = logging.getLogger(__name__)

CERT_DAYS = 3650


@dataclass(frozen=True, slots=True)
class SecretNames:
    """The Secrets to make, by name; None for those the operator gives or that are off."""

    namespace: str
    service: str
    """The webhook's and extender's Service (its DNS names go into the server certificate)."""
    admin_token: str | None = None
    webhook_token: str | None = None
    tls: str | None = None
    """kubernetes.io/tls with ca.crt: the server certificate and its CA."""
    scheduler_client: str | None = None
    scheduler_client_name: str = "gpupool-scheduler"
    client_ca: str | None = None
    """The CAs `k8s serve` accepts client certificates of: ours, plus `extra_client_cas`."""
    extra_client_cas: Sequence[str] = ()
    """PEM CAs of callers' certificates made elsewhere (the API server's)."""
    postgresql: str | None = None
    postgresql_user: str = "gpupool"
    postgresql_database: str = "gpupool"
    postgresql_host: str = ""


@dataclass
class Outcome:
    created: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def _secret(name: str, data: dict[str, bytes], kind: str = "Opaque") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/managed-by": "gpupool-init-secrets"},
        },
        "type": kind,
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }


def _data(secret: dict[str, Any], key: str) -> bytes:
    value = (secret.get("data") or {}).get(key)
    return base64.b64decode(value) if value else b""


@dataclass(frozen=True, slots=True)
class Certificates:
    ca: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes


def make_certificates(service: str, namespace: str, client_name: str) -> Certificates:
    """A CA, the Service's server certificate and the scheduler's client certificate (PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # clocks differ a little
    until = now + dt.timedelta(days=CERT_DAYS)

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name(f"{service}-ca")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common: str, dns: list[str], usage: x509.ObjectIdentifier) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if dns:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]), critical=False
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), pem_key(key)

    dns = [service, f"{service}.{namespace}", f"{service}.{namespace}.svc"]
    server_cert, server_key = leaf(dns[-1], dns, ExtendedKeyUsageOID.SERVER_AUTH)
    client_cert, client_key = leaf(client_name, [], ExtendedKeyUsageOID.CLIENT_AUTH)
    return Certificates(
        ca.public_bytes(serialization.Encoding.PEM),
        server_cert,
        server_key,
        client_cert,
        client_key,
    )


async def init_secrets(kube: KubeApi, names: SecretNames) -> Outcome:
    """Create every named Secret that is missing; keep every one that exists."""
    out = Outcome()
    ns = names.namespace

    async def ensure(secret: dict[str, Any]) -> dict[str, Any]:
        name = secret["metadata"]["name"]
        existing = await kube.get_secret(ns, name)
        if existing is None and await kube.create_secret(ns, secret):
            log.info("created Secret %s/%s", ns, name)
            out.created.append(name)
            return secret
        # Exists (or another run created it between our two calls): it stays as it is.
        kept = existing if existing is not None else await kube.get_secret(ns, name)
        out.kept.append(name)
        return kept or secret

    if names.admin_token:
        await ensure(_secret(names.admin_token, {"token": new_token()[2].encode()}))
    if names.webhook_token:
        await ensure(_secret(names.webhook_token, {"token": secrets.token_urlsafe(36).encode()}))
    if names.postgresql:
        password = secrets.token_urlsafe(24)
        url = (
            f"postgresql://{names.postgresql_user}:{password}@{names.postgresql_host}:5432/"
            f"{names.postgresql_database}"
        )
        await ensure(
            _secret(names.postgresql, {"password": password.encode(), "url": url.encode()})
        )
    ca = b""
    if names.tls or names.scheduler_client:
        made = make_certificates(names.service, ns, names.scheduler_client_name)
        # Both certificates must come from one CA: made together, or both kept.
        existing_tls = await kube.get_secret(ns, names.tls) if names.tls else None
        existing_client = (
            await kube.get_secret(ns, names.scheduler_client) if names.scheduler_client else None
        )
        if (
            names.tls
            and names.scheduler_client
            and (existing_tls is None) != (existing_client is None)
        ):
            raise InitError(
                f"Secret {names.tls if existing_tls else names.scheduler_client} exists but "
                f"{names.scheduler_client if existing_tls else names.tls} does not: they must "
                "share one CA; delete the one left (then the pods using them restart) and run "
                "again"
            )
        if names.tls:
            tls = await ensure(
                _secret(
                    names.tls,
                    {"tls.crt": made.server_cert, "tls.key": made.server_key, "ca.crt": made.ca},
                    "kubernetes.io/tls",
                )
            )
            ca = _data(tls, "ca.crt")
        if names.scheduler_client:
            await ensure(
                _secret(
                    names.scheduler_client,
                    {"tls.crt": made.client_cert, "tls.key": made.client_key, "ca.crt": made.ca},
                    "kubernetes.io/tls",
                )
            )
    if names.client_ca:
        bundle = b"".join(
            pem if pem.endswith(b"\n") else pem + b"\n"
            for pem in [ca, *(c.encode() for c in names.extra_client_cas)]
            if pem
        )
        if not bundle:
            raise InitError("the client CA Secret would hold no CA")
        await ensure(_secret(names.client_ca, {"ca.crt": bundle}))
    return out


class InitError(Exception):
    """The Secrets cannot be made consistent; the message says what to do."""


async def inject_ca_bundle(kube: KubeApi, configuration: str, ca_pem: bytes) -> int:
    """Set the caBundle of every webhook of the MutatingWebhookConfiguration to `ca_pem`;
    the number changed (0 when all were already right)."""
    config = await kube.get_webhook_configuration(configuration)
    bundle = base64.b64encode(ca_pem).decode()
    patch = [
        {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}
        for i, hook in enumerate(config.get("webhooks") or [])
        if (hook.get("clientConfig") or {}).get("caBundle") != bundle
    ]
    if patch:
        await kube.patch_webhook_configuration(configuration, patch)
    return len(patch)
