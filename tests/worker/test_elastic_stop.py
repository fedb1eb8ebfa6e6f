"""A worker stopped in the middle of a handoff first lets the client hear where its state went.

The agent stops a predecessor worker as soon as the controller places the lease on the
successor, which can come before the predecessor's RESUME reply: closing the client's
connection then stranded a client whose tensors were safe on the successor (seen under load
in tests/e2e/test_e2e_oversubscription.py).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from gpupool.worker.elastic import Elasticity
from tests.timing import scaled


def _elastic() -> Elasticity:
    return Elasticity(SimpleNamespace(), memory=None, idle_timeout_s=None, managed=False)  # type: ignore[arg-type]


def test_stop_waits_for_a_handoff_reply_in_flight() -> None:
    elastic = _elastic()
    elastic._settled.clear()  # a handoff in flight
    returned = threading.Event()
    returned_before_the_reply: list[bool] = []

    def reply() -> None:
        returned_before_the_reply.append(returned.is_set())
        elastic._settled.set()

    timer = threading.Timer(0.3, reply)
    timer.start()
    assert elastic.finish_handoff(scaled(5.0))
    returned.set()
    timer.join()
    assert returned_before_the_reply == [False]


def test_stop_gives_up_on_a_handoff_that_never_ends() -> None:
    elastic = _elastic()
    elastic._settled.clear()
    started = time.monotonic()
    assert not elastic.finish_handoff(0.2)
    assert time.monotonic() - started < scaled(2.0)


def test_nothing_in_flight_means_no_wait() -> None:
    started = time.monotonic()
    assert _elastic().finish_handoff(scaled(60.0))
    assert time.monotonic() - started < scaled(0.5)
