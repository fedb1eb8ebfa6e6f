"""Without a controller every command says so in one line and exits 3."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from gpupool.cli.main import app


def _dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    "args",
    [
        ["pool"],
        ["nodes"],
        ["gpus"],
        ["gpu", "show", "GPU-0"],
        ["gpu", "mode", "GPU-0", "physical"],
        ["lease", "ls"],
        ["lease", "show", "l-1"],
        ["lease", "create", "--compute", "25%", "--memory", "20GiB"],
        ["lease", "release", "l-1"],
        ["queue"],
        ["tenant", "ls"],
        ["tenant", "create", "team", "--max-gpus", "2"],
        ["events"],
        ["run", "--compute", "25%", "--", "true"],
    ],
)
def test_unreachable_controller_exits_3_with_one_line(args: list[str]) -> None:
    url = _dead_url()
    result = CliRunner().invoke(app, ["--url", url, *args])
    assert result.exit_code == 3, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: cannot reach the gpupool controller at {url}")
    assert "Traceback" not in result.output


def test_url_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    url = _dead_url()
    result = CliRunner().invoke(app, ["gpus"], env={"GPUPOOL_URL": url})
    assert result.exit_code == 3
    assert url in result.stderr


def test_python_dash_m_entry_point_exits_3_without_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpupool.cli", "--url", _dead_url(), "lease", "ls"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr


def test_version_needs_no_controller() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.startswith("gpupool ")
