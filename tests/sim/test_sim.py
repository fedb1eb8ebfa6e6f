"""The simulator: trace files, the fill-up and timeline protocols, the team report, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpupool.cli.main import app
from gpupool.core.errors import InvalidRequest
from gpupool.sim import generate, team
from gpupool.sim.cluster import MIB_PER_MILLI, build_pool, request_of
from gpupool.sim.fillup import arrival_order, run_fillup
from gpupool.sim.timeline import run_timeline
from gpupool.sim.trace import NodeSpec, PodSpec, read_nodes, read_pods, write_nodes, write_pods

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn1,32000,131072,2,V100M16\nn2,64000,262144,4,T4\n"


def test_pods_file_may_omit_the_columns_after_gpu_milli(tmp_path: Path) -> None:
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
        "a,4000,8192,1,500\nb,8000,16384,2,1000\nc,1000,2048,0,0\n"
    )
    read = read_pods(pods)
    assert [(p.num_gpu, p.gpu_milli, p.gpu_spec) for p in read] == [
        (1, 500, ()),
        (2, 1000, ()),
        (0, 0, ()),
    ]
    assert [p.gpu_request_milli() for p in read] == [500, 2000, 0]


def test_gpu_spec_lists_the_allowed_models(tmp_path: Path) -> None:
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
        "deletion_time,scheduled_time\n"
        "a,4000,8192,1,250,V100M16|V100M32,LS,Running,10,70,12\n"
    )
    [pod] = read_pods(pods)
    assert pod.gpu_spec == ("V100M16", "V100M32")
    assert (pod.creation_time, pod.deletion_time, pod.scheduled_time) == (10, 70, 12)
    request = request_of(pod)
    assert request.memory_mib == 250 * MIB_PER_MILLI and request.compute_pct == 25


def test_a_nodes_file_without_a_required_column_is_refused(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,gpu\nn1,1000,1\n")
    with pytest.raises(InvalidRequest, match="memory_mib"):
        read_nodes(nodes)


def test_trace_files_round_trip(tmp_path: Path) -> None:
    nodes = generate.cluster(5, 1)
    pods = generate.pods(50, "openb", 2, duration_s=3600)
    write_nodes(tmp_path / "n.csv", nodes)
    write_pods(tmp_path / "p.csv", pods)
    assert read_nodes(tmp_path / "n.csv") == nodes
    assert read_pods(tmp_path / "p.csv") == pods


def test_fillup_reports_every_whole_percent_up_to_130() -> None:
    nodes = generate.cluster(12, 3)
    pods = generate.pods(120, "openb", 4)
    result = run_fillup(nodes, pods, "default", seed=1)
    assert set(result) == {"policy", "seed", "capacity_gpus", "curve"}
    curve = result["curve"]
    assert [p["arrived_pct"] for p in curve] == list(range(1, len(curve) + 1))
    assert len(curve) >= 130
    for point in curve:
        assert 0 <= point["allocated_pct"] <= 100
        assert 0 <= point["frag_pct"] <= 100
    assert [p["allocated_pct"] for p in curve] == sorted(p["allocated_pct"] for p in curve)


def test_fillup_arrivals_are_every_pod_once_then_resampled_past_130_pct() -> None:
    pods = [PodSpec(f"p{i}", 1000, 1024, 1, 1000) for i in range(10)]
    order = arrival_order(pods, capacity_milli=20_000, seed=3)
    assert sorted(p.name for p in order[:10]) == sorted(p.name for p in pods)
    assert sum(p.gpu_request_milli() for p in order) > 26_000
    assert sum(p.gpu_request_milli() for p in order[:-1]) <= 26_000


def test_fillup_is_reproducible_and_keep_order_replays_the_file_once() -> None:
    nodes = [NodeSpec("n", 64000, 262144, 2, "T4")]
    pods = [PodSpec(f"p{i}", 1000, 1024, 1, 500) for i in range(3)]
    kept = run_fillup(nodes, pods, "best-fit", seed=5, keep_order=True)
    assert kept["curve"][-1]["arrived_pct"] == 75
    assert run_fillup(nodes, pods, "fgd", 9) == run_fillup(nodes, pods, "fgd", 9)


def test_fillup_drops_a_pod_that_does_not_fit() -> None:
    nodes = [NodeSpec("n", 64000, 262144, 1, "T4")]
    pods = [PodSpec("big", 1000, 1024, 2, 1000), PodSpec("ok", 1000, 1024, 1, 1000)]
    curve = run_fillup(nodes, pods, "default", keep_order=True)["curve"]
    assert curve[199]["allocated_pct"] == 0.0
    assert curve[-1] == {"arrived_pct": 300, "allocated_pct": 100.0, "frag_pct": 0.0}


def test_cpu_of_the_server_limits_what_it_takes() -> None:
    pool = build_pool([NodeSpec("n", 4000, 8192, 2, "T4")])
    assert not isinstance(pool.try_grant("a", request_of(PodSpec("a", 3000, 1024, 1, 100))), str)
    assert isinstance(pool.try_grant("b", request_of(PodSpec("b", 3000, 1024, 1, 100))), str)


def test_timeline_reports_waits_completions_and_utilisation() -> None:
    nodes = [NodeSpec("n", 64000, 262144, 1, "T4")]
    pods = [
        PodSpec("first", 1000, 1024, 1, 1000, creation_time=0, deletion_time=100),
        PodSpec("second", 1000, 1024, 1, 1000, creation_time=10, deletion_time=60),
    ]
    result = run_timeline(nodes, pods, "default")
    assert result["started"] == 2
    assert result["wait_s"]["max"] == 90.0  # second waits until first ends at 100
    assert result["completion_s"]["max"] == 140.0  # then runs its 50 s
    assert result["mean_utilisation_pct"] == 100.0
    assert result["utilisation"][0]["allocated_pct"] == 0.0


def test_team_report_finds_fewer_gpus_than_dedicated_ones() -> None:
    result = team.report(8, days=1, seed=2)
    assert result["pooled_gpus"] < result["dedicated_gpus"] == 12
    assert result["p95_slice_wait_s"] < 60
    smaller = [t for t in result["tried"] if t["gpus"] == result["pooled_gpus"] - 1]
    assert all(t["p95_slice_wait_s"] >= 60 for t in smaller)


def test_cli_fillup_prints_the_issues_json(tmp_path: Path) -> None:
    (tmp_path / "nodes.csv").write_text(NODES)
    write_pods(tmp_path / "pods.csv", generate.pods(40, "sharing", 1))
    args = ["sim", "fillup", "--nodes", str(tmp_path / "nodes.csv")]
    args += ["--pods", str(tmp_path / "pods.csv"), "--policy", "default", "--seed", "1"]
    out = CliRunner().invoke(app, [*args, "-o", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert (data["policy"], data["seed"], data["capacity_gpus"]) == ("default", 1, 6)
    assert set(data["curve"][0]) == {"arrived_pct", "allocated_pct", "frag_pct"}


def test_cli_refuses_an_unknown_policy(tmp_path: Path) -> None:
    (tmp_path / "nodes.csv").write_text(NODES)
    (tmp_path / "pods.csv").write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n")
    args = ["sim", "fillup", "--nodes", str(tmp_path / "nodes.csv")]
    out = CliRunner().invoke(app, [*args, "--pods", str(tmp_path / "pods.csv"), "--policy", "x"])
    assert out.exit_code == 2
    assert "unknown placement policy" in out.output


def test_cli_team_report_as_json() -> None:
    out = CliRunner().invoke(app, ["sim", "--team", "6", "--days", "1", "-o", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["engineers"] == 6 and data["dedicated_gpus"] == 9


def test_idle_release_splits_notebooks_into_bursts_and_needs_no_more_gpus() -> None:
    from gpupool.sim import team

    held = team.workload(12, 1, seed=3)
    elastic = team.workload(12, 1, seed=3, idle_release_s=120.0)
    def others(jobs: list[team.Job]) -> list[tuple[float, float | None, str]]:
        return [(j.arrival_s, j.duration_s, j.kind) for j in jobs if j.kind != "notebook"]

    assert others(held) == others(elastic), "only notebooks change"
    open_s = sum(j.duration_s or 0 for j in held if j.kind == "notebook")
    busy_s = sum(j.duration_s or 0 for j in elastic if j.kind == "notebook")
    assert 0 < busy_s < open_s, "a notebook holds its slice only around its bursts"
    off = team.report(12, 1, seed=3)
    on = team.report(12, 1, seed=3, idle_release_s=120.0)
    assert on["idle_release_s"] == 120.0 and off["idle_release_s"] is None
    assert on["pooled_gpus"] <= off["pooled_gpus"]
