"""A worker given a certificate serves TCP clients over TLS only: a client that trusts the CA
computes through it; one that does not, or that speaks plain TCP, is refused and the worker
goes on serving."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gpupool.torch
from gpupool.protocol.tls import CA_ENV
from gpupool.protocol.v1.dataplane import (
    VERSION,
    DataPlaneError,
    Kind,
    connect,
    parse_address,
    recv_handshake,
    send_handshake,
    start_worker_process,
)
from tests.timing import scaled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
]
TOKEN = "tls-test-token"


def self_signed(where: Path) -> tuple[Path, Path]:
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def tls_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc, ready = start_worker_process(
        "lease-tls", TOKEN, env=env, threads=1, tls_cert=cert, tls_key=key
    )
    yield str(ready.address), cert
    proc.terminate()
    proc.wait(timeout=scaled(10))


def test_the_worker_advertises_a_tls_address(tls_worker: tuple[str, Path]) -> None:
    address, _ = tls_worker
    assert address.startswith("tls://127.0.0.1:")


def test_a_client_trusting_the_ca_computes_over_tls(
    tls_worker: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, cert = tls_worker
    monkeypatch.setenv(CA_ENV, str(cert))
    gpupool.torch.attach(workers=[address], token=TOKEN, lease="lease-tls")
    try:
        x = torch.arange(1 << 18, dtype=torch.float32).cuda()  # big enough for chunked frames
        y = (x * 2).sum()
        assert y.item() == float((torch.arange(1 << 18, dtype=torch.float64) * 2).sum())
        assert torch.equal(x.cpu(), torch.arange(1 << 18, dtype=torch.float32))
    finally:
        gpupool.torch.detach()


def test_untrusted_and_plain_clients_are_refused_and_the_worker_goes_on(
    tls_worker: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, cert = tls_worker
    monkeypatch.delenv(CA_ENV, raising=False)
    with pytest.raises(DataPlaneError, match="certificate verify failed"):
        connect(parse_address(address))
    # Plain TCP to the TLS port: the handshake fails on the worker's side, nothing is served.
    plain = parse_address(address.replace("tls://", "tcp://"))
    sock = connect(plain)
    try:
        send_handshake(sock, [Kind.HELLO, {"v": VERSION, "lease": "lease-tls", "token": TOKEN}])
        with pytest.raises((DataPlaneError, OSError)):
            recv_handshake(sock)
    finally:
        sock.close()
    monkeypatch.setenv(CA_ENV, str(cert))
    gpupool.torch.attach(workers=[address], token=TOKEN, lease="lease-tls")
    try:
        assert (torch.ones(3).cuda() + 1).sum().item() == 6.0
    finally:
        gpupool.torch.detach()
