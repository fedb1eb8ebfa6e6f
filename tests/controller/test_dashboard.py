"""The dashboard's page and read API, and the bounded history behind its charts."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool.controller.services.history import History, Ring, TierSpec, load, save
from tests.controller.inprocess import API, TestClient, controller, register
from tests.timing import scaled

STATIC = Path(__file__).parents[2] / "src" / "gpupool" / "controller" / "dashboard" / "static"


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with controller(tmp_path) as client:
        yield client


def wait_for(check, timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


# ---- the page -------------------------------------------------------------------------------


def test_page_and_its_files_are_served_with_strict_headers(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-frame-options"] == "DENY"
    for name, kind in (
        ("app.js", "text/javascript"),
        ("app.css", "text/css"),
        ("favicon.svg", "image/svg+xml"),
    ):
        response = client.get(f"/dashboard/{name}")
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
        again = client.get(
            f"/dashboard/{name}", headers={"If-None-Match": response.headers["etag"]}
        )
        assert again.status_code == 304
    assert client.get("/dashboard/missing.js").status_code == 404


def test_page_loads_only_its_own_files() -> None:
    html = (STATIC / "index.html").read_text()
    references = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert references and all(r.startswith(("/", "#")) for r in references), references
    script = (STATIC / "app.js").read_text()
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", script)
    assert "import " not in script and "eval(" not in script


# ---- the read API ---------------------------------------------------------------------------


def test_overview_summarises_modes_grants_queue_and_alerts(client: TestClient) -> None:
    uuids = register(client, gpus=3)
    client.post(f"{API}/leases", json={"compute_pct": 50, "memory": "8GiB", "holder": "alice"})
    client.post(f"{API}/leases", json={"compute_pct": 100, "memory": "80GiB"})
    client.post(f"{API}/gpus/{uuids[2]}/isolate", json={"reason": "fan"})
    client.post(f"{API}/leases", json={"gpus": 2, "compute_pct": 100, "memory": "80GiB"})
    o = client.get(f"{API}/dashboard/overview").json()
    assert o["gpus_total"] == 3
    assert o["gpus_by_mode"] == {"virtual": 2, "physical": 0, "draining": 0, "isolated": 1}
    assert o["compute_granted_pct"] == 150
    assert o["compute_capacity_pct"] == 200
    assert o["memory_granted_mib"] == 88 * 1024
    assert o["leases_holding"] == 2 and o["queue_length"] == 1
    assert o["queue_oldest_wait_s"] >= 0
    assert o["nodes_up"] == 1 and o["nodes_down"] == 0
    assert o["fragmentation"] == 1.0  # the only free compute sits beside alice's slice
    assert len(o["gpus"]) == 3 and {g["mode"] for g in o["gpus"]} == {"virtual", "isolated"}
    assert [t["name"] for t in o["tenants"]] == ["default"]
    alerts = wait_for(lambda: client.get(f"{API}/dashboard/overview").json()["alerts"])
    assert alerts[0]["name"] == "GpupoolGpuIsolated" and "fan" in alerts[0]["summary"]


def test_gpu_detail_shows_each_slice_and_who_holds_it(client: TestClient) -> None:
    [uuid] = register(client, gpus=1)
    client.post(f"{API}/tenants", json={"name": "vision"})
    a = client.post(
        f"{API}/leases", json={"compute_pct": 30, "memory": "10GiB", "holder": "alice@nb"}
    ).json()
    b = client.post(
        f"{API}/leases",
        json={"tenant": "vision", "compute_pct": 50, "memory": "20GiB", "holder": "train-7"},
    ).json()
    d = client.get(f"{API}/dashboard/gpus/{uuid}").json()
    assert d["compute_capacity_pct"] == 100 and d["memory_capacity_mib"] == 81920
    holders = {h["lease_id"]: h for h in d["holders"]}
    assert holders[a["id"]]["holder"] == "alice@nb" and holders[a["id"]]["compute_pct"] == 30
    assert holders[b["id"]]["tenant"] == "vision" and holders[b["id"]]["memory_mib"] == 20 * 1024
    assert [h["lease_id"] for h in d["holders"]] == [b["id"], a["id"]]  # the bigger slice first
    assert client.get(f"{API}/dashboard/gpus/GPU-none").status_code == 404


def test_servers_show_host_readings_and_network_rates_beside_their_gpus(client: TestClient) -> None:
    register(client, gpus=2)
    host = {"cpu_pct": 40.0, "load1": 1.5, "memory_used_mib": 2048, "memory_total_mib": 8192,
            "disk_used_mib": 100, "disk_total_mib": 1000, "net_sent_bytes": 1_000, "net_recv_bytes": 5_000}  # fmt: skip
    client.post(f"{API}/nodes/node-a/heartbeat", json={"host": host})
    time.sleep(1.5)
    host |= {"net_sent_bytes": 2_000_000, "net_recv_bytes": 5_000}
    client.post(f"{API}/nodes/node-a/heartbeat", json={"host": host})

    def rated() -> dict | None:  # type: ignore[type-arg]
        [s] = client.get(f"{API}/dashboard/servers").json()
        return s if s["net_sent_bytes_per_s"] else None

    s = wait_for(rated)
    assert s["name"] == "node-a" and s["up"] is True
    assert (s["cpu_pct"], s["memory_used_mib"], s["disk_total_mib"]) == (40.0, 2048, 1000)
    assert 0.5e6 < s["net_sent_bytes_per_s"] < 2.0e6
    assert s["net_recv_bytes_per_s"] == 0
    assert [g["index"] for g in s["gpus"]] == [0, 1]


def test_history_serves_the_pool_series_the_charts_draw(client: TestClient) -> None:
    register(client, gpus=2)
    client.post(f"{API}/leases", json={"compute_pct": 25, "memory": "1GiB"})
    keys = "pool.compute_granted_pct,pool.queue_length"

    def sampled() -> dict | None:  # type: ignore[type-arg]
        h = client.get(f"{API}/history", params={"keys": keys, "range_s": 900}).json()
        return h if h["t"] and h["series"]["pool.compute_granted_pct"][-1] == 25 else None

    h = wait_for(sampled)
    assert h["step_s"] == 5
    assert len(h["t"]) == len(h["series"]["pool.queue_length"])


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"keys": "", "range_s": 60}, "at least one series"),
        ({"keys": "pool.x", "range_s": 0}, "range_s"),
        ({"keys": ",".join(f"pool.k{i}" for i in range(65)), "range_s": 60}, "at most 64"),
    ],
)
def test_history_refuses_unbounded_queries(client: TestClient, params: dict, problem: str) -> None:  # type: ignore[type-arg]
    response = client.get(f"{API}/history", params=params)
    assert response.status_code == 422 and problem in response.json()["detail"]


def test_operator_actions_from_the_dashboard_name_their_actor(client: TestClient) -> None:
    [uuid] = register(client, gpus=1)
    maria = client.post(f"{API}/tokens", json={"name": "maria", "role": "admin"}).json()["token"]
    # A header cannot claim another name: the event names the token that acted.
    headers = {"Authorization": f"Bearer {maria}", "X-Gpupool-Actor": "somebody-else"}
    client.post(f"{API}/gpus/{uuid}/drain", headers=headers)
    [event] = client.get(f"{API}/events", params={"kind": "gpu.drain"}).json()
    assert (event["actor"], event["subject"]) == ("admin:maria", uuid)


# ---- the history's bounded rings ------------------------------------------------------------


def test_a_ring_keeps_its_length_and_the_newest_points() -> None:
    ring = Ring(TierSpec(step_s=1, points=10, entities=True))
    for t in range(25):
        ring.append(float(t), {"pool.x": float(t)})
    times, values = ring.series("pool.x", since=0)
    assert times == [float(t) for t in range(15, 25)] and values[-1] == 24.0
    assert ring.count == 10 and len(ring.values["pool.x"]) == 10


def test_coarse_tiers_average_samples_but_keep_queue_peaks() -> None:
    history = History((TierSpec(1, 100, True), TierSpec(10, 100, True)))
    for t in range(0, 31):
        history.add(
            float(t),
            {"pool.utilization_pct": float(t % 10), "pool.queue_length": 5.0 if t == 13 else 0.0},
        )
    data = history.query(["pool.utilization_pct", "pool.queue_length"], range_s=1000, now=31.0)
    assert data["step_s"] == 10
    utilization = data["series"]["pool.utilization_pct"]
    queue = data["series"]["pool.queue_length"]
    assert utilization[:3] == [4.5, 4.5, 4.5]  # mean of 0..9 in each ten-second point
    assert queue[:3] == [0.0, 5.0, 0.0]  # the one long queue survives averaging


def test_query_picks_the_finest_tier_that_covers_the_range_and_thins_it() -> None:
    history = History((TierSpec(1, 60, True), TierSpec(10, 60, False)))
    for t in range(0, 200):
        history.add(float(t), {"pool.a": 1.0, "gpu.G.util": 2.0})
    assert history.query(["pool.a"], 30, now=200.0)["step_s"] == 1
    assert history.query(["pool.a"], 500, now=200.0)["step_s"] == 10
    # Series of one GPU are not kept in the coarse tier: the fine one answers, as far as it goes.
    assert history.query(["gpu.G.util"], 500, now=200.0)["step_s"] == 1
    thinned = history.query(["pool.a"], 60, now=200.0, max_points=10)
    assert len(thinned["t"]) <= 10 and thinned["step_s"] == 6


def test_series_of_removed_gpus_are_dropped_after_one_span() -> None:
    ring = Ring(TierSpec(step_s=1, points=5, entities=True))
    ring.append(0.0, {"gpu.A.util": 1.0, "pool.x": 1.0})
    for t in range(1, 8):
        ring.append(float(t), {"pool.x": 1.0})
    assert "gpu.A.util" not in ring.values


def test_coarse_pool_history_survives_a_restart(tmp_path: Path) -> None:
    history = History()
    for k in range(600):
        history.add(1_000_000.0 + k * 5, {"pool.compute_granted_pct": float(k), "gpu.G.util": 1.0})
    save(history, tmp_path / "history.json")
    again = History()
    load(again, tmp_path / "history.json")
    now = 1_000_000.0 + 600 * 5
    before = history.query(["pool.compute_granted_pct"], 6 * 3600, now)
    after = again.query(["pool.compute_granted_pct"], 6 * 3600, now)
    assert before["step_s"] == after["step_s"] == 60
    assert after["t"][: len(before["t"]) - 1] == before["t"][:-1]  # all but the step in progress
    assert not any(k.startswith("gpu.") for k in again.rings[1].values)  # pool series only
    size = (tmp_path / "history.json").stat().st_size
    assert size < 200_000


def test_a_damaged_history_file_starts_empty(tmp_path: Path) -> None:
    (tmp_path / "history.json").write_text("{not json")
    history = History()
    load(history, tmp_path / "history.json")
    assert all(ring.count == 0 for ring in history.rings)
    assert math.isnan(history.rings[0].t[0])
