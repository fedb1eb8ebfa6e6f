"""The watch of direct slices against real processes on simulated GPUs: attribution by
ancestry, SIGTERM then SIGKILL, and nothing done to a compliant or exempt process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool.agent.backends import FakeBackend
from gpupool.agent.watch import UNSEEN_POLLS, DirectWatch, WatchMode
from gpupool.protocol.v1.api import DirectLease, DirectSlice
from gpupool.protocol.v1.attach import AttachRefused, token_sha256
from tests.timing import scaled

TOKEN = "lease-token-a"
SLEEPER = "import time; time.sleep(120)"
# Says "ready" once it runs its own code: before that (mid-exec) /proc shows no command line yet.
READY_SLEEPER = "import time; print('ready', flush=True); time.sleep(120)"
IGNORES_TERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(120)"
)
PARENT = (
    "import subprocess, sys, time; "
    f"c = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]); "
    "print(c.pid, flush=True); time.sleep(120)"
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend.from_spec("2xH100-80GB", node_name="n")


def lease_env(backend: FakeBackend) -> dict[str, str]:
    """What `gpupool run` gives a program of lease l-a (see leases())."""
    return {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": uuid(backend, 0),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1024M",
    }


@pytest.fixture
def spawn(backend: FakeBackend) -> Iterator[object]:
    started: list[subprocess.Popen[str]] = []

    def start(code: str = SLEEPER, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            text=True,
            env=env if env is not None else lease_env(backend),
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def uuid(backend: FakeBackend, index: int) -> str:
    return backend.inventory()[index].uuid


def leases(backend: FakeBackend, memory_mib: int = 1024) -> dict[str, DirectLease]:
    return {
        "l-a": DirectLease(
            token_sha256=token_sha256(TOKEN),
            slices=[DirectSlice(gpu_uuid=uuid(backend, 0), compute_pct=30, memory_mib=memory_mib)],
        )
    }


def watch_for(
    backend: FakeBackend,
    mode: WatchMode = WatchMode.ENFORCE,
    exempt: set[int] | None = None,
    clock: Clock | None = None,
) -> DirectWatch:
    watch = DirectWatch(mode, lambda: set(exempt or ()), clock=clock or Clock())
    watch.set_leases(leases(backend))
    return watch


def test_a_process_over_its_lease_memory_gets_sigterm_with_an_event(
    backend: FakeBackend, spawn
) -> None:  # type: ignore[no-untyped-def]
    watch = watch_for(backend)
    child = spawn(READY_SLEEPER)
    assert child.stdout.readline().strip() == "ready"
    watch.attach("l-a", TOKEN, child.pid)
    backend.set_processes(0, [{"pid": child.pid, "used_memory_mib": 2048}])
    (event,) = watch.poll(backend)
    assert (event.kind, event.reason, event.lease_id, event.pid) == (
        "process_stopped",
        "over_memory",
        "l-a",
        child.pid,
    )
    assert (event.used_memory_mib, event.limit_memory_mib) == (2048, 1024)
    assert "time.sleep" in event.command and str(child.pid) in event.message
    assert child.wait(timeout=scaled(30)) == -signal.SIGTERM
    assert watch.stopped["over_memory"] == 1


def test_descendants_of_the_attached_process_belong_to_its_lease(
    backend: FakeBackend, spawn
) -> None:  # type: ignore[no-untyped-def]
    watch = watch_for(backend)
    parent = spawn(PARENT)
    grandchild = int(parent.stdout.readline())
    watch.attach("l-a", TOKEN, parent.pid)
    backend.set_processes(0, [{"pid": grandchild, "used_memory_mib": 512}])
    assert watch.poll(backend) == []
    backend.set_processes(1, [{"pid": grandchild, "used_memory_mib": 10}])
    (event,) = watch.poll(backend)
    assert (event.reason, event.lease_id, event.gpu_uuid) == (
        "foreign_gpu",
        "l-a",
        uuid(backend, 1),
    )
    assert parent.poll() is None, "only the offending process is stopped"


def test_a_process_that_ignores_sigterm_gets_sigkill_after_the_grace(
    backend: FakeBackend, spawn
) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    watch = watch_for(backend, clock=clock)
    stubborn = spawn(IGNORES_TERM)
    assert stubborn.stdout.readline().strip() == "ready"
    backend.set_processes(0, [{"pid": stubborn.pid, "used_memory_mib": 1}])
    (event,) = watch.poll(backend)
    assert (event.reason, event.lease_id) == ("no_lease", None)
    assert watch.poll(backend) == [], "one event per stop, not one per reading"
    assert stubborn.poll() is None
    clock.now += watch.grace_s
    watch.poll(backend)
    assert stubborn.wait(timeout=scaled(30)) == -signal.SIGKILL


def test_a_compliant_process_and_an_exempt_one_are_untouched(backend: FakeBackend, spawn) -> None:  # type: ignore[no-untyped-def]
    worker = spawn()
    watch = watch_for(backend, exempt={worker.pid})
    tenant = spawn()
    watch.attach("l-a", TOKEN, tenant.pid)
    backend.set_processes(
        0,
        [
            {"pid": tenant.pid, "used_memory_mib": 1024},
            {"pid": worker.pid, "used_memory_mib": 70000},
        ],
    )
    for _ in range(3):
        assert watch.poll(backend) == []
    assert tenant.poll() is None and worker.poll() is None
    assert watch.usage == {("l-a", uuid(backend, 0)): (1024, None)}


def test_report_mode_stops_nothing_and_says_so_once(backend: FakeBackend, spawn) -> None:  # type: ignore[no-untyped-def]
    watch = watch_for(backend, mode=WatchMode.REPORT)
    stray = spawn()
    backend.set_processes(0, [{"pid": stray.pid, "used_memory_mib": 1}])
    (event,) = watch.poll(backend)
    assert (event.kind, event.reason) == ("process_not_stopped", "no_lease")
    assert watch.poll(backend) == []
    assert stray.poll() is None


def test_attach_needs_the_lease_token_and_a_lease_of_this_node(backend: FakeBackend, spawn) -> None:  # type: ignore[no-untyped-def]
    watch = watch_for(backend)
    child = spawn()
    with pytest.raises(AttachRefused, match="wrong token"):
        watch.attach("l-a", "guessed", child.pid)
    with pytest.raises(AttachRefused, match="no direct slice on this node"):
        watch.attach("l-elsewhere", TOKEN, child.pid)
    assert watch.roots() == []
    backend.set_processes(0, [{"pid": child.pid, "used_memory_mib": 1}])
    (event,) = watch.poll(backend)
    assert event.reason == "no_lease", "a refused attach gives the process no lease"


def test_a_process_attached_to_one_lease_cannot_move_to_another(
    backend: FakeBackend, spawn
) -> None:  # type: ignore[no-untyped-def]
    watch = watch_for(backend)
    watch.set_leases(
        {
            **leases(backend),
            "l-b": DirectLease(
                token_sha256=token_sha256("token-b"),
                slices=[DirectSlice(gpu_uuid=uuid(backend, 1), compute_pct=50, memory_mib=4096)],
            ),
        }
    )
    child = spawn()
    watch.attach("l-a", TOKEN, child.pid)
    with pytest.raises(AttachRefused, match="already attached"):
        watch.attach("l-b", "token-b", child.pid)
    assert [(r.pid, r.lease_id) for r in watch.roots()] == [(child.pid, "l-a")]


def test_when_the_lease_ends_its_processes_are_stopped(backend: FakeBackend, spawn) -> None:  # type: ignore[no-untyped-def]
    watch = watch_for(backend)
    child = spawn()
    watch.attach("l-a", TOKEN, child.pid)
    backend.set_processes(0, [{"pid": child.pid, "used_memory_mib": 10}])
    assert watch.poll(backend) == []
    watch.set_leases({})
    assert watch.roots() == []
    (event,) = watch.poll(backend)
    assert (event.kind, event.reason) == ("process_stopped", "no_lease")
    assert child.wait(timeout=scaled(30)) == -signal.SIGTERM


def test_nothing_is_judged_before_the_controller_names_the_leases(
    backend: FakeBackend, spawn
) -> None:  # type: ignore[no-untyped-def]
    watch = DirectWatch(WatchMode.ENFORCE, set)
    stray = spawn()
    backend.set_processes(0, [{"pid": stray.pid, "used_memory_mib": 1}])
    assert watch.poll(backend) == []
    assert stray.poll() is None


def test_a_process_hidden_from_proc_is_reported_after_some_readings(
    backend: FakeBackend, spawn
) -> None:  # type: ignore[no-untyped-def]
    watch = watch_for(backend)
    gone = spawn("pass")
    gone.wait()
    backend.set_processes(0, [{"pid": gone.pid, "used_memory_mib": 1}])
    for _ in range(UNSEEN_POLLS - 1):
        assert watch.poll(backend) == []
    (event,) = watch.poll(backend)
    assert (event.kind, event.pid) == ("process_unattributable", gone.pid)
    assert watch.poll(backend) == []


def test_a_process_started_with_raised_mps_limits_is_reported(backend: FakeBackend, spawn) -> None:  # type: ignore[no-untyped-def]
    watch = watch_for(backend)
    env = lease_env(backend)
    env.update(
        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100",
        CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=80G",
        CUDA_VISIBLE_DEVICES=f"{uuid(backend, 0)},{uuid(backend, 1)}",
    )
    # Mid-exec, /proc shows no environment yet and the watch looks again next time: the
    # child says when it runs its own code.
    child = spawn(READY_SLEEPER, env=env)
    assert child.stdout.readline().strip() == "ready"
    watch.attach("l-a", TOKEN, child.pid)
    backend.set_processes(0, [{"pid": child.pid, "used_memory_mib": 10}])
    (event,) = watch.poll(backend)
    assert (event.kind, event.reason, event.lease_id) == ("limits_raised", "raised_limits", "l-a")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100" in event.message
    assert watch.poll(backend) == [], "said once per process"
    assert child.poll() is None, "raised variables alone are reported, memory decides"


def test_compute_over_the_share_is_reported_once_per_episode(backend: FakeBackend, spawn) -> None:  # type: ignore[no-untyped-def]
    watch = watch_for(backend)
    child = spawn()
    watch.attach("l-a", TOKEN, child.pid)
    busy = [{"pid": child.pid, "used_memory_mib": 10, "sm_util_pct": 90}]
    backend.set_processes(0, busy)  # type: ignore[list-item]
    (event,) = watch.poll(backend)
    assert (event.kind, event.compute_pct, event.share_pct) == ("compute_over_share", 90.0, 30)
    assert watch.poll(backend) == []
    backend.set_processes(0, [{"pid": child.pid, "used_memory_mib": 10, "sm_util_pct": 20}])
    assert watch.poll(backend) == []
    backend.set_processes(0, busy)  # type: ignore[list-item]
    assert [e.kind for e in watch.poll(backend)] == ["compute_over_share"]
    assert child.poll() is None


def test_attachments_survive_an_agent_restart_but_dead_ones_do_not(
    backend: FakeBackend, spawn, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    saved = tmp_path / "direct.json"
    first = DirectWatch(WatchMode.ENFORCE, set, roots_file=saved)
    first.set_leases(leases(backend))
    alive, dying = spawn(), spawn()
    first.attach("l-a", TOKEN, alive.pid)
    first.attach("l-a", TOKEN, dying.pid)
    assert saved.stat().st_mode & 0o777 == 0o600
    dying.kill()
    dying.wait()
    again = DirectWatch(WatchMode.ENFORCE, set, roots_file=saved)
    again.restore()
    assert [(r.pid, r.lease_id) for r in again.roots()] == [(alive.pid, "l-a")]
    again.set_leases(leases(backend))
    backend.set_processes(0, [{"pid": alive.pid, "used_memory_mib": 10}])
    assert again.poll(backend) == [], "the restarted agent still knows the program's lease"
    assert alive.poll() is None


def test_a_damaged_attachment_file_loses_attachments_not_the_agent(tmp_path: Path) -> None:
    saved = tmp_path / "direct.json"
    for text in ("{not json", '{"pid": 1}', '[{"pid": "x"}, 7]'):
        saved.write_text(text)
        watch = DirectWatch(WatchMode.ENFORCE, set, roots_file=saved)
        watch.restore()
        assert watch.roots() == []
