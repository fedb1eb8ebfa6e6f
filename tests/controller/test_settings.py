"""Where the controller keeps its SQLite database, and who may read it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpupool.controller.settings import ControllerSettings

NOBODY = 65534


def test_the_data_dir_is_made_owner_only(tmp_path: Path) -> None:
    data = tmp_path / "data"
    url = ControllerSettings(data_dir=data).database_url()
    assert url == f"sqlite:///{(data / 'gpupool.db').resolve()}"
    assert stat.S_IMODE(data.stat().st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another user")
def test_a_volume_of_another_owner_gets_an_owner_only_database() -> None:
    """A pod's emptyDir is root's and 0777; a controller of another user cannot chmod it and
    must still start, its database readable by that user alone."""
    with tempfile.TemporaryDirectory(prefix="gpupool-volume-") as where:  # pytest's is 0700
        Path(where).chmod(0o755)
        check_volume(Path(where))


def check_volume(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir(mode=0o777)
    volume.chmod(0o777)
    code = (
        "import pathlib, sys; from gpupool.controller.settings import ControllerSettings; "
        "print(ControllerSettings(data_dir=pathlib.Path(sys.argv[1])).database_url())"
    )
    done = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "--",
            sys.executable,
            "-c",
            code,
            str(volume),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    database = volume / "gpupool.db"
    assert done.stdout.strip() == f"sqlite:///{database.resolve()}"
    info = database.stat()
    assert info.st_uid == NOBODY and stat.S_IMODE(info.st_mode) == 0o600
