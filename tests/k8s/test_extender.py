"""The scheduler extender on real ExtenderArgs / ExtenderBindingArgs payloads, with a real
controller process and a fake API server on loopback."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from admission import pod
from fake_apiserver import FakeApiServer
from starlette.exceptions import StarletteDeprecationWarning

from gpupool.client.sdk import PoolClient
from gpupool.k8s.app import ServeSettings, create_app
from gpupool.k8s.callers import Callers
from gpupool.k8s.extender import Extender
from gpupool.k8s.kube import KubeApi
from gpupool.protocol.v1.api import GpuInventory, LeaseCreate, NodeRegister

with warnings.catch_warnings():
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

SLICE = {"gpupool.io/vgpu": "1", "gpupool.io/vgpu-compute": "25", "gpupool.io/vgpu-memory": "20480"}
NODES = ["gpu-a", "gpu-b", "cpu-only"]


@dataclass
class Cluster:
    pool: PoolClient
    api: FakeApiServer
    http: TestClient
    url: str

    def filter(self, args: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post("/extender/filter", json=args)
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def prioritize(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        response = self.http.post("/extender/prioritize", json=args)
        assert response.status_code == 200, response.text
        result: list[dict[str, Any]] = response.json()
        return result

    def bind(self, obj: dict[str, Any], node: str) -> str:
        meta = obj["metadata"]
        args = {
            "PodName": meta["name"],
            "PodNamespace": meta["namespace"],
            "PodUID": meta["uid"],
            "Node": node,
        }
        response = self.http.post("/extender/bind", json=args)
        assert response.status_code == 200, response.text
        error: str = response.json()["Error"]
        return error

    def sweep(self, admit_timeout_s: float = 300.0) -> None:
        async def run() -> None:
            kube = KubeApi(self.api.url)
            try:
                await Extender(self.pool, kube, admit_timeout_s).sweep()
            finally:
                await kube.close()

        asyncio.run(run())


def claimed(
    name: str, claim: str, limits: dict[str, str] | None = None, **kw: Any
) -> dict[str, Any]:
    """A pod as the webhook left it: with its claim label."""
    obj = pod(SLICE if limits is None else limits, name=name, **kw)
    obj["metadata"]["labels"] = {"gpupool.io/claim": claim}
    obj["status"] = {"phase": "Pending"}
    return obj


@pytest.fixture
def cluster(start_controller: Any) -> Iterator[Cluster]:
    ctl = start_controller(node_timeout_s=600.0)
    pool = PoolClient(ctl.url, actor="extender-test")
    for name, count in (("gpu-a", 2), ("gpu-b", 1)):
        gpus = [
            GpuInventory(
                uuid=f"GPU-{name}-{i}", index=i, model="H100", memory_mib=81920, simulated=True
            )
            for i in range(count)
        ]
        pool.register_node(NodeRegister(name=name, gpus=gpus))
    api = FakeApiServer().start()
    kube = KubeApi(api.url)
    settings = ServeSettings(
        controller_url=ctl.url, sweep_interval_s=3600, callers=Callers.insecure()
    )
    app = create_app(settings, pool, kube)
    try:
        with TestClient(app) as http:
            yield Cluster(pool, api, http, ctl.url)
    finally:
        api.stop()
        pool.close()


def test_filter_keeps_the_nodes_where_the_pool_has_room(cluster: Cluster) -> None:
    # The scheduler's field names (Go struct names; nodeCacheCapable: true sends NodeNames).
    result = cluster.filter({"Pod": pod(SLICE), "NodeNames": NODES})
    assert sorted(result["NodeNames"]) == ["gpu-a", "gpu-b"]
    assert result["FailedAndUnresolvableNodes"] == {"cpu-only": "no gpupool GPUs on this node"}
    assert result["FailedNodes"] == {}
    assert result["Error"] == ""


def test_filter_answers_with_node_objects_when_given_node_objects(cluster: Cluster) -> None:
    nodes = {
        "kind": "NodeList",
        "apiVersion": "v1",
        "items": [{"metadata": {"name": n}, "status": {}} for n in NODES],
    }
    # Lowercase keys, as older schedulers' JSON tags wrote them.
    result = cluster.filter({"pod": pod({"gpupool.io/gpu": "2"}), "nodes": nodes})
    # No GPU is physical yet: whole GPUs fit nowhere now (but might after a mode switch).
    assert result["Nodes"]["items"] == []
    assert "gpu-a" in result["FailedNodes"] and "physical" in result["FailedNodes"]["gpu-a"]
    for uuid in ("GPU-gpu-a-0", "GPU-gpu-a-1"):
        cluster.pool.set_gpu_mode(uuid, "physical")
    result = cluster.filter({"pod": pod({"gpupool.io/gpu": "2"}), "nodes": nodes})
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["gpu-a"]
    # gpu-b has one GPU: no lease ending or preemption can make room for two there.
    assert "can never be granted" in result["FailedAndUnresolvableNodes"]["gpu-b"]


def test_prioritize_puts_the_pools_own_choice_first(cluster: Cluster) -> None:
    # Make the two nodes differ: gpu-b already holds a slice.
    cluster.pool.create_lease(LeaseCreate(compute_pct=50, memory="20GiB", node="gpu-b"))
    scores = cluster.prioritize({"Pod": pod(SLICE), "NodeNames": NODES})
    assert [s["Host"] for s in scores] == NODES
    best = [s["Host"] for s in scores if s["Score"] == 10]
    assert len(best) == 1 and best[0] != "cpu-only"
    assert next(s["Score"] for s in scores if s["Host"] == "cpu-only") == 0
    # Outside Kubernetes, the same request lands on the same node.
    outside = cluster.pool.create_lease(LeaseCreate(compute_pct=25, memory="20480MiB", wait=False))
    assert outside.slices[0].node == best[0]


def test_bind_turns_the_claim_into_a_lease_then_binds_the_pod(cluster: Cluster) -> None:
    obj = claimed("nb-1", "c-notebook-000001")
    cluster.api.add_pod(obj)
    assert cluster.bind(obj, "gpu-a") == ""
    assert cluster.api.bindings[0]["target"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "gpu-a",
    }
    assert cluster.api.bindings[0]["metadata"]["uid"] == "uid-nb-1"
    claim = cluster.pool.claim("c-notebook-000001")
    assert claim.state == "bound" and claim.node == "gpu-a"
    assert claim.lease.holder == "k8s-claim:c-notebook-000001"
    assert claim.lease.compute_pct == 25 and claim.lease.memory_mib == 20480
    assert claim.lease.slices[0].node == "gpu-a"


def test_a_node_admits_one_claim_at_a_time(cluster: Cluster) -> None:
    first, second = claimed("nb-1", "c-notebook-000001"), claimed("nb-2", "c-notebook-000002")
    cluster.api.add_pod(first)
    cluster.api.add_pod(second)
    assert cluster.bind(first, "gpu-a") == ""
    error = cluster.bind(second, "gpu-a")
    assert "still admitting claim c-notebook-000001" in error
    assert len(cluster.api.bindings) == 1  # the second pod stays unbound: the scheduler retries
    assert cluster.bind(second, "gpu-b") == ""


def test_failed_binding_gives_the_lease_back(cluster: Cluster) -> None:
    obj = claimed("nb-1", "c-notebook-000001")
    cluster.api.add_pod(obj)
    cluster.api.refuse_bindings = 'pods "nb-1" is being deleted'
    assert "being deleted" in cluster.bind(obj, "gpu-a")
    assert cluster.pool.claims() == []
    assert cluster.pool.leases() == []


def test_bind_refuses_pods_the_webhook_did_not_admit(cluster: Cluster) -> None:
    obj = pod(SLICE, name="sneaky")
    cluster.api.add_pod(obj)
    assert "no gpupool.io/claim label" in cluster.bind(obj, "gpu-a")
    assert cluster.api.bindings == []


def test_bind_of_a_pod_without_gpus_just_binds(cluster: Cluster) -> None:
    obj = pod(None, name="web")
    cluster.api.add_pod(obj)
    assert cluster.bind(obj, "cpu-only") == ""
    assert cluster.pool.claims() == []


def test_claims_follow_their_pods(cluster: Cluster) -> None:
    alive, done, gone = (claimed(f"p{i}", f"c-claimsweep00000{i}") for i in range(3))
    for node, obj in zip(("gpu-a", "gpu-b", "gpu-a"), (alive, done, gone), strict=True):
        cluster.api.add_pod(obj)
        assert cluster.bind(obj, node) == ""
        # Let the node admit it (what the device plugin's Allocate does).
        cluster.pool.heartbeat_lease(
            cluster.pool.claim(obj["metadata"]["labels"]["gpupool.io/claim"]).lease.id, active=True
        )
    before = cluster.pool.claim("c-claimsweep000000").lease.last_heartbeat_at
    cluster.api.set_phase("team-a", "p1", "Succeeded")
    cluster.api.delete_pod("team-a", "p2")
    cluster.sweep()
    claims = cluster.pool.claims()
    assert [c.claim for c in claims] == ["c-claimsweep000000"]
    assert claims[0].lease.last_heartbeat_at > before
    assert {lease.holder for lease in cluster.pool.leases()} == {"k8s-claim:c-claimsweep000000"}


def test_a_claim_no_container_takes_frees_its_node_after_the_admit_timeout(
    cluster: Cluster,
) -> None:
    stuck, next_pod = claimed("stuck", "c-stuckclaim00001"), claimed("next", "c-nextclaim000001")
    cluster.api.add_pod(stuck)
    cluster.api.add_pod(next_pod)
    assert cluster.bind(stuck, "gpu-a") == ""
    assert "still admitting" in cluster.bind(next_pod, "gpu-a")
    cluster.sweep()  # within the timeout: the pod lives, its claim stays
    assert [c.claim for c in cluster.pool.claims()] == ["c-stuckclaim00001"]
    cluster.sweep(admit_timeout_s=0.0)
    assert cluster.pool.claims() == []
    assert cluster.bind(next_pod, "gpu-a") == ""
