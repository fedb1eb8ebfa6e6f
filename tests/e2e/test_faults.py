"""Fault injection on a pool spread over network namespaces: the controller, an agent, a
worker killed with -9, and a node cut off from the network. Each test states what must
survive, checks that nothing granted or queued was lost or granted twice, and leaves a
record for bench/results/reliability.md (bench/reliability.py runs this file)."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
from netpool import NetPool
from pool_checks import FaultRecord, all_leases, double_grants

from gpupool.protocol.v1.api import LeaseCreate, LeaseOut

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

HERE = Path(__file__).parent
HOLDING = ("granted", "active", "idle")

TRAIN = textwrap.dedent(
    """
    import json, sys, time, torch
    seconds = float(sys.argv[1])
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 8, device="cuda"), torch.randn(32, 1, device="cuda")
    print("training", flush=True)
    losses, until = [], time.monotonic() + seconds
    while time.monotonic() < until:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        time.sleep(0.05)
    print(json.dumps({"steps": len(losses), "first": losses[0], "last": losses[-1]}), flush=True)
    """
)


PG_SOCKET_DIR = Path("/var/run/postgresql")


@pytest.fixture(params=["sqlite", "postgresql"])
def ctl_db(request: pytest.FixtureRequest) -> list[str]:
    """The controller's `--db` arguments: SQLite in its data dir, or a fresh PostgreSQL
    database reached through PostgreSQL's Unix socket (its TCP port on the machine's
    loopback is not on the controller host's network; the socket's path is)."""
    if request.param == "sqlite":
        return []
    url = str(request.getfixturevalue("pg_url"))
    if not (PG_SOCKET_DIR / ".s.PGSQL.5432").exists():
        pytest.skip(f"no PostgreSQL socket in {PG_SOCKET_DIR} for the controller's host")
    user = url.split("//", 1)[1].split("@", 1)[0]
    name = url.rsplit("/", 1)[1]
    return ["--db", f"postgresql://{user}@/{name}?host={PG_SOCKET_DIR}"]


def _train_script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


def _log(netpool: NetPool, name: str) -> str:
    return (netpool.workdir / name).read_text(errors="replace")


def _wait_exit(netpool: NetPool, proc, what: str, timeout_s: float = 120) -> int:  # type: ignore[no-untyped-def]
    try:
        return int(proc.wait(timeout=timeout_s))
    except Exception:
        raise AssertionError(f"{what} did not end in {timeout_s:.0f} s\n{netpool.logs()}") from None


def _lease(netpool: NetPool, lease_id: str) -> LeaseOut:
    return netpool.call(lambda api: api.lease(lease_id))


def _live_remote(netpool: NetPool, node: str) -> LeaseOut | None:
    """The remote lease on `node` once its worker listens."""
    for lease in netpool.call(lambda api: api.leases()):
        if lease.access == "remote" and any(p.node == node and p.endpoint for p in lease.slices):
            return lease
    return None


def _check_grants(netpool: NetPool, rec: FaultRecord) -> None:
    problems = netpool.call(double_grants)
    rec.lost += [f"double grant: {p}" for p in problems]
    if not problems:
        rec.survived.append("no GPU granted twice; the controller's counts match its leases")


# ---- a) the controller, kill -9 under load --------------------------------------------------


def test_controller_kill9_under_load_loses_and_duplicates_nothing(
    ctl_db: list[str], netpool: NetPool, tmp_path: Path, record: FaultRecord
) -> None:
    # ctl_db first: its database is dropped after the controller is stopped, not before.
    store = "PostgreSQL" if ctl_db else "SQLite"
    record.fault = f"kill -9 of the controller ({store}) under load, started again 2 s later"
    netpool.start_controller("--node-timeout", "3", *ctl_db)
    netpool.start_agent("gpu-a")
    netpool.start_agent("gpu-b")
    netpool.wait_nodes_up("gpu-a", "gpu-b")
    train = _train_script(tmp_path)
    remote = netpool.spawn(
        "run", "--remote", "--node", "gpu-b", "--compute", "10%", "--memory", "1GiB", "--",
        sys.executable, str(train), "25", log="remote-run.log",
    )  # fmt: skip
    direct = netpool.spawn(
        "run", "--node", "gpu-a", "--compute", "10%", "--memory", "1GiB", "--",
        "sleep", "20", log="direct-run.log", host=netpool.agents["gpu-a"],
    )  # fmt: skip
    netpool.wait_for(
        "the remote run to train", lambda: "training" in _log(netpool, "remote-run.log"), 120
    )
    answers = tmp_path / "load.json"
    load = netpool.python(HERE / "fault_load.py", str(answers), "16", "4", log="load.log")
    record.setup = (
        "2 agents (fake GPUs) on 2 hosts; 4 SDK clients creating, heartbeating and releasing "
        "10-30 % slices (some queue); a remote `gpupool run` training; a direct `gpupool run`"
    )
    time.sleep(6)
    before = netpool.call(all_leases)
    netpool.kill9_controller()
    time.sleep(2)
    netpool.start_controller()
    restarted_at = time.monotonic()

    assert _wait_exit(netpool, load, "the load") == 0, _log(netpool, "load.log")
    assert _wait_exit(netpool, remote, "the remote run") == 0, _log(netpool, "remote-run.log")
    assert _wait_exit(netpool, direct, "the direct run") == 0, _log(netpool, "direct-run.log")
    record.survived.append("the remote `gpupool run` trained on through the outage (exit 0)")
    record.survived.append("the direct `gpupool run` kept its lease and finished (exit 0)")

    # Agents came back by themselves: past the node timeout after the restart, still up.
    time.sleep(max(0.0, 4.0 - (time.monotonic() - restarted_at)))
    nodes = {n.name: n.state for n in netpool.call(lambda api: api.nodes())}
    assert nodes == {"gpu-a": "up", "gpu-b": "up"}, nodes
    record.survived.append("both agents heartbeat the new controller (nodes up past the timeout)")

    after = netpool.call(all_leases)
    lost = [lid for lid in before if lid not in after]
    assert not lost, f"leases lost in the crash: {lost}"
    regressed = [
        lid for lid, lease in before.items()
        if lease.state in HOLDING and after[lid].state == "queued"
    ]  # fmt: skip
    assert not regressed
    answered = json.loads(answers.read_text())
    ids = [a["id"] for a in answered if a["tag"] is not None and a["id"] is not None]
    missing = [lid for lid in ids if lid not in after]
    assert not missing, f"answered but gone: {missing}"
    by_tag: dict[str, int] = {}
    for lease in after.values():
        by_tag[lease.holder] = by_tag.get(lease.holder, 0) + 1
    twice = [tag for tag, n in by_tag.items() if n > 1 and tag.startswith("load-")]
    assert not twice, f"requests recorded twice: {twice}"
    released = {a["id"] for a in answered if a["answer"] == "released"}
    back = [lid for lid in released if after[lid].state != "released"]
    assert not back, f"released leases back: {back}"
    still = [a["id"] for a in answered if a["answer"] == "still held"]
    dropped = [lid for lid in still if after[lid].state == "released"]
    assert not dropped, (
        f"held leases released: {[(lid, after[lid].release_reason) for lid in dropped]}"
    )
    unanswered = [a for a in answered if a["answer"] == "unreachable"]
    record.survived.append(
        f"{len(ids)} answered requests, all present after the restart; {len(before)} leases "
        f"known at the kill, all present in the same or a later state; {len(still)} leases "
        f"held at the end, all still held"
    )
    record.survived.append(
        f"{len(unanswered)} requests sent while the controller was down got no answer and "
        "were retried by the client; none recorded twice"
    )
    _check_grants(netpool, record)
    assert not record.lost, record.lost


# ---- b) an agent dies -----------------------------------------------------------------------


def test_agent_kill9_keeps_leases_and_adopts_its_workers_when_it_returns(
    netpool: NetPool, tmp_path: Path, record: FaultRecord
) -> None:
    record.fault = "kill -9 of an agent for 5 s (past the node timeout), node-lost-policy keep"
    record.setup = (
        "a remote `gpupool run` training on the agent's GPU, a direct lease held by an SDK client"
    )
    netpool.start_controller("--node-timeout", "2")
    netpool.start_agent("gpu-a")
    netpool.wait_nodes_up("gpu-a")
    train = _train_script(tmp_path)
    remote = netpool.spawn(
        "run", "--remote", "--node", "gpu-a", "--compute", "20%", "--memory", "1GiB", "--",
        sys.executable, str(train), "20", log="remote-run.log",
    )  # fmt: skip
    with netpool.api() as api:
        direct = api.create_lease(
            LeaseCreate(compute_pct=30, memory="1GiB", ttl_s=60, node="gpu-a")
        )
    netpool.wait_for(
        "the remote run to train", lambda: "training" in _log(netpool, "remote-run.log"), 120
    )
    workers = netpool.worker_pids("gpu-a")
    assert len(workers) == 1

    netpool.kill9_agent("gpu-a")
    netpool.wait_for(
        "the node to go down",
        lambda: netpool.call(lambda api: api.node("gpu-a")).state == "down",
    )
    assert netpool.worker_pids("gpu-a") == workers, "the worker outlives its agent"
    netpool.call(lambda api: api.heartbeat_lease(direct.id))
    time.sleep(3)
    netpool.start_agent("gpu-a")
    netpool.wait_nodes_up("gpu-a")
    netpool.call(lambda api: api.heartbeat_lease(direct.id))

    assert _wait_exit(netpool, remote, "the remote run") == 0, _log(netpool, "remote-run.log")
    assert "adopted the worker" in _log(netpool, "agent-gpu-a.log")
    record.survived.append(
        "the worker kept serving while its agent was dead; the new agent adopted it"
    )
    record.survived.append("the remote `gpupool run` finished its training (exit 0)")
    assert _lease(netpool, direct.id).state in HOLDING
    record.survived.append("the direct lease, heartbeated by its holder, stayed granted")
    netpool.wait_for(
        "the adopted worker to stop with its lease", lambda: not netpool.worker_pids("gpu-a")
    )
    record.survived.append("the adopted worker was stopped when its lease ended")
    _check_grants(netpool, record)
    netpool.call(lambda api: api.release_lease(direct.id))
    assert not record.lost, record.lost


def _remote_lease_with_worker(netpool: NetPool, node: str) -> LeaseOut:
    with netpool.api() as api:
        lease = api.create_lease(
            LeaseCreate(access="remote", compute_pct=25, memory="1GiB", ttl_s=60, node=node)
        )

    def running() -> LeaseOut | None:
        now = netpool.call(lambda api: api.heartbeat_lease(lease.id))
        return now if all(p.endpoint for p in now.slices) else None

    result: LeaseOut = netpool.wait_for("the worker to start", running, 120)
    return result


def test_worker_gone_while_its_agent_was_dead_ends_its_lease_with_the_reason(
    netpool: NetPool, record: FaultRecord
) -> None:
    record.fault = "kill -9 of an agent, then of its worker; the agent started again"
    record.setup = "a remote lease held (heartbeated) by an SDK client"
    netpool.start_controller()
    netpool.start_agent("gpu-a")
    netpool.wait_nodes_up("gpu-a")
    lease = _remote_lease_with_worker(netpool, "gpu-a")
    netpool.kill9_agent("gpu-a")
    (worker,) = netpool.worker_pids("gpu-a")
    os.kill(worker, signal.SIGKILL)
    netpool.start_agent("gpu-a")

    ended = netpool.wait_for(
        "the lease to end", lambda: (now := _lease(netpool, lease.id)).state == "released" and now
    )
    assert ended.release_reason.startswith("its worker died")
    assert "exited while the agent was not running" in ended.release_reason
    record.survived.append(f"the lease ended with the reason: {ended.release_reason!r}")
    gpu = netpool.call(lambda api: api.gpu("GPU-sim-gpu-a-0"))
    assert gpu.compute_granted_pct == 0
    record.survived.append(
        "its slice went back to the pool; no empty worker was started in its place"
    )
    assert not netpool.worker_pids("gpu-a")
    _check_grants(netpool, record)
    assert not record.lost


def test_node_lost_policy_release_ends_the_leases_of_a_dead_agent(
    netpool: NetPool, record: FaultRecord
) -> None:
    record.fault = (
        "kill -9 of an agent, node-lost-policy release with a 2 s grace; agent back later"
    )
    record.setup = "a remote lease and a direct lease on the agent's GPU, both heartbeated"
    netpool.start_controller(
        "--node-timeout", "2", "--node-lost-policy", "release", "--node-lost-grace", "2"
    )
    netpool.start_agent("gpu-a")
    netpool.wait_nodes_up("gpu-a")
    remote = _remote_lease_with_worker(netpool, "gpu-a")
    with netpool.api() as api:
        direct = api.create_lease(
            LeaseCreate(compute_pct=30, memory="1GiB", ttl_s=60, node="gpu-a")
        )
    netpool.kill9_agent("gpu-a")

    def both_released() -> bool:
        with netpool.api() as api:
            return all(api.heartbeat_lease(x.id).state == "released" for x in (remote, direct))

    netpool.wait_for("the policy to release both leases", both_released, 30)
    for lease in (remote, direct):
        reason = _lease(netpool, lease.id).release_reason or ""
        assert reason.startswith("its node was lost: node gpu-a silent for"), reason
    record.survived.append(
        "both leases released by the policy, saying so: 'its node was lost: ...'"
    )
    netpool.start_agent("gpu-a")
    netpool.wait_nodes_up("gpu-a")
    netpool.wait_for(
        "the worker of the released lease to stop", lambda: not netpool.worker_pids("gpu-a")
    )
    record.survived.append("the returning agent stopped the worker of the released lease")
    assert {_lease(netpool, lease.id).state for lease in (remote, direct)} == {"released"}
    record.survived.append("the released leases stayed released")
    _check_grants(netpool, record)
    assert not record.lost


# ---- c) a worker dies -----------------------------------------------------------------------


def test_worker_kill9_gives_its_program_a_clear_error_and_frees_the_slice(
    netpool: NetPool, tmp_path: Path, record: FaultRecord
) -> None:
    record.fault = "kill -9 of the worker of a remote lease while its program trains"
    record.setup = "a remote `gpupool run` on another host"
    netpool.start_controller()
    netpool.start_agent("gpu-a")
    netpool.wait_nodes_up("gpu-a")
    train = _train_script(tmp_path)
    run = netpool.spawn(
        "run", "--remote", "--compute", "40%", "--memory", "1GiB", "--",
        sys.executable, str(train), "120", log="remote-run.log",
    )  # fmt: skip
    netpool.wait_for(
        "the program to train", lambda: "training" in _log(netpool, "remote-run.log"), 120
    )
    lease = _live_remote(netpool, "gpu-a")
    assert lease is not None
    (worker,) = netpool.worker_pids("gpu-a")
    killed_at = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    code = _wait_exit(netpool, run, "the program", 60)
    took = time.monotonic() - killed_at
    output = _log(netpool, "remote-run.log")
    assert code != 0
    assert "WorkerLost" in output and f"lease {lease.id}" in output, output
    record.survived.append(
        f"the program stopped {took:.1f} s later with gpupool.torch.WorkerLost naming lease "
        f"{lease.id}; `gpupool run` exited {code}"
    )
    ended = netpool.wait_for(
        "the lease to end", lambda: (now := _lease(netpool, lease.id)).state == "released" and now
    )
    gpu = netpool.call(lambda api: api.gpu("GPU-sim-gpu-a-0"))
    assert gpu.compute_granted_pct == 0
    record.survived.append(
        f"the slice went back to the pool (lease released: {ended.release_reason})"
    )
    _check_grants(netpool, record)
    assert not record.lost


def test_worker_kill9_of_an_idle_client_ends_the_lease_with_the_reason(
    netpool: NetPool, record: FaultRecord
) -> None:
    record.fault = "kill -9 of the worker of a remote lease whose holder only heartbeats"
    record.setup = "a remote lease held by an SDK client, no program connected"
    netpool.start_controller()
    netpool.start_agent("gpu-a")
    netpool.wait_nodes_up("gpu-a")
    lease = _remote_lease_with_worker(netpool, "gpu-a")
    (worker,) = netpool.worker_pids("gpu-a")
    os.kill(worker, signal.SIGKILL)
    beat = netpool.wait_for(
        "the heartbeat to say the lease ended",
        lambda: (
            (now := netpool.call(lambda api: api.heartbeat_lease(lease.id))).state == "released"
            and now
        ),
    )
    assert (
        beat.release_reason
        == "its worker died: worker on GPU-sim-gpu-a-0: worker killed by signal 9"
    )
    record.survived.append(
        f"the holder's next heartbeat answered: released, {beat.release_reason!r}"
    )
    assert netpool.call(lambda api: api.gpu("GPU-sim-gpu-a-0")).compute_granted_pct == 0
    record.survived.append("the slice went back to the pool")
    _check_grants(netpool, record)
    assert not record.lost


# ---- d) a node cut off ----------------------------------------------------------------------


def test_cut_off_node_loses_its_leases_by_policy_and_nothing_is_granted_twice_after_it_heals(
    netpool: NetPool, tmp_path: Path, record: FaultRecord
) -> None:
    record.fault = "a GPU host's link taken down (node-lost-policy release, grace 2 s) until its leases are released and both runs stopped"
    record.setup = (
        "on the cut host's GPU: a direct `gpupool run` (ttl 10 s) on that host, and a remote "
        "`gpupool run` from the client host; a request for the whole GPU queued meanwhile"
    )
    netpool.start_controller(
        "--node-timeout", "2", "--node-lost-policy", "release", "--node-lost-grace", "2"
    )
    netpool.start_agent("gpu-a")
    netpool.start_agent("gpu-b")
    netpool.wait_nodes_up("gpu-a", "gpu-b")
    host = netpool.agents["gpu-a"]
    train = _train_script(tmp_path)
    direct = netpool.spawn(
        "run", "--node", "gpu-a", "--ttl", "10", "--grace", "2", "--compute", "30%",
        "--memory", "1GiB", "--", "sleep", "300", log="direct-run.log", host=host,
    )  # fmt: skip
    remote = netpool.spawn(
        "run", "--remote", "--node", "gpu-a", "--grace", "2", "--compute", "30%",
        "--memory", "1GiB", "--", sys.executable, str(train), "300", log="remote-run.log",
    )  # fmt: skip
    netpool.wait_for(
        "the remote run to train", lambda: "training" in _log(netpool, "remote-run.log"), 120
    )
    held = {lease.id: lease for lease in netpool.call(lambda api: api.leases())}
    assert len(held) == 2

    host.cut()
    netpool.wait_for(
        "the node to go down", lambda: netpool.call(lambda api: api.node("gpu-a")).state == "down"
    )
    with netpool.api() as api:
        whole = api.create_lease(
            LeaseCreate(compute_pct=100, memory="1GiB", ttl_s=120, node="gpu-a")
        )
    assert whole.state == "queued"
    netpool.wait_for(
        "the policy to release the cut node's leases",
        lambda: all(_lease(netpool, lid).state == "released" for lid in held),
        30,
    )
    for lid in held:
        reason = _lease(netpool, lid).release_reason or ""
        assert reason.startswith("its node was lost"), reason
    record.survived.append("both leases released by the policy ('its node was lost: ...')")
    assert _wait_exit(netpool, remote, "the remote run", 60) == 1
    assert "taken away" in _log(netpool, "remote-run.log")
    record.survived.append("the remote `gpupool run` was told and stopped its program (exit 1)")
    assert _wait_exit(netpool, direct, "the direct run (fenced)", 60) == 1
    assert "no answer from the controller" in _log(netpool, "direct-run.log")
    record.survived.append(
        "the direct `gpupool run` on the cut host stopped its program by itself after its "
        "ttl without an answer, before the GPU could be granted again (exit 1)"
    )
    stranded = netpool.worker_pids("gpu-a")
    assert stranded, "while cut off, the agent cannot know: its worker still runs"
    netpool.call(lambda api: api.heartbeat_lease(whole.id))

    host.heal()
    netpool.wait_for(
        "the queued request to be granted", lambda: _lease(netpool, whole.id).state in HOLDING
    )
    assert not netpool.worker_pids("gpu-a"), "granted while a stale worker held the GPU"
    record.survived.append(
        "after the link came back: the worker of the released lease was stopped before the "
        "node took new leases"
    )
    assert all(_lease(netpool, lid).state == "released" for lid in held)
    record.survived.append(
        "the released leases stayed released; the queued request got the whole GPU"
    )
    gpu = netpool.call(lambda api: api.gpu("GPU-sim-gpu-a-0"))
    assert gpu.leases == [whole.id] and gpu.compute_granted_pct == 100
    _check_grants(netpool, record)
    netpool.call(lambda api: api.release_lease(whole.id))
    assert not record.lost, record.lost
