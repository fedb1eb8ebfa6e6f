"""Signals while a command waits or supervises: SIGTERM cancels a wait like Ctrl-C does."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

Handler = Callable[[int, FrameType | None], None] | signal.Handlers


@contextmanager
def signals_to(handler: Handler, signals: Sequence[signal.Signals]) -> Iterator[None]:
    """Route signals to `handler` for a while (only the main thread may; elsewhere: no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class Interrupted(KeyboardInterrupt):
    """KeyboardInterrupt raised for another signal; `exit_status` is the shell's 128+N."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def exit_status_of(interrupt: KeyboardInterrupt) -> int:
    return 128 + (interrupt.signum if isinstance(interrupt, Interrupted) else signal.SIGINT)


def raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    """A signal handler: the signal as an `Interrupted`, so that cleanup code runs."""
    raise Interrupted(signum)


@contextmanager
def terminate_interrupts() -> Iterator[None]:
    """SIGTERM (a batch system, `kill`) raises KeyboardInterrupt, so cleanup code runs."""
    with signals_to(raise_interrupted, (signal.SIGTERM,)):
        yield
