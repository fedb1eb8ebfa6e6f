"""SIMULATED GPU processes of the fake backend: a real process appears on a simulated GPU only
while it holds its use file open, so nobody can put another process there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpupool.agent.backends import FakeBackend, GpuProcess
from gpupool.agent.backends.fake import SimulatedGpuUse
from tests.timing import scaled

HOLDER = (
    "import sys, time\n"
    "from gpupool.agent.backends.fake import SimulatedGpuUse\n"
    "use = SimulatedGpuUse(sys.argv[1], sys.argv[2], int(sys.argv[3]))\n"
    "print('holding', flush=True)\n"
    "sys.stdin.readline()\n"
)


def backend(tmp_path: Path) -> FakeBackend:
    return FakeBackend.from_spec("2xH100-80GB", node_name="n", process_dir=tmp_path / "procs")


def test_a_real_process_holding_its_use_file_is_on_the_gpu(tmp_path: Path) -> None:
    fake = backend(tmp_path)
    gpu = fake.inventory()[1].uuid
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "procs"), gpu, "3000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        assert fake.gpu_processes() == [GpuProcess(gpu, holder.pid, 3000, None)]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=scaled(30))
    assert fake.gpu_processes() == [], "gone with the process"


def test_a_use_file_its_pid_does_not_hold_is_ignored(tmp_path: Path) -> None:
    fake = backend(tmp_path)
    gpu = fake.inventory()[0].uuid
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        # A forger names another process: that process holds no such file, so it is not
        # reported (and the agent's watch never stops it for what it did not do).
        (tmp_path / "procs" / gpu / str(bystander.pid)).write_text('{"used_memory_mib": 99999}')
        assert fake.gpu_processes() == []
    finally:
        assert bystander.stdin is not None
        bystander.stdin.close()
        bystander.wait(timeout=scaled(30))


def test_use_files_are_read_within_bounds(tmp_path: Path) -> None:
    fake = backend(tmp_path)
    gpu = fake.inventory()[0].uuid
    use = SimulatedGpuUse(tmp_path / "procs", gpu, 10)
    try:
        assert fake.gpu_processes() == [GpuProcess(gpu, os.getpid(), 10, None)]
        use.set(20, sm_util_pct=55.5)
        assert fake.gpu_processes() == [GpuProcess(gpu, os.getpid(), 20, 55.5)]
        for bad in (
            "x" * 300,
            "[1]",
            '{"used_memory_mib": -1}',
            '{"used_memory_mib": true}',
            '{"used_memory_mib": 1, "sm_util_pct": 101}',
        ):
            use.path.write_text(bad)
            assert fake.gpu_processes() == [], bad
        use.path.write_text(json.dumps({"used_memory_mib": 5}))
        assert [p.used_memory_mib for p in fake.gpu_processes()] == [5]
    finally:
        use.close()
    assert not use.path.exists()


def test_the_process_directories_are_open_to_every_user_but_sticky(tmp_path: Path) -> None:
    fake = backend(tmp_path)
    for directory in [tmp_path / "procs", *(tmp_path / "procs" / g.uuid for g in fake.inventory())]:
        assert directory.stat().st_mode & 0o7777 == 0o1777


def test_set_processes_rows_are_reported_with_their_sm_use(tmp_path: Path) -> None:
    fake = backend(tmp_path)
    fake.set_processes(0, [{"pid": 7, "used_memory_mib": 100, "sm_util_pct": 40}])
    gpu = fake.inventory()[0].uuid
    assert fake.gpu_processes() == [GpuProcess(gpu, 7, 100, 40.0)]
