"""`gpupool up` runs a controller and its own local agent, and stops both on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
from e2e_pool import free_port, gpu_count, gpupool_argv

from gpupool.client.sdk import PoolClient
from gpupool.protocol.v1.api import LeaseCreate
from tests.conftest import AUTH
from tests.timing import scaled

pytestmark = pytest.mark.slow


def test_up_starts_a_local_agent_and_stops_it_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = gpupool_argv(
        "up", "--port", str(port), "--data-dir", str(tmp_path), "--fake", "2xA100-40GB"
    )
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + scaled(60)
        while gpu_count(url) < 2:
            assert up.poll() is None, up.communicate()[0]
            assert time.monotonic() < deadline, "no GPUs registered"
            time.sleep(0.2)
        gpus = httpx.get(url + "/api/v1/gpus", timeout=5, headers=AUTH).json()
        assert {g["simulated"] for g in gpus} == {True}
        agents = psutil.Process(up.pid).children()
        assert agents, "the agent runs as a child of `gpupool up`"
        up.send_signal(signal.SIGINT)
        output, _ = up.communicate(timeout=scaled(30))
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert "SIMULATED GPUs" in output
    assert output.count("SIMULATED GPUs: ") == 1, output
    assert "Traceback" not in output
    _gone, alive = psutil.wait_procs(agents, timeout=10)
    assert not alive


def _user_env(config: Path) -> dict[str, str]:
    """A user's shell: no token or URL in the environment, contexts in `config`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GPUPOOL_TOKEN", "GPUPOOL_URL", "GPUPOOL_ADMIN_TOKEN", "GPUPOOL_TOKEN_FILE")
    }
    env["GPUPOOL_CONFIG"] = str(config)
    env["HOME"] = str(config.parent)  # nor ~/.config/gpupool/token
    return env


def _processes_naming(text: str) -> list[psutil.Process]:
    """Live processes whose command line names `text` (a test's own data dir)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(text in part for part in proc.info["cmdline"] or ()) and (
                proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_up_on_a_port_in_use_fails_in_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    config = tmp_path / "home" / "config.toml"
    config.parent.mkdir()
    data_dir = tmp_path / "pool"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            gpupool_argv(
                "up", "--port", str(port), "--data-dir", str(data_dir), "--fake", "1xA100-40GB"
            ),
            capture_output=True,
            text=True,
            env=_user_env(config),
            cwd=tmp_path,
            timeout=120,
        )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"port {port}" in lines[0] and "in use" in lines[0]
    assert not data_dir.exists(), "no database, token or log is made"
    assert not (tmp_path / ".gpupool").exists()
    assert not config.exists(), "no context is recorded"
    assert not _processes_naming(str(data_dir))


def test_sigterm_to_up_stops_its_agent_and_the_agents_workers(tmp_path: Path) -> None:
    config = tmp_path / "home" / "config.toml"
    config.parent.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data_dir = tmp_path / "pool"
    env = _user_env(config)
    argv = gpupool_argv(
        "up", "--port", str(port), "--data-dir", str(data_dir), "--fake", "1xA100-40GB"
    )
    up = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        token_file = data_dir / "admin.token"
        deadline = time.monotonic() + 120
        while not (config.exists() and token_file.exists()):  # recorded once the GPUs are in
            assert up.poll() is None, up.communicate()[0]
            assert time.monotonic() < deadline, "the pool did not become ready"
            time.sleep(0.2)
        client = PoolClient(url, token=token_file.read_text().strip())
        lease = client.create_lease(
            LeaseCreate(gpus=1, compute_pct=10, memory="1GiB", access="remote", holder="t")
        )
        assert lease.state in ("granted", "active"), lease
        while not [p for p in psutil.Process(up.pid).children(recursive=True) if _is_worker(p)]:
            assert time.monotonic() < deadline, "no worker started for the remote lease"
            time.sleep(0.2)
        started = psutil.Process(up.pid).children(recursive=True)
        assert len(started) >= 2, "an agent and its worker"
        up.send_signal(signal.SIGTERM)
        output, _ = up.communicate(timeout=90)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 128 + signal.SIGTERM, output
    assert "Traceback" not in output
    _gone, alive = psutil.wait_procs(started, timeout=10)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"
    assert not _processes_naming(str(data_dir))


def _is_worker(proc: psutil.Process) -> bool:
    try:
        return "gpupool.worker" in proc.cmdline()
    except psutil.Error:
        return False


def test_up_in_the_background_is_found_from_any_directory_and_down_stops_it(
    tmp_path: Path,
) -> None:
    config = tmp_path / "home" / "config.toml"
    config.parent.mkdir()
    env = _user_env(config)
    port = free_port()
    start_dir = tmp_path / "start"
    start_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def gpupool(*args: str, cwd: Path = elsewhere) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            gpupool_argv(*args), capture_output=True, text=True, env=env, cwd=cwd, timeout=240
        )

    up = gpupool("up", "--fake", "2xA100-40GB", "--port", str(port), "--background", cwd=start_dir)
    data_dir = start_dir / ".gpupool"
    try:
        assert up.returncode == 0, up.stderr
        assert str(data_dir / "up.log") in up.stderr, "it says where its logs are"
        assert "gpupool down" in up.stderr
        gpus = gpupool("gpus", "-o", "json")  # another directory, no token in the environment
        assert gpus.returncode == 0, gpus.stderr
        assert len(json.loads(gpus.stdout)) == 2
        shown = gpupool("context")
        assert f"current context: local-{port}" in shown.stdout
        assert f"http://127.0.0.1:{port} (from context 'local-{port}')" in shown.stdout
        assert str(data_dir / "admin.token") in shown.stdout
        listed = gpupool("context", "ls", "-o", "json")
        assert json.loads(listed.stdout)["current_context"] == f"local-{port}"
        # Precedence: $GPUPOOL_URL beats the context (here: a port where nothing listens).
        env["GPUPOOL_URL"] = f"http://127.0.0.1:{free_port()}"
        assert gpupool("gpus").returncode == 3
        del env["GPUPOOL_URL"]
        wrong = gpupool("context", "use", "nosuch")
        assert wrong.returncode == 2 and "no context named 'nosuch'" in wrong.stderr
        running = _processes_naming(str(data_dir))
        assert len(running) >= 2, "gpupool up and its agent"
        down = gpupool("down")
        assert down.returncode == 0, down.stderr
        assert "stopped the pool of context" in down.stderr
        _gone, alive = psutil.wait_procs(running, timeout=10)
        assert not alive
        again = gpupool("down")
        assert again.returncode == 0 and "not running" in again.stderr
    finally:
        for proc in _processes_naming(str(data_dir)):
            proc.kill()
