"""`gpupool controller` refuses bad options (node-lost policy, default priority cap) with one
line, before it starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gpupool.cli.main import app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--node-lost-policy", "forget"], "--node-lost-policy must be one of keep, release"),
        (["--node-lost-grace", "-1"], "--node-lost-grace must not be negative"),
        (["--default-max-priority", "1001"], "--default-max-priority must be 0..1000"),
        (["--default-max-priority", "-1"], "--default-max-priority must be 0..1000"),
        (["--max-body-mib", "0"], "--max-body-mib must be 1..1024"),
        (["--max-body-mib", "2048"], "--max-body-mib must be 1..1024"),
    ],
)
def test_bad_node_lost_options_exit_2_with_one_line(
    tmp_path, args: list[str], message: str
) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(app, ["controller", "--data-dir", str(tmp_path), *args])
    assert result.exit_code == 2
    assert message in result.output
    assert not (tmp_path / "gpupool.db").exists(), "nothing was started"


def test_the_clis_default_priority_cap_is_the_controllers() -> None:
    from gpupool.cli.pool import DEFAULT_MAX_PRIORITY
    from gpupool.controller.settings import ControllerSettings

    assert ControllerSettings().default_max_priority == DEFAULT_MAX_PRIORITY == 0


def test_the_default_priority_cap_is_documented_in_help() -> None:
    result = CliRunner().invoke(app, ["controller", "--help"], terminal_width=200)
    assert "--default-max-priority" in result.output
