"""Domain errors: each is a type that the API and CLI turn into one clear message."""

from __future__ import annotations


def quoted(text: str, limit: int = 40) -> str:
    """User input inside a message: quoted, and cut, since it may be a megabyte long."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


class PoolError(Exception):
    """Base of every domain error; `code` is stable for scripts and the API."""

    code = "pool_error"
    http_status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(PoolError):
    code = "invalid_request"
    http_status = 422


class NotFound(PoolError):
    code = "not_found"
    http_status = 404


class Conflict(PoolError):
    code = "conflict"
    http_status = 409


class QuotaExceeded(PoolError):
    code = "quota_exceeded"
    http_status = 403


class NoCapacity(PoolError):
    """The request can never fit this pool, or does not fit now (the caller decides to queue)."""

    code = "no_capacity"
    http_status = 409


class InvalidTransition(PoolError):
    code = "invalid_transition"
    http_status = 409


class Unauthenticated(PoolError):
    """No token, or one the controller does not accept (unknown, revoked, expired)."""

    code = "unauthenticated"
    http_status = 401


class Forbidden(PoolError):
    """A valid token whose role or tenant does not allow this action."""

    code = "forbidden"
    http_status = 403
