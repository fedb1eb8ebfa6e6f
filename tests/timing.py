"""How much slower than an idle machine this one runs now, and waits scaled by it.

A test that waits for a real process (a controller starting, an agent registering, a worker
answering) needs a deadline, but a deadline fit for an idle machine fails on a loaded one:
the suite went red at load 8 on two cores with every failure a fixed timeout. So the suite
measures, once at its start, how much slower than an idle 2-core machine a CPU-bound loop and
a Python process start run here (or takes `GPUPOOL_TEST_SLOWDOWN`), and every deadline is
`scaled()` by that factor. Deadlines are upper bounds for waits on events, never durations to
sleep: a scaled deadline costs nothing when the event comes early.

`python tests/timing.py` prints the factor and what it is made of; `python tests/timing.py
--baseline` prints the probe's idle costs, as recorded below.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

SLOWDOWN_ENV = "GPUPOOL_TEST_SLOWDOWN"
MIN_SLOWDOWN = 1.0
MAX_SLOWDOWN = 10.0
"""Past 10 the machine is too slow for the suite to mean anything; waits stop growing there."""

# The probe's costs on an idle 2-core x86-64 machine (the dev and CI machines), from
# `python tests/timing.py --baseline`: the least of 30 runs of each probe, in CPU seconds,
# which is what the probe needs when nothing competes with it for a core (0.029 s each), and
# for the process start 3 ms more that an idle start spends off the CPU (exec, page cache).
BASELINE_CPU_S = 0.030
BASELINE_SPAWN_S = 0.032
PROBE_ROUNDS = 3
SPAWN_CODE = "import json, subprocess, threading"
"""What the spawned Python does: start and import a little, like every process the tests start."""


@dataclass(frozen=True)
class Probe:
    """One measurement: wall-clock seconds of the CPU loop and of a process start."""

    cpu_s: float
    spawn_s: float

    @property
    def factor(self) -> float:
        ratio = max(self.cpu_s / BASELINE_CPU_S, self.spawn_s / BASELINE_SPAWN_S)
        return clamp(ratio)


def clamp(factor: float) -> float:
    return min(MAX_SLOWDOWN, max(MIN_SLOWDOWN, factor))


def _cpu_loop() -> None:
    """A fixed amount of pure-Python work (about 30 ms of one core on the baseline machine)."""
    total = 0
    for i in range(600_000):
        total += i * i % 7
    if total < 0:  # keeps the loop from being seen as dead code
        raise AssertionError


def _spawn() -> None:
    subprocess.run([sys.executable, "-c", SPAWN_CODE], check=True)


def _wall(work: Callable[[], None]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def probe() -> Probe:
    """The median of a few rounds of each probe, in wall-clock seconds (what the load stretches)."""
    cpu = statistics.median(_wall(_cpu_loop) for _ in range(PROBE_ROUNDS))
    spawn = statistics.median(_wall(_spawn) for _ in range(PROBE_ROUNDS))
    return Probe(cpu, spawn)


def baseline(rounds: int = 30) -> Probe:
    """The probes' own CPU seconds, least of `rounds`: their wall-clock time on an idle machine.

    CPU time is what the work needs, whatever else runs, so this can be taken on a busy machine
    too; it misses only the idle wall-clock time a process start spends off the CPU (a few ms).
    """
    cpu: list[float] = []
    spawn: list[float] = []
    for _ in range(rounds):
        started = time.process_time()
        _cpu_loop()
        cpu.append(time.process_time() - started)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.process_time()
        _spawn()
        parent_s = time.process_time() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        child_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        spawn.append(parent_s + child_s)
    return Probe(min(cpu), min(spawn))


def parse_slowdown(text: str) -> float:
    """`GPUPOOL_TEST_SLOWDOWN` as a factor; a value that is not a number >= 1 is an error."""
    try:
        factor = float(text)
    except ValueError:
        raise ValueError(
            f"{SLOWDOWN_ENV}={text!r} is not a number (for example 3 or 2.5)"
        ) from None
    if not factor >= MIN_SLOWDOWN:  # also refuses nan
        raise ValueError(f"{SLOWDOWN_ENV}={text!r}: the factor must be 1 or more")
    return min(factor, MAX_SLOWDOWN)


_factor: float | None = None


def slowdown() -> float:
    """The factor for this run: `GPUPOOL_TEST_SLOWDOWN` if set, else measured once.

    The measured factor is written to the environment, so pytest-xdist workers (started after
    the measurement) and processes the tests start share the one value.
    """
    global _factor
    if _factor is None:
        given = os.environ.get(SLOWDOWN_ENV)
        if given is not None:
            _factor = parse_slowdown(given)
        else:
            _factor = round(probe().factor, 2)
            os.environ[SLOWDOWN_ENV] = str(_factor)
    return _factor


def scaled(seconds: float) -> float:
    """A deadline of `seconds` on an idle machine, stretched for this one."""
    return seconds * slowdown()


def wait_until(
    check: Callable[[], T], what: str, timeout_s: float = 20.0, interval_s: float = 0.05
) -> T:
    """Poll `check` until it returns something true and return that; fail after the scaled
    `timeout_s` saying `what` did not happen."""
    deadline = time.monotonic() + scaled(timeout_s)
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {scaled(timeout_s):.1f} s waiting for {what}")
        time.sleep(interval_s)


def _main(argv: list[str]) -> int:
    if argv == ["--baseline"]:
        idle = baseline()
        print(f"BASELINE_CPU_S = {idle.cpu_s:.3f}\nBASELINE_SPAWN_S = {idle.spawn_s:.3f}")
        return 0
    if argv:
        print("usage: python tests/timing.py [--baseline]", file=sys.stderr)
        return 2
    now = probe()
    print(
        f"slowdown x{now.factor:.2f}: cpu loop {now.cpu_s * 1000:.0f} ms "
        f"(idle {BASELINE_CPU_S * 1000:.0f}), process start {now.spawn_s * 1000:.0f} ms "
        f"(idle {BASELINE_SPAWN_S * 1000:.0f}), load {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
