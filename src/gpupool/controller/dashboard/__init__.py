"""The dashboard's files (plain HTML, CSS and JavaScript, no third-party code), read once."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from importlib import resources

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

# The page loads only its own files; frames are refused so that no other site can wrap the
# operator's buttons (clickjacking).
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
}


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    media_type: str
    etag: str
    headers: dict[str, str] = field(default_factory=dict)


@functools.cache
def _assets() -> dict[str, Asset]:
    out = {}
    for entry in resources.files(__package__).joinpath("static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if not entry.is_file() or suffix not in MEDIA_TYPES:
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
        # Revalidated on every load (cheap with the ETag): an upgraded controller's page is
        # never mixed with an old script from the cache.
        headers = {"ETag": etag, "Cache-Control": "no-cache", **SECURITY_HEADERS}
        out[entry.name] = Asset(body, MEDIA_TYPES[suffix], etag, headers)
    return out


def asset(name: str) -> Asset | None:
    return _assets().get(name)


def index() -> Asset:
    found = asset("index.html")
    if found is None:  # pragma: no cover - a broken install
        raise RuntimeError("the dashboard's index.html is missing from the package")
    return found
