"""Which certificate authorities a client trusts: one rule for the API (controller) and the
data plane (workers), set by $GPUPOOL_CA."""

from __future__ import annotations

import os
import ssl

from gpupool.core.errors import InvalidRequest

CA_ENV = "GPUPOOL_CA"
"""A CA bundle (PEM) to verify controllers and tls:// workers with, for private CAs."""


def private_ca_context() -> ssl.SSLContext | None:
    """A context that trusts the bundle $GPUPOOL_CA names, or None where it names none (then
    each client keeps its usual store: httpx's bundle for the API, the system's for workers).

    A bundle that cannot be read is bad input, one line that names the variable and the file,
    rather than an SSL traceback at the first connection.
    """
    ca = os.environ.get(CA_ENV)
    if not ca:
        return None
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidRequest(f"{CA_ENV}={ca}: cannot load a CA bundle from it ({exc})") from None


def tls_verify() -> ssl.SSLContext | bool:
    """httpx's `verify` for the API: $GPUPOOL_CA's bundle, else httpx's own trust store."""
    return private_ca_context() or True
