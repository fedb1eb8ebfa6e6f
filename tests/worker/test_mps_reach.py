"""A CUDA worker refuses to start where its lease's MPS daemon cannot be reached: CUDA would
run it outside MPS, on the whole GPU, without its compute share."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gpupool.worker.server import check_mps_reachable


def test_no_mps_named_means_nothing_to_check() -> None:
    check_mps_reachable({})


def test_an_unreachable_pipe_directory_stops_the_worker(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"not reachable .* outside its compute share"):
        check_mps_reachable({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "missing")})


def test_a_file_in_place_of_the_socket_is_refused(tmp_path: Path) -> None:
    (tmp_path / "control").write_text("")
    with pytest.raises(RuntimeError, match="not the MPS daemon's socket"):
        check_mps_reachable({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})


def test_the_daemons_socket_is_enough(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "control"))
        check_mps_reachable({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
