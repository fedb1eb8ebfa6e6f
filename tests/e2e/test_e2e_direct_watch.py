"""The watch of direct slices end to end: a real controller, a real agent on simulated GPUs
and `gpupool run`, attacked as a hostile tenant would (issue 20).

A program "uses" a simulated GPU by holding a use file open (SIMULATED, see
gpupool.agent.backends.fake): the agent's watch must stop, within 2 s and with an event
naming the lease, the process and the reason, a program over its lease's memory (after
raising its own MPS variables, as a re-exporting parent does), one on a GPU its lease does not
hold, and one of no lease; a compliant program runs to its end untouched.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_pool import Pool, finish, start_pool, stop_pool

from tests.conftest import AUTH
from tests.timing import scaled

pytestmark = pytest.mark.slow

STOP_WITHIN_S = 2.0

# The program a hostile tenant runs under `gpupool run`: it starts a child with raised MPS
# variables (and, for "foreign", both GPUs visible), the child pretends to allocate, and the
# parent reports how the child ended and how long after its allocation.
PARENT = r"""
import json, os, subprocess, sys, time
sim, kind, every, mib = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
mine = os.environ["CUDA_VISIBLE_DEVICES"]
other = next(g for g in every.split(",") if g != mine)
env = dict(os.environ,
           CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100",
           CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=80G",
           CUDA_VISIBLE_DEVICES=mine + "," + other)
target = other if kind == "foreign" else mine
child = subprocess.Popen([sys.executable, "-c", CHILD, sim, target, str(mib)],
                         env=env, stdout=subprocess.PIPE, text=True)
used_at = float(child.stdout.readline())
code = child.wait()
print(json.dumps({"pid": child.pid, "returncode": code, "after_s": time.time() - used_at}))
""".replace(
    "CHILD",
    repr("""
import sys, time
from gpupool.agent.backends.fake import SimulatedGpuUse
use = SimulatedGpuUse(sys.argv[1], sys.argv[2], int(sys.argv[3]))
print(time.time(), flush=True)
time.sleep(60)
"""),
)

# A compliant program: holds less than its slice until told to end, then ends by itself.
COMPLIANT = r"""
import os, sys, time
from pathlib import Path
from gpupool.agent.backends.fake import SimulatedGpuUse
sim, mib, flag = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
with SimulatedGpuUse(sim, os.environ["CUDA_VISIBLE_DEVICES"], mib):
    while not flag.exists():
        time.sleep(0.05)
print("done", flush=True)
"""

# A process of no lease (or one refused its attach): pretends to use a GPU.
STRAY = r"""
import sys, time
from pathlib import Path
from gpupool.agent.backends.fake import SimulatedGpuUse
from gpupool.protocol.v1.attach import AttachRefused, attach
sim, gpu, sock, lease, token = sys.argv[1:6]
if lease:
    try:
        attach(Path(sock), lease, token)
        print("attached", flush=True)
    except AttachRefused as exc:
        print("refused:", exc, flush=True)
use = SimulatedGpuUse(sim, gpu, 10)
print(time.time(), flush=True)
time.sleep(60)
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    started = start_pool(tmp_path_factory.mktemp("direct-watch"))
    try:
        yield started
    finally:
        stop_pool(started)


def api(pool: Pool) -> httpx.Client:
    return httpx.Client(base_url=pool.url + "/api/v1", headers=AUTH, timeout=30)


def sim_dir(pool: Pool) -> str:
    return str(pool.workdir / "agent" / "simulated-gpu-processes")


def agent_url(pool: Pool) -> str:
    with api(pool) as client:
        (node,) = client.get("/nodes").json()
        return str(node["agent_url"])


def attach_socket(pool: Pool) -> str:
    with api(pool) as client:
        return str(client.get("/gpus").json()[0]["telemetry"]["direct_socket"])


def direct_events(pool: Pool, subject: str) -> list[dict[str, Any]]:
    with api(pool) as client:
        events = client.get("/events", params={"subject": subject, "limit": 200}).json()
    return [e for e in events if e["kind"].startswith("direct.")]


def lease_of(stderr: str) -> str:
    for word in stderr.split():
        if word.startswith("l-"):
            return word
    raise AssertionError(stderr)


def gpus(pool: Pool) -> list[str]:
    return [g["uuid"] for g in pool.json("gpus")]


def run_hostile(pool: Pool, kind: str, mib: int) -> tuple[dict[str, Any], str]:
    done = pool.cli(
        "run", "--compute", "30%", "--memory", "1GiB", "--",
        sys.executable, "-c", PARENT, sim_dir(pool), kind, ",".join(gpus(pool)), str(mib),
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{pool.logs()}"
    return json.loads(done.stdout), lease_of(done.stderr)


def sample(metrics: str, name: str, **labels: str) -> float | None:
    """One sample of a Prometheus exposition, by its labels in any order."""
    for line in metrics.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


def test_a_program_over_its_memory_after_raising_its_mps_limits_is_stopped_within_2s(
    pool: Pool,
) -> None:
    seen, lease_id = run_hostile(pool, "memory", 2048)
    assert seen["returncode"] == -15, f"stopped by SIGTERM: {seen}\n{pool.logs()}"
    assert seen["after_s"] < STOP_WITHIN_S, seen
    (event,) = [e for e in direct_events(pool, lease_id) if e["kind"] == "direct.process_stopped"]
    data = event["data"]
    assert (data["reason"], data["pid"], data["lease_id"]) == ("over_memory", seen["pid"], lease_id)
    assert (data["used_memory_mib"], data["limit_memory_mib"]) == (2048, 1024)
    assert "SimulatedGpuUse" in data["command"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100" in event["message"]
    assert pool.lease(lease_id)["state"] == "released"


def test_a_program_on_a_gpu_its_lease_does_not_hold_is_stopped_within_2s(pool: Pool) -> None:
    seen, lease_id = run_hostile(pool, "foreign", 10)
    granted = pool.lease(lease_id)["slices"][0]["gpu_uuid"]
    (foreign,) = [g for g in gpus(pool) if g != granted]
    assert seen["returncode"] == -15 and seen["after_s"] < STOP_WITHIN_S, seen
    (event,) = [e for e in direct_events(pool, lease_id) if e["kind"] == "direct.process_stopped"]
    assert (event["data"]["reason"], event["data"]["gpu_uuid"]) == ("foreign_gpu", foreign)
    assert event["data"]["pid"] == seen["pid"]


def test_a_compliant_program_runs_untouched_while_attackers_are_refused_and_stopped(
    pool: Pool, tmp_path: Path
) -> None:
    flag = tmp_path / "end"
    victim = pool.spawn(
        "run", "--compute", "30%", "--memory", "1GiB", "--",
        sys.executable, "-c", COMPLIANT, sim_dir(pool), "512", str(flag),
    )  # fmt: skip
    try:
        status_url = agent_url(pool) + "/agent/v1/status"
        attached = pool.wait_for(
            "the victim to be attached",
            lambda: httpx.get(status_url).json()["direct_watch"]["attached"],
        )
        (root,) = attached
        lease_id = root["lease_id"]
        gpu = pool.lease(lease_id)["slices"][0]["gpu_uuid"]
        metrics_url = agent_url(pool) + "/metrics"
        pool.wait_for(
            "the watch to see the victim's 512 MiB",
            lambda: (
                sample(
                    httpx.get(metrics_url).text,
                    "gpupool_direct_lease_memory_used_bytes",
                    lease=lease_id,
                    UUID=gpu,
                )
                == 512 * 1024 * 1024
            ),
        )
        # Attacks: the victim's lease with a guessed token, then with the token of a lease of
        # the attacker's own; each attacker then uses the victim's GPU.
        with api(pool) as client:
            own = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB"}).json()
        assert own["token"], own
        for token in ("guessed", own["token"]):
            attacker = subprocess.Popen(
                [sys.executable, "-c", STRAY, sim_dir(pool), gpu, attach_socket(pool),
                 lease_id, token],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert attacker.stdout is not None
            answer = attacker.stdout.readline()
            assert answer.startswith("refused: wrong token"), answer
            used_at = float(attacker.stdout.readline())
            assert attacker.wait(timeout=scaled(30)) == -15
            assert time.time() - used_at < STOP_WITHIN_S
        status = httpx.get(status_url).json()["direct_watch"]
        assert status["attached"] == attached, "the refused attaches changed nothing"
        assert victim.poll() is None, "the victim still runs"
        pool.ok("lease", "release", own["id"])
        flag.write_text("end")
        out, err = victim.communicate(timeout=scaled(60))
        assert victim.returncode == 0, err
        assert out.strip() == "done"
        assert direct_events(pool, lease_id) == [], "nothing was said against the victim"
        stops = [e for e in direct_events(pool, gpu) if e["kind"] == "direct.process_stopped"]
        assert [e["data"]["reason"] for e in stops][-2:] == ["no_lease", "no_lease"]
    finally:
        flag.write_text("end")
        finish(victim)


def test_a_process_of_no_lease_on_a_gpu_is_stopped_within_2s(pool: Pool) -> None:
    gpu = gpus(pool)[0]
    stray = subprocess.Popen(
        [sys.executable, "-c", STRAY, sim_dir(pool), gpu, "", "", ""],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert stray.stdout is not None
    used_at = float(stray.stdout.readline())
    assert stray.wait(timeout=scaled(30)) == -15
    assert time.time() - used_at < STOP_WITHIN_S
    stopped = [e for e in direct_events(pool, gpu) if e["data"].get("pid") == stray.pid]
    assert [(e["kind"], e["data"]["reason"]) for e in stopped] == [
        ("direct.process_stopped", "no_lease")
    ]
    assert "belongs to no lease" in stopped[0]["message"]
