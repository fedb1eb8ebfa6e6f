"""Bad input is refused with one line and exit 2 before any request is sent."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from gpupool.cli.main import app


def _dead_url() -> str:
    """A loopback URL nobody listens on: a request sent there would exit 3, not 2."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def invoke(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, ["--url", _dead_url(), *args])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["lease", "create", "--compute", "101%"],
            "error: compute share must be 1..100 %, got 101",
        ),
        (["lease", "create", "--compute", "0"], "error: compute share must be 1..100 %, got 0"),
        (["lease", "create", "--compute", "half"], "cannot read compute share 'half'"),
        (["lease", "create", "--memory", "20"], "has no unit"),
        (["lease", "create", "--memory", "20XB"], "unknown memory unit"),
        (["lease", "create", "--memory", "-1GiB"], "memory must be positive"),
        (["lease", "create", "--gpus", "0"], "--gpus must be 1..256, got 0"),
        (["lease", "create", "--priority", "1001"], "--priority must be 0..1000"),
        (["lease", "create", "--ttl", "0"], "--ttl must be more than 0"),
        (
            ["lease", "create", "--physical", "--compute", "50%"],
            "a physical lease takes whole GPUs",
        ),
        (["run", "--compute", "150%", "--", "true"], "compute share must be 1..100 %, got 150"),
        (["run", "--memory", "8", "--", "true"], "has no unit"),
        (["run", "--compute", "25%"], "give the command to run after --"),
        (["tenant", "create", "team", "--max-memory", "80"], "has no unit"),
        (["tenant", "create", "team", "--max-gpus", "four"], "--max-gpus must be a whole number"),
        (["tenant", "create", "team", "--max-priority", "5000"], "--max-priority must be 0..1000"),
        (["tenant", "create", "team", "--weight", "0"], "--weight must be more than 0"),
        (["tenant", "set", "team"], "nothing to change"),
        (["lease", "ls", "--all", "--state", "queued"], "give --all or --state, not both"),
        (["events", "--limit", "0"], "--limit must be at least 1"),
    ],
)
def test_bad_input_exits_2_with_one_line_before_any_request(args: list[str], message: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert message in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("size", ["512MiB", "20GiB", "1.5GiB", "80G", "1TiB", "2048M"])
def test_memory_sizes_people_write_pass_validation(size: str) -> None:
    # Valid input gets as far as the network: exit 3 (unreachable), not 2.
    result = invoke("lease", "create", "--compute", "25%", "--memory", size)
    assert result.exit_code == 3, result.output


@pytest.mark.parametrize("share", ["25%", "25", "1", "100%", " 50 % "])
def test_compute_shares_people_write_pass_validation(share: str) -> None:
    result = invoke("lease", "create", "--compute", share)
    assert result.exit_code == 3, result.output


def test_unknown_option_is_a_usage_error() -> None:
    result = invoke("lease", "create", "--colour", "red")
    assert result.exit_code == 2
    assert "Traceback" not in result.output


def test_direct_run_on_several_slices_is_refused_before_any_request() -> None:
    from typer.testing import CliRunner

    from gpupool.cli.main import app

    result = CliRunner().invoke(
        app, ["--url", "http://127.0.0.1:9", "run", "--gpus", "2", "--compute", "50%", "--", "true"]
    )
    assert result.exit_code == 2
    assert "cannot be held to its limits by MPS" in result.output


def test_locality_chooses_between_pinning_preferring_and_any_server() -> None:
    import socket

    from gpupool.cli.errors import BadInput
    from gpupool.cli.leases import resolve_locality

    here = socket.gethostname()
    assert resolve_locality(None, None) == (None, here)
    assert resolve_locality(None, "gpu-7") == ("gpu-7", None)
    assert resolve_locality("local", None) == (here, None)
    assert resolve_locality("any", None) == (None, None)
    assert resolve_locality("node=gpu-3", None) == ("gpu-3", None)
    for bad in ("nearby", "node="):
        try:
            resolve_locality(bad, None)
        except BadInput as exc:
            assert "--locality" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_bad_max_wait_and_guarantee_are_refused_before_any_request() -> None:
    from typer.testing import CliRunner

    from gpupool.cli.main import app

    runner = CliRunner()
    result = runner.invoke(app, ["--url", "http://127.0.0.1:9", "lease", "create", "--max-wait", "-5"])
    assert result.exit_code == 2 and "--max-wait" in result.output
    result = runner.invoke(
        app, ["--url", "http://127.0.0.1:9", "tenant", "create", "t1", "--guaranteed-gpus", "-1"]
    )
    assert result.exit_code == 2 and "--guaranteed-gpus" in result.output


def test_bad_server_cpu_is_refused_before_any_request() -> None:
    from typer.testing import CliRunner

    from gpupool.cli.main import app

    result = CliRunner().invoke(app, ["--url", "http://127.0.0.1:9", "lease", "create", "--cpu", "lots"])
    assert result.exit_code == 2 and "CPU" in result.output
    result = CliRunner().invoke(
        app, ["--url", "http://127.0.0.1:9", "run", "--remote", "--cpu", "2", "--", "true"]
    )
    assert result.exit_code == 2 and "direct runs" in result.output


def test_lazy_without_remote_is_refused_before_any_request() -> None:
    from typer.testing import CliRunner

    from gpupool.cli.main import app

    result = CliRunner().invoke(app, ["--url", "http://127.0.0.1:9", "run", "--lazy", "--", "true"])
    assert result.exit_code == 2 and "--lazy" in result.output and "--remote" in result.output
