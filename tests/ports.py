"""Ports for the servers the tests start, from below the kernel's ephemeral range.

A port from `bind(("127.0.0.1", 0))` lies in the ephemeral range, where the kernel also picks
the port of every server that binds port 0 (agents, workers, stores) and of every outgoing
connection. Between a test closing its probe socket and its controller binding that number,
another xdist worker's process could take it: under load a controller failed with "address
already in use" while its test and agent talked to another test's server on that port. Here
each xdist worker hands out ports from a slice of its own below the ephemeral range, each once
per run (no TIME_WAIT reuse), and checks with a bind that nothing else holds it.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

BASE = 20000
"""The lowest port handed out: above the well-known services a CI host may run."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice() -> range:
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(name[2:]) if name[2:].isdigit() else 0
    low = _ephemeral_low()
    if low - BASE < 64 * workers:  # a host whose ephemeral range starts low: share the old way
        return range(0)
    width = (low - BASE) // workers
    start = BASE + (index % workers) * width
    return range(start, start + width)


_SLICE = _slice()
_next = itertools.cycle(_SLICE) if _SLICE else None


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port no one holds now and no other test process will be handed."""
    if _next is not None:
        for _ in range(len(_SLICE)):
            port = next(_next)
            if _bindable(port):
                return port
    with socket.socket() as sock:  # the whole slice held (or none): the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
