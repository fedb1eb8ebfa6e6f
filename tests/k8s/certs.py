"""Certificates for the Kubernetes tests, made with openssl: a CA, the server certificate of
`gpupool k8s serve` on 127.0.0.1, and client certificates the CA signs (the scheduler's,
the API server's), as a cluster would have them."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


def make_ca(directory: Path, name: str) -> Pem:
    directory.mkdir(parents=True, exist_ok=True)
    ca = Pem(directory / f"{name}.crt", directory / f"{name}.key")
    _openssl(
        *("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
        *("-keyout", str(ca.key), "-out", str(ca.cert), "-subj", f"/CN={name}"),
        *("-addext", "basicConstraints=critical,CA:TRUE"),
        *("-addext", "keyUsage=critical,keyCertSign,cRLSign"),
    )
    return ca


def make_signed(ca: Pem, directory: Path, common_name: str, server: bool = False) -> Pem:
    """A certificate for `common_name` signed by `ca`: for a server on 127.0.0.1, or a client."""
    stem = directory / common_name.replace("/", "_")
    pem = Pem(stem.with_suffix(".crt"), stem.with_suffix(".key"))
    csr = stem.with_suffix(".csr")
    _openssl(
        *("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pem.key), "-out", str(csr)),
        *("-subj", f"/CN={common_name}"),
    )
    extensions = stem.with_suffix(".ext")
    usage = "serverAuth" if server else "clientAuth"
    lines = [f"extendedKeyUsage={usage}", "basicConstraints=CA:FALSE"]
    if server:
        lines.append("subjectAltName=IP:127.0.0.1,DNS:localhost")
    extensions.write_text("\n".join(lines) + "\n")
    _openssl(
        *("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key)),
        *("-CAcreateserial", "-days", "1", "-out", str(pem.cert), "-extfile", str(extensions)),
    )
    return pem
