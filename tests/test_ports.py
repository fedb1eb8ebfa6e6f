"""The suite's port allocator (tests/ports.py) hands out ports the kernel will not give away."""

from __future__ import annotations

import socket

import pytest

from tests import ports


def test_ports_come_once_each_from_below_the_ephemeral_range_and_are_bindable() -> None:
    handed = [ports.free_port() for _ in range(20)]
    assert len(set(handed)) == 20
    if ports._SLICE:
        assert all(p in ports._SLICE and p < ports._ephemeral_low() for p in handed)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", handed[-1]))


def test_a_held_port_is_passed_over() -> None:
    if not ports._SLICE:
        pytest.skip("this host's ephemeral range starts too low for slices: kernel ports")
    with socket.socket() as holder:
        probe = ports.free_port()
        holder.bind(("127.0.0.1", probe + 1 if probe + 1 in ports._SLICE else ports._SLICE[0]))
        held = holder.getsockname()[1]
        assert all(ports.free_port() != held for _ in range(3))
