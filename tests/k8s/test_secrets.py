"""`gpupool k8s init-secrets` (the chart's hook Job) against an API server on loopback: the
Secrets are made once, valid, and never changed after; `k8s serve` puts the CA into its
webhook configuration's caBundle."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_apiserver import FakeApiServer

from gpupool.k8s.kube import KubeApi
from gpupool.k8s.secrets import (
    InitError,
    Outcome,
    SecretNames,
    init_secrets,
    inject_ca_bundle,
    make_certificates,
)
from gpupool.protocol.v1.tokens import split

NAMES = SecretNames(
    namespace="gpupool",
    service="gpupool-k8s",
    admin_token="gpupool-admin-token",
    webhook_token="gpupool-k8s-webhook-token",
    tls="gpupool-k8s-tls",
    scheduler_client="gpupool-k8s-scheduler-client",
    client_ca="gpupool-k8s-client-ca",
    postgresql="gpupool-postgresql",
    postgresql_host="gpupool-postgresql.gpupool.svc",
)


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer().start()
    yield server
    server.stop()


def run(api: FakeApiServer, names: SecretNames) -> Outcome:
    async def go() -> Outcome:
        kube = KubeApi(api.url)
        try:
            return await init_secrets(kube, names)
        finally:
            await kube.close()

    return asyncio.run(go())


def data(api: FakeApiServer, name: str, key: str) -> bytes:
    return base64.b64decode(api.secrets[("gpupool", name)]["data"][key])


def openssl(*args: str) -> str:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_secret_is_made_once_and_then_kept(api: FakeApiServer, tmp_path: Path) -> None:
    first = run(api, NAMES)
    assert len(first.created) == 6 and first.kept == []
    # Not the release's objects (docs/kubernetes.md says how to find them by this label).
    assert {
        v["metadata"]["labels"]["app.kubernetes.io/managed-by"] for v in api.secrets.values()
    } == {"gpupool-init-secrets"}
    assert split(data(api, "gpupool-admin-token", "token").decode()) is not None
    assert len(data(api, "gpupool-k8s-webhook-token", "token")) >= 32
    password = data(api, "gpupool-postgresql", "password").decode()
    assert data(api, "gpupool-postgresql", "url").decode() == (
        f"postgresql://gpupool:{password}@gpupool-postgresql.gpupool.svc:5432/gpupool"
    )
    for name, key in (("gpupool-k8s-tls", "ca.crt"), ("gpupool-k8s-tls", "tls.crt")):
        (tmp_path / f"{name}-{key}").write_bytes(data(api, name, key))
    (tmp_path / "client.pem").write_bytes(data(api, "gpupool-k8s-scheduler-client", "tls.crt"))
    ca = str(tmp_path / "gpupool-k8s-tls-ca.crt")
    openssl("verify", "-CAfile", ca, str(tmp_path / "gpupool-k8s-tls-tls.crt"))
    openssl("verify", "-CAfile", ca, str(tmp_path / "client.pem"))
    names = openssl(
        "x509", "-noout", "-ext", "subjectAltName", "-in", str(tmp_path / "gpupool-k8s-tls-tls.crt")
    )
    assert "DNS:gpupool-k8s.gpupool.svc" in names and "DNS:gpupool-k8s" in names
    subject = openssl("x509", "-noout", "-subject", "-in", str(tmp_path / "client.pem"))
    assert "gpupool-scheduler" in subject
    assert data(api, "gpupool-k8s-client-ca", "ca.crt") == data(api, "gpupool-k8s-tls", "ca.crt")
    before = {k: v["data"] for k, v in api.secrets.items()}
    again = run(api, NAMES)  # the next upgrade's hook
    assert again.created == [] and len(again.kept) == 6
    assert {k: v["data"] for k, v in api.secrets.items()} == before


def test_a_lone_certificate_is_not_paired_with_a_new_ca(api: FakeApiServer) -> None:
    run(api, NAMES)
    del api.secrets[("gpupool", "gpupool-k8s-scheduler-client")]
    with pytest.raises(InitError, match="must share one CA"):
        run(api, NAMES)


def test_the_client_ca_bundle_adds_the_api_servers_ca(api: FakeApiServer) -> None:
    other = make_certificates("apiserver", "kube-system", "kube-apiserver").ca.decode()
    names = SecretNames(
        namespace="gpupool",
        service="gpupool-k8s",
        tls="t",
        scheduler_client="c",
        client_ca="ca",
        extra_client_cas=[other],
    )
    run(api, names)
    bundle = data(api, "ca", "ca.crt").decode()
    assert bundle.count("BEGIN CERTIFICATE") == 2 and other in bundle


def _webhooks(api: FakeApiServer, bundle: str = "") -> None:
    api.webhook_configurations["gpupool-k8s"] = {
        "metadata": {"name": "gpupool-k8s"},
        "webhooks": [
            {"name": n, "clientConfig": {"service": {"name": "gpupool-k8s"}, "caBundle": bundle}}
            for n in ("gpu-pods.gpupool.io", "pods.gpupool.io")
        ],
    }


def test_the_ca_bundle_is_injected_into_every_webhook_once(api: FakeApiServer) -> None:
    _webhooks(api)
    ca = make_certificates("gpupool-k8s", "gpupool", "s").ca

    async def inject() -> int:
        kube = KubeApi(api.url)
        try:
            return await inject_ca_bundle(kube, "gpupool-k8s", ca)
        finally:
            await kube.close()

    assert asyncio.run(inject()) == 2
    hooks = api.webhook_configurations["gpupool-k8s"]["webhooks"]
    assert {base64.b64decode(h["clientConfig"]["caBundle"]) for h in hooks} == {ca}
    assert api.patches[0][1] == "application/json-patch+json"
    assert asyncio.run(inject()) == 0 and len(api.patches) == 1


def test_the_command_makes_the_secrets_and_says_which(api: FakeApiServer) -> None:
    argv = [sys.executable, "-m", "gpupool.cli", "k8s", "init-secrets", "--kube-api", api.url]
    argv += ["--namespace", "gpupool", "--service", "gpupool-k8s", "--admin-token", "adm"]
    argv += ["--tls", "tls", "--scheduler-client", "sched"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "created: adm, tls, sched; kept: none"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "created: none; kept: adm, tls, sched"
    bad = subprocess.run([*argv, "--postgresql", "pg"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--postgresql-host" in bad.stderr


def test_k8s_serve_sets_the_ca_bundle_once_its_configuration_exists(
    api: FakeApiServer, tmp_path: Path
) -> None:
    """The chart's MutatingWebhookConfiguration is applied after the Deployment: `k8s serve`
    keeps trying until it is there."""
    import time
    import warnings

    from starlette.exceptions import StarletteDeprecationWarning

    from gpupool.client.sdk import PoolClient
    from gpupool.k8s.app import ServeSettings, create_app
    from gpupool.k8s.callers import Callers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StarletteDeprecationWarning)
        from fastapi.testclient import TestClient

    ca = make_certificates("gpupool-k8s", "gpupool", "s").ca
    (tmp_path / "ca.crt").write_bytes(ca)
    settings = ServeSettings(
        controller_url="http://127.0.0.1:9",
        sweep_interval_s=3600,
        callers=Callers.insecure(),
        webhook_configuration="gpupool-k8s",
        tls_ca=str(tmp_path / "ca.crt"),
    )
    pool = PoolClient(settings.controller_url, actor="test")
    app = create_app(settings, pool, KubeApi(api.url))
    deadline = time.monotonic() + 30
    with TestClient(app):
        while not any(a is None for a in api.authorizations):  # its first, failed, attempt
            assert time.monotonic() < deadline, "k8s serve never asked for its configuration"
            time.sleep(0.05)
        _webhooks(api)
        while not api.patches:
            assert time.monotonic() < deadline, "the caBundle was never set"
            time.sleep(0.05)
    pool.close()
    hooks = api.webhook_configurations["gpupool-k8s"]["webhooks"]
    assert {base64.b64decode(h["clientConfig"]["caBundle"]) for h in hooks} == {ca}
