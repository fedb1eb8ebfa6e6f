"""The extender's preempt verb on real ExtenderPreemptionArgs, with a real controller: the
pool names which claimed pods of lower priority must go on each node, and nodes where no
such set makes room are dropped."""

from __future__ import annotations

from typing import Any

from admission import pod
from test_extender import SLICE, Cluster, claimed
from test_extender import cluster as _cluster

from gpupool.protocol.v1.api import LeaseCreate, QuotaIn, TenantCreate

cluster = _cluster
"""test_extender's fixture: a real controller with nodes gpu-a (2 GPUs) and gpu-b (1)."""

URGENT = {"gpupool.io/priority": "100", "gpupool.io/tenant": "research"}
HALF = {"gpupool.io/vgpu": "1", "gpupool.io/vgpu-compute": "50", "gpupool.io/vgpu-memory": "20480"}


def preempt(c: Cluster, args: dict[str, Any]) -> dict[str, Any]:
    response = c.http.post("/extender/preempt", json=args)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def running(c: Cluster, name: str, claim: str, node: str, priority: int) -> dict[str, Any]:
    """A claimed pod bound to `node` whose container took its lease."""
    obj = claimed(name, claim, HALF, priority=priority)
    obj["metadata"]["annotations"] = {**URGENT, "gpupool.io/priority": str(priority)}
    c.api.add_pod(obj)
    assert c.bind(obj, node) == ""
    c.pool.heartbeat_lease(c.pool.claim(claim).lease.id, active=True)
    return obj


def urgent(c: Cluster) -> dict[str, Any]:
    """A pod of priority 100, of a tenant allowed that much."""
    c.pool.create_tenant(TenantCreate(name="research", quota=QuotaIn(max_priority=1000)))
    return pod(SLICE, name="urgent", annotations=URGENT, priority=100)


def uids(result: dict[str, Any], node: str) -> list[str]:
    return [p["UID"] for p in result["NodeNameToMetaVictims"][node]["Pods"]]


def test_preempt_names_the_claimed_pods_whose_end_makes_room(cluster: Cluster) -> None:
    waiting = urgent(cluster)
    # gpu-b (one GPU): two slices of 50 % by low-priority pods, full.
    running(cluster, "low-1", "c-lowpriority0001", "gpu-b", 0)
    running(cluster, "low-2", "c-lowpriority0002", "gpu-b", 0)
    # gpu-a (two GPUs): full with leases made outside Kubernetes, which no eviction ends.
    cluster.pool.create_lease(LeaseCreate(gpus=2, compute_pct=100, node="gpu-a"))
    assert cluster.filter({"Pod": waiting, "NodeNames": ["gpu-a", "gpu-b"]})["NodeNames"] == []
    args = {
        "Pod": waiting,
        # nodeCacheCapable: the scheduler sends victims as UIDs; its own found none here.
        "NodeNameToMetaVictims": {
            "gpu-a": {"Pods": [], "NumPDBViolations": 0},
            "gpu-b": {"Pods": [{"UID": "uid-scheduler-choice"}], "NumPDBViolations": 1},
        },
    }
    result = preempt(cluster, args)
    assert set(result["NodeNameToMetaVictims"]) == {"gpu-b"}  # gpu-a: nothing to evict helps
    victims = uids(result, "gpu-b")
    # The scheduler's own victim stays; one 50 % slice is enough of the pool's.
    assert victims[0] == "uid-scheduler-choice" and len(victims) == 2
    assert victims[1] in {"uid-low-1", "uid-low-2"}
    assert result["NodeNameToMetaVictims"]["gpu-b"]["NumPDBViolations"] == 1


def test_preempt_never_offers_pods_of_equal_or_higher_priority(cluster: Cluster) -> None:
    waiting = urgent(cluster)
    running(cluster, "peer-1", "c-peerpriority001", "gpu-b", 100)
    running(cluster, "peer-2", "c-peerpriority002", "gpu-b", 100)
    result = preempt(cluster, {"Pod": waiting, "NodeNameToMetaVictims": {"gpu-b": {"Pods": []}}})
    assert result == {"NodeNameToMetaVictims": {}}


def test_a_pod_the_pool_has_no_say_on_keeps_the_schedulers_victims(cluster: Cluster) -> None:
    web = pod(None, name="web", priority=10)
    # Not nodeCacheCapable: whole victim pods; the answer is always by UID.
    args = {
        "Pod": web,
        "NodeNameToVictims": {
            "cpu-only": {"Pods": [{"metadata": {"uid": "uid-batch"}}], "NumPDBViolations": 0}
        },
    }
    assert preempt(cluster, args) == {
        "NodeNameToMetaVictims": {
            "cpu-only": {"Pods": [{"UID": "uid-batch"}], "NumPDBViolations": 0}
        }
    }


def test_preempt_refuses_malformed_victims(cluster: Cluster) -> None:
    response = cluster.http.post(
        "/extender/preempt",
        json={"Pod": pod(SLICE), "NodeNameToMetaVictims": {"gpu-b": {"Pods": [{"UID": 5}]}}},
    )
    assert response.status_code == 400
    assert "NodeNameToMetaVictims.gpu-b.Pods[0].UID must be a string" in response.json()["Error"]
