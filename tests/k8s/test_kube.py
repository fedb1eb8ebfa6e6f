"""The extender's API-server client: a bearer token from a file (read again when the kubelet
rotates it), in-cluster credentials, and `k8s serve`'s flags for them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_apiserver import FakeApiServer

from gpupool.k8s import kube
from gpupool.k8s.kube import KubeApi, KubeCredentials, KubeError


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer().start()
    yield server
    server.stop()


def _get_pods(client: KubeApi) -> None:
    async def run() -> None:
        try:
            await client.pods_with_label("gpupool.io/claim")
        finally:
            await client.close()

    asyncio.run(run())


def test_a_rotated_token_file_is_sent_from_the_next_call_on(
    api: FakeApiServer, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("first-token-0123456789\n")
    client = KubeApi(api.url, token_file=token)

    async def run() -> None:
        try:
            await client.pods_with_label("gpupool.io/claim")
            # The kubelet swaps the file for a new one (a new inode), as it does on rotation.
            fresh = tmp_path / "token.new"
            fresh.write_text("second-token-0123456789")
            os.replace(fresh, token)
            await client.pods_with_label("gpupool.io/claim")
        finally:
            await client.close()

    asyncio.run(run())
    assert api.authorizations == ["Bearer first-token-0123456789", "Bearer second-token-0123456789"]


def test_a_token_file_that_vanishes_is_a_clear_error(api: FakeApiServer, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-token-0123456789")
    client = KubeApi(api.url, token_file=token)
    token.unlink()
    with pytest.raises(KubeError, match="cannot read token file"):
        _get_pods(client)
    assert api.authorizations == []  # nothing went out without the credential


def test_in_cluster_credentials_are_the_service_accounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube, "SERVICE_ACCOUNT", tmp_path)
    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "ca.crt").write_text("PEM")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
    assert KubeCredentials.in_cluster(env) == KubeCredentials(
        "https://10.96.0.1:6443", tmp_path / "token", tmp_path / "ca.crt"
    )
    v6 = KubeCredentials.in_cluster({"KUBERNETES_SERVICE_HOST": "fd00::1"})
    assert v6.url == "https://[fd00::1]:443"
    (tmp_path / "token").unlink()
    with pytest.raises(KubeError, match="automountServiceAccountToken"):
        KubeCredentials.in_cluster(env)
    with pytest.raises(KubeError, match="give --kube-api"):
        KubeCredentials.in_cluster({})


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    return subprocess.run(
        [sys.executable, "-m", "gpupool.cli", "k8s", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "no KUBERNETES_SERVICE_HOST"),
        (["--kube-token-file", "/nonexistent"], "go with --kube-api"),
        (
            ["--kube-api", "https://127.0.0.1:6443", "--kube-token-file", "/nonexistent"],
            "cannot read",
        ),
        (["--kube-api", "http://127.0.0.1:8080", "--kube-token-file", "/etc/hostname"], "https://"),
        (["--kube-api", "https://127.0.0.1:6443", "--kube-ca-file", "/nonexistent"], "no file"),
    ],
)
def test_serve_refuses_kube_credentials_it_cannot_use(args: list[str], says: str) -> None:
    done = _serve(*args)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr
