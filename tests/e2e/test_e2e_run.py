"""`gpupool run` against a real pool: environment, exit codes, release on every kind of end."""

from __future__ import annotations

import json
import re
import signal
import sys

import pytest
from e2e_pool import Pool

from tests.timing import scaled

pytestmark = pytest.mark.slow

PRINT_ENV = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith(('CUDA', 'GPUPOOL'))}))"
)


def lease_id_of(stderr: str) -> str:
    found = re.search(r"lease (\S+) granted", stderr)
    assert found, stderr
    return found.group(1)


def test_command_sees_its_slice_and_the_lease_is_released(pool: Pool) -> None:
    done = pool.ok(
        "run", "--compute", "30%", "--memory", "8GiB", "--", sys.executable, "-c", PRINT_ENV
    )
    env = json.loads(done.stdout)
    lease = pool.lease(env["GPUPOOL_LEASE_ID"])
    assert env["CUDA_VISIBLE_DEVICES"] == lease["slices"][0]["gpu_uuid"]
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert env["GPUPOOL_SIMULATED"] == "1"
    assert env["GPUPOOL_URL"] == pool.url
    assert lease["state"] == "released"


def test_exit_code_of_the_command_is_kept_and_the_lease_released(pool: Pool) -> None:
    done = pool.cli(
        "run", "--compute", "10%", "--", sys.executable, "-c", "import os,sys; sys.exit(3)"
    )
    assert done.returncode == 3, done.stderr
    lease = pool.lease(lease_id_of(done.stderr))
    assert lease["state"] == "released"
    assert pool.json("lease", "ls") == []


def test_physical_run_gets_a_whole_gpu_without_mps_limits(pool: Pool) -> None:
    uuid = pool.json("gpus")[0]["uuid"]
    pool.ok("gpu", "mode", uuid, "physical")
    done = pool.ok("run", "--physical", "--", sys.executable, "-c", PRINT_ENV)
    env = json.loads(done.stdout)
    assert env["CUDA_VISIBLE_DEVICES"] == uuid
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env


def test_sigterm_stops_the_command_and_releases_the_lease(pool: Pool) -> None:
    proc = pool.spawn(
        "run", "--compute", "10%", "--", sys.executable, "-c", "import time; time.sleep(120)"
    )
    live = pool.wait_for("the lease to be granted", lambda: pool.json("lease", "ls"))
    lease_id = live[0]["id"]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=scaled(30))
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert pool.lease(lease_id)["state"] == "released"


def test_sigterm_while_queued_cancels_the_request(pool: Pool) -> None:
    pool.json("lease", "create", "--gpus", "2", "--compute", "100%")
    proc = pool.spawn("run", "--compute", "10%", "--", sys.executable, "-c", "pass")
    queued = pool.wait_for("the request to queue", lambda: pool.json("queue"))
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=scaled(30))
    assert proc.returncode == 128 + signal.SIGTERM
    assert pool.lease(queued[0]["lease"]["id"])["state"] == "released"


def test_command_is_stopped_when_the_lease_is_taken_away(pool: Pool) -> None:
    proc = pool.spawn(
        "run", "--compute", "10%", "--ttl", "1.5", "--grace", "2", "--",
        sys.executable, "-c", "import time; time.sleep(120)",
    )  # fmt: skip
    live = pool.wait_for("the lease to be granted", lambda: pool.json("lease", "ls"))
    pool.ok("lease", "release", live[0]["id"])
    _, err = proc.communicate(timeout=scaled(30))
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: lease ") and "taken away" in last


def test_no_wait_run_fails_when_nothing_fits(pool: Pool) -> None:
    pool.json("lease", "create", "--gpus", "2", "--compute", "100%")
    done = pool.cli("run", "--no-wait", "--compute", "10%", "--", sys.executable, "-c", "pass")
    assert done.returncode == 2
    assert done.stdout == ""


def test_missing_command_is_exit_127_and_releases(pool: Pool) -> None:
    done = pool.cli("run", "--compute", "10%", "--", "/nonexistent/program")
    assert done.returncode == 127
    assert pool.json("lease", "ls") == []
