"""A GPU pod from admission to its container's environment, every piece a real process:
`gpupool k8s serve` over TLS (webhook + extender), the controller, the agent's device plugin,
a fake API server and a fake kubelet speaking the real protocols."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from admission import admission_review, apply_patch, pod
from certs import make_ca, make_signed
from fake_apiserver import FakeApiServer
from k8s_node import K8sNode

from gpupool.k8s.deviceplugin.v1beta1 import api_pb2 as pb
from tests.ports import free_port
from tests.timing import scaled

pytestmark = pytest.mark.slow

SLICE = {"gpupool.io/vgpu": "1", "gpupool.io/vgpu-compute": "25", "gpupool.io/vgpu-memory": "8192"}


@pytest.fixture
def served(k8s_node: K8sNode, tmp_path: Path) -> Iterator[tuple[httpx.Client, FakeApiServer]]:
    api = FakeApiServer().start()
    # As in a cluster: the scheduler presents its client certificate, the API server a token.
    ca = make_ca(tmp_path / "pki", "cluster-ca")
    server = make_signed(ca, tmp_path / "pki", "gpupool-k8s", server=True)
    scheduler = make_signed(ca, tmp_path / "pki", "gpupool-scheduler")
    token = "flow-webhook-token-0123456789"
    (tmp_path / "webhook.token").write_text(token)
    port = free_port()
    args = [sys.executable, "-m", "gpupool.cli", "--url", k8s_node.url, "k8s", "serve"]
    args += ["--host", "127.0.0.1", "--port", str(port), "--tls-cert", str(server.cert)]
    args += ["--tls-key", str(server.key), "--kube-api", api.url, "--sweep-interval", "0.5"]
    args += ["--client-ca", str(ca.cert), "--extender-client", "gpupool-scheduler"]
    args += ["--webhook-token-file", str(tmp_path / "webhook.token")]
    with (tmp_path / "k8s-serve.log").open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    context = ssl.create_default_context(cafile=str(ca.cert))
    context.load_cert_chain(str(scheduler.cert), str(scheduler.key))
    client = httpx.Client(
        base_url=f"https://127.0.0.1:{port}",
        verify=context,
        timeout=30,
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        deadline = time.monotonic() + scaled(60)
        while True:
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, (tmp_path / "k8s-serve.log").read_text()
            assert time.monotonic() < deadline, "gpupool k8s serve did not start"
            time.sleep(0.2)
        yield client, api
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=scaled(10))
        api.stop()


def test_pod_gets_the_slice_the_scheduler_chose(
    k8s_node: K8sNode, served: tuple[httpx.Client, FakeApiServer]
) -> None:
    https, api = served
    kubelet = k8s_node.kubelet
    devices = kubelet.devices("gpupool.io/vgpu", lambda d: len(d) == 8)

    # 1. Admission: the webhook (over TLS, as the API server requires) gives the pod a claim.
    created = pod(SLICE, name="notebook", namespace="team-a")
    review = https.post("/webhook/mutate", json=admission_review(created)).json()
    assert review["response"]["allowed"] is True
    stored = apply_patch(created, review["response"])
    stored["status"] = {"phase": "Pending"}
    claim = stored["metadata"]["labels"]["gpupool.io/claim"]
    env = {e["name"]: e.get("value") for e in stored["spec"]["containers"][0]["env"]}
    assert env["GPUPOOL_CLAIM"] == claim
    api.add_pod(stored)

    # 2. Scheduling: filter, prioritize, bind, on the scheduler's ExtenderArgs.
    args: dict[str, Any] = {"Pod": stored, "NodeNames": [k8s_node.node, "cpu-1"]}
    result = https.post("/extender/filter", json=args).json()
    assert result["NodeNames"] == [k8s_node.node]
    scores = https.post("/extender/prioritize", json=args).json()
    assert scores[0] == {"Host": k8s_node.node, "Score": 10}
    binding = {"PodName": "notebook", "PodNamespace": "team-a", "PodUID": "uid-notebook"}
    answer = https.post("/extender/bind", json={**binding, "Node": k8s_node.node}).json()
    assert answer == {"Error": ""}
    assert api.pods[("team-a", "notebook")]["spec"]["nodeName"] == k8s_node.node
    lease = k8s_node.client.claim(claim).lease

    # 3. Admission on the node: the kubelet asks the plugin (preferred devices, Allocate).
    vgpu = kubelet.plugin("gpupool.io/vgpu")
    preferred = vgpu.stub.GetPreferredAllocation(
        pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=sorted(devices), allocation_size=1
                )
            ]
        ),
        timeout=10,
    )
    ids = list(preferred.container_responses[0].deviceIDs)
    assert ids[0].startswith(lease.slices[0].gpu_uuid)
    given = vgpu.stub.Allocate(
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]),
        timeout=10,
    )
    envs = dict(given.container_responses[0].envs)
    assert envs["GPUPOOL_ALLOCATED_CLAIM"] == env["GPUPOOL_CLAIM"]
    assert envs["GPUPOOL_LEASE"] == lease.id
    assert envs["CUDA_VISIBLE_DEVICES"] == lease.slices[0].gpu_uuid
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert k8s_node.client.claim(claim).state == "allocated"

    # 4. The pod ends: its lease goes back to the pool.
    api.set_phase("team-a", "notebook", "Running")
    time.sleep(scaled(1.5))  # a few sweeps: a running pod keeps its claim
    assert k8s_node.client.claim(claim).state == "allocated"
    api.delete_pod("team-a", "notebook")
    deadline = time.monotonic() + scaled(20)
    while k8s_node.client.claims():
        assert time.monotonic() < deadline, "the claim of the deleted pod was not released"
        time.sleep(0.2)
    released = k8s_node.client.lease(lease.id)
    assert released.state == "released"
