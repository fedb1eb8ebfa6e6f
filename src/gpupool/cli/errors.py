"""What can go wrong in a command, and the one-line message and exit code each gives."""

from __future__ import annotations

from pydantic import ValidationError

from gpupool.client.config import ConfigError
from gpupool.client.sdk import ApiError, ControllerUnreachable
from gpupool.core.errors import PoolError

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3


class CommandFailed(Exception):
    """A command could not do its job; `exit_code` tells scripts which kind of failure."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class BadInput(CommandFailed):
    """The user's input is wrong; found before any request is sent."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_BAD_INPUT)


def validation_message(exc: ValidationError) -> str:
    """The first problem of a pydantic error, as one short sentence."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def describe(exc: BaseException) -> tuple[str, int] | None:
    """The message and exit code for a failure we know, or None for a real bug."""
    if isinstance(exc, CommandFailed):
        return exc.message, exc.exit_code
    if isinstance(exc, ConfigError):
        return str(exc), EXIT_BAD_INPUT
    if isinstance(exc, ControllerUnreachable):
        return str(exc), EXIT_UNREACHABLE
    if isinstance(exc, ApiError):
        code = EXIT_BAD_INPUT if exc.is_client_error else EXIT_FAILED
        return f"{exc.detail} ({exc.code})", code
    if isinstance(exc, PoolError):
        return exc.message, EXIT_BAD_INPUT
    if isinstance(exc, ValidationError):
        return validation_message(exc), EXIT_BAD_INPUT
    if isinstance(exc, TimeoutError):
        return str(exc) or "timed out", EXIT_FAILED
    return None
