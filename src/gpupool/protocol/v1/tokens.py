"""The API token format, shared by the controller (which checks tokens) and the CLI (which
can make one offline for a deployment's secret store).

A token reads `gpp_<id>_<secret>`: the 12 hex digits of id find the stored row, and only the
SHA-256 of the secret is stored. Secrets are 32 random bytes, so a plain hash is enough (slow
password hashes exist for low-entropy human passwords).
"""

from __future__ import annotations

import hashlib
import secrets

PREFIX = "gpp_"


def new_token() -> tuple[str, str, str]:
    """A fresh (id, secret, token)."""
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return token_id, secret, f"{PREFIX}{token_id}_{secret}"


def split(token: str) -> tuple[str, str] | None:
    """The (id, secret) of a well-formed token, else None."""
    if not token.startswith(PREFIX):
        return None
    token_id, sep, secret = token[len(PREFIX) :].partition("_")
    if not sep or len(token_id) != 12 or not secret or len(secret) > 128:
        return None
    if any(c not in "0123456789abcdef" for c in token_id):
        return None
    return token_id, secret


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
