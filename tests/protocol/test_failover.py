"""Clients given several controller URLs: they reach the one that answers, and say clearly
when none does."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gpupool.client.sdk import ControllerUnreachable, PoolClient
from gpupool.protocol.failover import split_urls
from tests.conftest import free_port


def test_urls_are_split_and_normalised() -> None:
    assert split_urls(" ctl-a:8900, http://ctl-b:8900/ ,") == [
        "http://ctl-a:8900",
        "http://ctl-b:8900",
    ]
    with pytest.raises(ValueError, match="no controller URL"):
        split_urls(" , ")


def test_the_sdk_moves_past_a_dead_controller_to_a_live_one(start_controller) -> None:
    live = start_controller(None)
    dead = f"http://127.0.0.1:{free_port()}"
    with PoolClient(f"{dead},{live.url}") as sdk:
        assert sdk.health()["status"] == "ok"
        tenant = sdk.tenant("default")
        assert tenant.name == "default"


def test_no_live_controller_is_one_clear_error_after_the_failover_time() -> None:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    started = time.monotonic()
    with PoolClient(",".join(dead), failover_s=1.0) as sdk, pytest.raises(ControllerUnreachable):
        sdk.health()
    assert time.monotonic() - started >= 1.0


def test_the_cli_refuses_a_url_list_that_names_no_controller() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpupool.cli", "--url", " , ", "pool"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "no controller URL" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
