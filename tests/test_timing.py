"""The suite's slowdown factor: where it comes from, and the timeouts and waits it stretches."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.timing import (
    MAX_SLOWDOWN,
    SLOWDOWN_ENV,
    Probe,
    parse_slowdown,
    scaled,
    slowdown,
    wait_until,
)


def test_a_test_without_a_timeout_of_its_own_gets_the_configured_one_stretched(
    request: pytest.FixtureRequest,
) -> None:
    marker = request.node.get_closest_marker("timeout")
    assert marker is not None
    assert marker.args[0] == round(120 * slowdown(), 1)


@pytest.mark.timeout(30)
def test_a_tests_own_timeout_is_stretched_too(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("timeout").args[0] == round(30 * slowdown(), 1)


def test_the_factor_is_shared_through_the_environment() -> None:
    # pytest-xdist's workers and the processes the tests start read the one measured value.
    assert parse_slowdown(os.environ[SLOWDOWN_ENV]) == slowdown()
    assert scaled(2.0) == 2.0 * slowdown()


def test_a_factor_from_the_environment_must_be_a_number_of_at_least_one() -> None:
    assert parse_slowdown("3") == 3.0
    assert parse_slowdown("2.5") == 2.5
    assert parse_slowdown("50") == MAX_SLOWDOWN
    for bad in ("fast", "", "0.5", "-2", "nan"):
        with pytest.raises(ValueError, match=SLOWDOWN_ENV):
            parse_slowdown(bad)


def test_a_measured_factor_stays_between_one_and_ten() -> None:
    assert Probe(cpu_s=0.001, spawn_s=0.001).factor == 1.0
    assert Probe(cpu_s=100.0, spawn_s=0.001).factor == MAX_SLOWDOWN
    assert Probe(cpu_s=0.001, spawn_s=100.0).factor == MAX_SLOWDOWN


def test_wait_until_returns_what_the_check_found() -> None:
    calls = iter([None, 0, "found"])
    assert wait_until(lambda: next(calls), "the third call", timeout_s=60, interval_s=0) == "found"


def test_wait_until_says_what_did_not_happen() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match="waiting for the moon"):
        wait_until(lambda: False, "the moon", timeout_s=0.05 / slowdown(), interval_s=0.01)
    assert time.monotonic() - started >= 0.05


def test_a_bad_factor_stops_the_run_with_one_line() -> None:
    env = {**os.environ, SLOWDOWN_ENV: "fast"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=scaled(120),
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert f"{SLOWDOWN_ENV}='fast' is not a number" in done.stderr
