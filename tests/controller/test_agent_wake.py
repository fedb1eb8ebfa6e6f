"""The controller wakes a node's agent when it grants a remote lease there, through the agent's
registered URL; a URL that would point the call at anything but the agent's fixed wake path
(a path, query, fragment, credentials or another scheme in it) is not called at all."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpupool.agent.service import WAKE_GAP_S, Agent, AgentSettings
from gpupool.controller.services.wake import WAKE_PATH, wake_url


@pytest.mark.parametrize(
    ("registered", "called"),
    [
        ("http://127.0.0.1:39001", f"http://127.0.0.1:39001{WAKE_PATH}"),
        ("http://gpu-7:9400/", f"http://gpu-7:9400{WAKE_PATH}"),
        ("https://[::1]:9400", f"https://[::1]:9400{WAKE_PATH}"),
        ("http://internal:8080/admin/delete#", None),
        ("http://internal:8080/?x=", None),
        ("http://user:pw@internal:8080", None),
        ("file:///etc/passwd", None),
        ("gopher://internal:70", None),
        ("http://:80", None),
        ("http://host:99999", None),
        ("", None),
        (None, None),
    ],
)
def test_only_the_scheme_host_and_port_of_an_agent_url_are_called(
    registered: str | None, called: str | None
) -> None:
    assert wake_url(registered) == called


def test_early_heartbeats_are_at_least_the_wake_gap_apart(tmp_path: Path) -> None:
    """The wake call needs no token: whoever calls it, the agent heartbeats early at most once
    per WAKE_GAP_S, and calls within one gap share that heartbeat."""

    async def run() -> list[bool]:
        agent = Agent(AgentSettings(controller_url="http://127.0.0.1:9", data_dir=tmp_path))
        loop = asyncio.get_running_loop()
        # The gap runs from the first early heartbeat: measured from before it, so that time
        # a loaded machine takes between the two lines is inside the bound, not against it.
        began = loop.time()
        asked = [agent.wake()]
        assert agent._heartbeat_now.is_set()
        agent._heartbeat_now.clear()
        asked += [agent.wake(), agent.wake(), agent.wake()]
        assert not agent._heartbeat_now.is_set()
        await asyncio.wait_for(agent._heartbeat_now.wait(), timeout=10)
        assert loop.time() - began >= WAKE_GAP_S * 0.9
        return asked

    assert asyncio.run(run()) == [True, True, False, False]
