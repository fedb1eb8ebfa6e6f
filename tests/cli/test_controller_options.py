"""`gpupool controller` refuses a bad node-lost policy with one line, before it starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gpupool.cli.main import app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--node-lost-policy", "forget"], "--node-lost-policy must be one of keep, release"),
        (["--node-lost-grace", "-1"], "--node-lost-grace must not be negative"),
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
