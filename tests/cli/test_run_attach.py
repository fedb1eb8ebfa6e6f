"""`gpupool run` attaches itself to its lease's watch before the command starts, and fails
with one clear line where the agent refuses or cannot be reached."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool.agent.attach import AttachServer
from gpupool.agent.watch import DirectWatch, WatchMode
from gpupool.cli.errors import CommandFailed
from gpupool.cli.run import attach_socket, attach_to_watch
from gpupool.protocol.v1.api import DirectLease, DirectSlice, GpuOut
from gpupool.protocol.v1.attach import token_sha256
from tests.cli.test_run_env import gpu, lease, piece

TOKEN = "t" * 43


def with_socket(found: GpuOut, path: Path) -> GpuOut:
    return found.model_copy(update={"telemetry": {"direct_socket": str(path)}})


@pytest.fixture
def agent_socket(tmp_path: Path) -> Iterator[tuple[Path, DirectWatch]]:
    """A real attach server in a thread of its own, knowing lease l-1 with TOKEN."""
    watch = DirectWatch(WatchMode.ENFORCE, set)
    watch.set_leases(
        {
            "l-1": DirectLease(
                token_sha256=token_sha256(TOKEN),
                slices=[DirectSlice(gpu_uuid="GPU-a", compute_pct=30, memory_mib=8192)],
            )
        }
    )
    path = tmp_path / "direct.sock"
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    ready = threading.Event()

    async def nothing_to_learn() -> None:
        return None

    async def serve() -> None:
        server = AttachServer(path, watch, nothing_to_learn)
        await server.start()
        ready.set()
        await stop.wait()
        await server.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    assert ready.wait(30)
    try:
        yield path, watch
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


def test_the_run_process_attaches_itself_to_its_lease(
    agent_socket, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    import gpupool.cli.run as run

    became: list[bool] = []
    monkeypatch.setattr(run, "become_subreaper", lambda: became.append(True))
    path, watch = agent_socket
    the_lease = lease([piece("GPU-a", 0)])
    attach_to_watch(the_lease, TOKEN, [with_socket(gpu("GPU-a", False), path)])
    assert [(r.pid, r.lease_id) for r in watch.roots()] == [(os.getpid(), "l-1")]
    assert became == [True], "orphans of the command stay under the attached process"


def test_a_refused_attach_fails_the_run_with_the_agents_reason(agent_socket) -> None:  # type: ignore[no-untyped-def]
    path, watch = agent_socket
    the_lease = lease([piece("GPU-a", 0)])
    with pytest.raises(CommandFailed, match="refused to attach lease l-1: wrong token"):
        attach_to_watch(the_lease, "wrong", [with_socket(gpu("GPU-a", False), path)])
    assert watch.roots() == []


def test_an_unreachable_agent_socket_fails_the_run(tmp_path: Path) -> None:
    the_lease = lease([piece("GPU-a", 0)])
    missing = with_socket(gpu("GPU-a", False), tmp_path / "none.sock")
    with pytest.raises(CommandFailed, match="cannot reach the agent's socket"):
        attach_to_watch(the_lease, TOKEN, [missing])


def test_a_lease_without_its_token_is_run_unattached_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    the_lease = lease([piece("GPU-a", 0)])
    attach_to_watch(the_lease, None, [with_socket(gpu("GPU-a", False), tmp_path / "s")])
    assert "came without its token" in capsys.readouterr().err


def test_an_agent_without_a_watch_is_warned_about_on_real_gpus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    the_lease = lease([piece("GPU-a", 0)])
    attach_to_watch(the_lease, TOKEN, [gpu("GPU-a", False)])
    assert "does not watch direct slices" in capsys.readouterr().err
    attach_to_watch(the_lease, TOKEN, [gpu("GPU-a", True)])
    assert capsys.readouterr().err == ""


def test_the_socket_is_found_in_the_gpus_telemetry(tmp_path: Path) -> None:
    assert attach_socket([gpu("GPU-a", False)]) is None
    assert attach_socket([with_socket(gpu("GPU-a", False), tmp_path / "x")]) == tmp_path / "x"


def test_a_bad_direct_watch_mode_is_one_line_and_exit_2() -> None:
    from typer.testing import CliRunner

    from gpupool.cli.main import app

    args = ["--url", "http://127.0.0.1:9", "agent", "--fake", "1xH100-80GB"]
    result = CliRunner().invoke(app, [*args, "--direct-watch", "lenient"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--direct-watch must be one of enforce, report, off" in lines[0]


def test_a_daemonising_child_stays_a_descendant_of_the_run_process() -> None:
    """With `gpupool run` a subreaper, a double-forked grandchild is re-parented to it, not to
    init: it keeps its lease (ancestry) instead of being stopped as one of no lease."""
    import subprocess
    import sys

    code = (
        "import os, sys, time\n"
        "from gpupool.cli.run import become_subreaper\n"
        "become_subreaper()\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    middle = os.getpid()\n"
        "    if os.fork() == 0:\n"
        "        while os.getppid() == middle:\n"  # until its parent is gone
        "            time.sleep(0.01)\n"
        "        os.write(w, str(os.getppid()).encode()); os._exit(0)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print(os.getpid(), os.read(r, 64).decode(), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    me, parent_of_orphan = done.stdout.split()
    assert parent_of_orphan == me, done.stderr
