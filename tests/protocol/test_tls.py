"""$GPUPOOL_CA is read by one function for the API and the data plane: a readable bundle is
trusted by both, an unreadable one is one clear line for both."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from gpupool.core.errors import InvalidRequest
from gpupool.protocol.tls import CA_ENV, private_ca_context, tls_verify
from gpupool.protocol.v1.dataplane import DataPlaneError, client_tls_context


def test_without_a_bundle_each_client_keeps_its_usual_trust_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(CA_ENV, raising=False)
    assert private_ca_context() is None
    assert tls_verify() is True
    context = client_tls_context()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_a_bundle_is_trusted_by_the_api_and_the_data_plane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert = tmp_path / "ca.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=gpupool-test-ca", "-keyout", str(tmp_path / "key.pem"), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    monkeypatch.setenv(CA_ENV, str(cert))
    api = tls_verify()
    assert isinstance(api, ssl.SSLContext)
    for context in (api, client_tls_context()):
        subjects = [dict(pair[0] for pair in ca["subject"]) for ca in context.get_ca_certs()]
        assert subjects == [{"commonName": "gpupool-test-ca"}]


@pytest.mark.parametrize("content", [None, "not a certificate\n"])
def test_an_unreadable_bundle_is_one_line_naming_the_variable_and_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | None
) -> None:
    bundle = tmp_path / "ca.pem"
    if content is not None:
        bundle.write_text(content)
    monkeypatch.setenv(CA_ENV, str(bundle))
    expected = f"{CA_ENV}={bundle}: cannot load a CA bundle from it"
    with pytest.raises(InvalidRequest, match=expected) as api:
        tls_verify()
    with pytest.raises(DataPlaneError, match=expected) as data_plane:
        client_tls_context()
    assert str(data_plane.value) == api.value.message
    assert "\n" not in api.value.message


def test_the_cli_says_a_bad_bundle_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    done = subprocess.run(
        [sys.executable, "-m", "gpupool.cli", "pool"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, CA_ENV: str(missing)},
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {CA_ENV}={missing}: cannot load a CA bundle from it "
        "([Errno 2] No such file or directory)"
    ]
