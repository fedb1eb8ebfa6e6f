"""gpupool on a real Kubernetes 1.20.2 control plane: the chart applied, pods created with
kubectl, admitted by the webhook (a real MutatingWebhookConfiguration, TLS), scheduled
through the extender by the chart's kube-scheduler, bound, and given their lease by the
device plugin's Allocate as the real kubelet calls it. Each bug that only a real control
plane showed has its test here."""

from __future__ import annotations

import base64
import json
import signal
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from control_plane import NODE, Confinement, ControlPlane, make_certificates

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLES = Path(__file__).resolve().parents[3] / "deploy" / "helm" / "gpupool" / "examples"
WAIT = "--timeout=120s"


def gpu_pod(
    name: str,
    limits: dict[str, Any],
    namespace: str = "default",
    annotations: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
        "spec": {
            "containers": [
                {"name": "main", "image": "example.com/train:1", "resources": {"limits": limits}}
            ],
            **spec,
        },
    }


def create(cluster: ControlPlane, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("create", "-f", "-", input_text=json.dumps(obj), check=False)


def pod(cluster: ControlPlane, name: str, namespace: str = "default") -> dict[str, Any]:
    got: dict[str, Any] = cluster.kubectl_json("-n", namespace, "get", "pod", name)
    return got


def container_record(cluster: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    """What the fake runtime was asked to start for the pod's container, if it was."""
    found = sorted(cluster.containers_dir.glob(f"{namespace}_{name}_*.json"))
    return json.loads(found[-1].read_text()) if found else None


def delete(cluster: ControlPlane, namespace: str, *names: str) -> None:
    cluster.kubectl(
        "-n",
        namespace,
        "delete",
        "pod",
        "--wait=true",
        "--grace-period=0",
        "--force",
        "--ignore-not-found",
        *names,
        timeout_s=120,
    )


def claims(cluster: ControlPlane) -> list[dict[str, Any]]:
    import httpx

    def get() -> list[dict[str, Any]]:
        response = httpx.get(
            "http://127.0.0.1:8900/api/v1/k8s/claims",
            headers={"Authorization": f"Bearer {cluster.admin_token}"},
            timeout=10,
        )
        response.raise_for_status()
        answer: list[dict[str, Any]] = response.json()
        return answer

    return cluster.in_namespace(get)


def wait_claims_released(cluster: ControlPlane) -> None:
    """The extender's sweep releases the claims of deleted pods (every 10 s)."""
    cluster.wait_for(
        "claims of deleted pods to be released", lambda: not claims(cluster), timeout_s=60
    )


# ---- the chart and the path of a pod ---------------------------------------------------------


def test_the_chart_is_applied_with_server_side_validation(cluster: ControlPlane) -> None:
    webhook = cluster.kubectl_json(
        "get", "mutatingwebhookconfiguration", "gpupool-k8s", "--show-managed-fields"
    )
    # Rendered for 1.20: no matchConditions (1.28), so one entry takes every pod, with
    # otherPodsFailurePolicy (the chart's values.yaml says so).
    (hook,) = webhook["webhooks"]
    assert hook["name"] == "pods.gpupool.io"
    assert hook["clientConfig"]["service"]["name"] == "gpupool-k8s"
    assert hook["reinvocationPolicy"] == "IfNeeded" and hook["failurePolicy"] == "Ignore"
    # No rendered manifest carries the CA (made in the cluster): `k8s serve` set it.
    ca = cluster.secret("gpupool-k8s-tls")["ca.crt"]
    assert base64.b64decode(hook["clientConfig"]["caBundle"]) == ca
    # The chart renders no Secret: its pre-install hook made them, then was deleted.
    made = cluster.kubectl(
        "-n",
        "gpupool",
        "get",
        "secret",
        "-l",
        "app.kubernetes.io/managed-by=gpupool-init-secrets",
        "-o",
        "name",
    ).stdout.split()
    assert {"secret/gpupool-admin-token", "secret/gpupool-k8s-webhook-token"} <= set(made)
    assert not [d for d in cluster.chart_docs if d["kind"] == "Secret"]
    gone = cluster.kubectl("-n", "gpupool", "get", "job", "gpupool-init-secrets", check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
    managers = {m["manager"] for m in webhook["metadata"]["managedFields"]}
    assert "helm" in managers  # applied server-side, under the name it was applied with
    for kind, name in [
        ("deployment", "gpupool-k8s"),
        ("deployment", "gpupool-controller"),
        ("daemonset", "gpupool-agent"),
        ("service", "gpupool-k8s"),
        ("configmap", "gpupool-scheduler-config"),
    ]:
        cluster.kubectl("-n", "gpupool", "get", kind, name)
    # The API server validates what it is given: a wrong field is refused, not dropped.
    bad = yaml.safe_dump(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": 1}}
    )
    refused = cluster.kubectl(
        "apply", "--server-side", "-n", "gpupool", "-f", "-", input_text=bad, check=False
    )
    assert refused.returncode != 0


CAPABILITY_BITS = {"CHOWN": 0, "SETGID": 6, "SETUID": 7}  # linux/capability.h


@pytest.mark.parametrize(
    ("process", "kind", "name"),
    [
        ("controller", "Deployment", "gpupool-controller"),
        ("k8s-serve", "Deployment", "gpupool-k8s"),
        ("kube-scheduler", "Deployment", "gpupool-scheduler"),
        ("agent", "DaemonSet", "gpupool-agent"),
    ],
)
def test_the_charts_processes_serve_confined_as_their_pods_say(
    cluster: ControlPlane, process: str, kind: str, name: str
) -> None:
    """Every other test here talks to these processes: they serve as the chart confines
    them (its user, no new privileges, only the added capabilities, a read-only root)."""
    pod = cluster.chart_object(kind, name)["spec"]["template"]["spec"]
    want = Confinement.of(pod, pod["containers"][0])
    pid = cluster.processes[process].proc.pid
    status = dict(
        line.split(":\t", 1)
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if ":\t" in line
    )
    assert status["Uid"].split() == [str(want.uid)] * 4, status["Uid"]
    assert status["Gid"].split() == [str(want.gid)] * 4, status["Gid"]
    assert status["NoNewPrivs"] == "1"
    caps = sum(1 << CAPABILITY_BITS[c] for c in want.capabilities)
    assert int(status["CapEff"], 16) == caps and int(status["CapBnd"], 16) == caps
    mounts = [line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]
    (root,) = [m for m in mounts if m[4] == "/"]
    assert want.read_only_root and root[5].split(",")[0] == "ro", root
    writable = {m[4] for m in mounts if m[5].split(",")[0] == "rw"}
    volumes = {m["mountPath"] for m in pod["containers"][0].get("volumeMounts", [])}
    assert not {w for w in writable if not w.startswith(("/proc", "/sys", "/dev"))} - volumes


def test_a_pod_is_admitted_scheduled_bound_and_given_its_lease_by_the_kubelet(
    cluster: ControlPlane,
) -> None:
    notebook = yaml.safe_load((EXAMPLES / "notebook.yaml").read_text())
    cluster.kubectl("apply", "-n", "default", "-f", "-", input_text=json.dumps(notebook))
    try:
        cluster.kubectl("-n", "default", "wait", "--for=condition=Ready", "pod/notebook", WAIT)
        got = pod(cluster, "notebook")
        claim = got["metadata"]["labels"]["gpupool.io/claim"]
        assert got["spec"]["schedulerName"] == "gpupool-scheduler"
        assert got["spec"]["nodeName"] == NODE
        env = {e["name"]: e.get("value") for e in got["spec"]["containers"][0]["env"]}
        assert env["GPUPOOL_CLAIM"] == claim
        record = container_record(cluster, "default", "notebook")
        assert record is not None, "the kubelet started no container"
        assert record["env"]["GPUPOOL_ALLOCATED_CLAIM"] == claim
        assert record["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert record["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].endswith("=20480M")
        [mine] = [c for c in claims(cluster) if c["claim"] == claim]
        assert mine["state"] == "allocated" and mine["node"] == NODE
        assert record["env"]["GPUPOOL_LEASE"] == mine["lease"]["id"]
        leases = cluster.gpupool("lease", "ls").stdout
        assert f"k8s-claim:{claim}" in leases
    finally:
        delete(cluster, "default", "notebook")
    wait_claims_released(cluster)


# ---- bug 2: canonical quantities -------------------------------------------------------------


def test_memory_the_api_server_rewrites_to_8k_is_admitted(cluster: ControlPlane) -> None:
    obj = gpu_pod(
        "mem8000",
        {"gpupool.io/vgpu": 1, "gpupool.io/vgpu-compute": 10, "gpupool.io/vgpu-memory": 8000},
    )
    made = create(cluster, obj)
    assert made.returncode == 0, made.stderr
    try:
        got = pod(cluster, "mem8000")
        # What the webhook saw: the API server's canonical form, not what was written.
        assert got["spec"]["containers"][0]["resources"]["limits"]["gpupool.io/vgpu-memory"] == "8k"
        cluster.kubectl("-n", "default", "wait", "--for=condition=Ready", "pod/mem8000", WAIT)
        record = container_record(cluster, "default", "mem8000")
        assert record is not None
        assert record["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].endswith("=8000M")
    finally:
        delete(cluster, "default", "mem8000")
    wait_claims_released(cluster)


# ---- bug 3: reinvocation ---------------------------------------------------------------------


class Sidecar:
    """A second mutating webhook, after gpupool's, that adds a variable to every pod (as a
    sidecar injector does): the API server then calls gpupool's webhook again."""

    def __init__(self, cluster: ControlPlane, port: int = 9443) -> None:
        self.calls = 0
        self.port = port
        pki = cluster.work / "sidecar"
        pki.mkdir(exist_ok=True)

        make_certificates(pki, "sidecar-ca", "tls", "127.0.0.1", "IP:127.0.0.1")
        self.ca = base64.b64encode((pki / "ca.crt").read_bytes()).decode()
        sidecar = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                request = review["request"]
                sidecar.calls += 1
                patch = []
                env = request["object"]["spec"]["containers"][0].get("env")
                if not any(e["name"] == "SIDECAR" for e in env or []):
                    if env is None:
                        patch.append({"op": "add", "path": "/spec/containers/0/env", "value": []})
                    patch.append(
                        {
                            "op": "add",
                            "path": "/spec/containers/0/env/-",
                            "value": {"name": "SIDECAR", "value": "injected"},
                        }
                    )
                response = {"uid": request["uid"], "allowed": True}
                if patch:
                    response["patchType"] = "JSONPatch"
                    response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
                body = json.dumps(
                    {
                        "apiVersion": "admission.k8s.io/v1",
                        "kind": "AdmissionReview",
                        "response": response,
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def listen() -> ThreadingHTTPServer:
            server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(pki / "tls.crt", pki / "tls.key")
            server.socket = context.wrap_socket(server.socket, server_side=True)
            return server

        # The listening socket is made in the namespace, where the API server can reach it.
        self.server = cluster.in_namespace(listen)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def configuration(self) -> dict[str, Any]:
        return {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "zz-sidecar-injector"},
            "webhooks": [
                {
                    "name": "sidecar.example.com",
                    "admissionReviewVersions": ["v1"],
                    "sideEffects": "None",
                    "failurePolicy": "Fail",
                    "reinvocationPolicy": "Never",
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{self.port}/inject",
                        "caBundle": self.ca,
                    },
                    "rules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["pods"],
                        }
                    ],
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "default"}
                    },
                }
            ],
        }

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sidecar(cluster: ControlPlane) -> Iterator[Sidecar]:
    injector = Sidecar(cluster)
    config = injector.configuration()
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(config))
    try:
        yield injector
    finally:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", "zz-sidecar-injector")
        injector.stop()


def test_a_remote_pod_is_admitted_when_a_later_webhook_makes_the_api_server_call_again(
    cluster: ControlPlane, sidecar: Sidecar
) -> None:
    obj = gpu_pod(
        "remote-train",
        {"gpupool.io/vgpu": 1, "gpupool.io/vgpu-compute": 30, "gpupool.io/vgpu-memory": 4096},
        annotations={"gpupool.io/access": "remote"},
    )
    obj["spec"]["containers"][0]["command"] = ["python", "train.py"]
    made = create(cluster, obj)
    try:
        assert made.returncode == 0, made.stderr
        got = pod(cluster, "remote-train")["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in got["env"]}
        assert env["SIDECAR"] == "injected"
        assert sidecar.calls >= 1
        assert got["command"][:3] == ["gpupool", "run", "--remote"]
        assert got["command"].count("--remote") == 1  # wrapped once, not twice
        assert got["command"][-2:] == ["python", "train.py"]
        assert "gpupool.io/vgpu" not in (got["resources"].get("limits") or {})
    finally:
        delete(cluster, "default", "remote-train")


# ---- bug 4: the scheduler and a node admitting a claim ----------------------------------------


@pytest.fixture
def blocked_node(cluster: ControlPlane) -> Iterator[str]:
    """A second GPU node whose kubelet never admits anything: a claim bound there waits."""
    name = "gpu-node-2"
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {
            "capacity": {"cpu": "8", "memory": "64Gi", "pods": "110", "gpupool.io/vgpu": "8"},
            "allocatable": {"cpu": "8", "memory": "64Gi", "pods": "110", "gpupool.io/vgpu": "8"},
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "hand-made node of the test",
                }
            ],
        },
    }
    cluster.kubectl("create", "-f", "-", input_text=json.dumps(node))
    agent = cluster.spawn(
        "agent-2",
        [
            *cluster.gpupool_argv(),
            "agent",
            "--url",
            "http://127.0.0.1:8900",
            "--node",
            name,
            "--fake",
            "2xH100-80GB",
            "--interval",
            "0.5",
            "--data-dir",
            str(cluster.work / "agent-2"),
            "--no-banner",
            "--worker-user",
            "",
        ],
        env={"GPUPOOL_TOKEN": cluster.admin_token},
    )
    cluster.wait_for(
        "the second node's GPUs in the pool",
        lambda: name in cluster.gpupool("gpus", check=False).stdout,
        watch=["agent-2"],
    )
    try:
        yield name
    finally:
        agent.proc.terminate()
        agent.proc.wait(timeout=30)
        cluster.kubectl("delete", "node", name, "--ignore-not-found")


def test_the_scheduler_places_a_pod_on_the_node_with_room_not_on_one_admitting_a_claim(
    cluster: ControlPlane, blocked_node: str
) -> None:
    slice_ = {"gpupool.io/vgpu": 1, "gpupool.io/vgpu-compute": 20, "gpupool.io/vgpu-memory": 4096}
    first = gpu_pod("stuck", slice_, nodeSelector={"kubernetes.io/hostname": blocked_node})
    second = gpu_pod("second", slice_)
    try:
        assert create(cluster, first).returncode == 0
        cluster.wait_for(
            "the first pod bound to the node that never admits it",
            lambda: pod(cluster, "stuck")["spec"].get("nodeName") == blocked_node,
            timeout_s=120,
        )
        assert [c["state"] for c in claims(cluster)] == ["bound"]
        # The pool (packing) would rather put the next slice beside the first one; that node
        # is admitting a claim, so only the other node can take it now.
        assert create(cluster, second).returncode == 0
        cluster.kubectl("-n", "default", "wait", "--for=condition=Ready", "pod/second", WAIT)
        assert pod(cluster, "second")["spec"]["nodeName"] == NODE
    finally:
        delete(cluster, "default", "stuck", "second")
    wait_claims_released(cluster)


# ---- bug 1: claim theft ----------------------------------------------------------------------


def test_a_pod_past_the_webhook_is_not_given_another_pods_claim(cluster: ControlPlane) -> None:
    """A kube-system pod (the webhook skips that namespace) sets nodeName and asks for a vgpu
    while another pod's claim waits on the node for the kubelet."""
    kubelet = cluster.processes["kubelet"].proc
    thief = gpu_pod(
        "thief",
        {"gpupool.io/vgpu": 1, "gpupool.io/vgpu-compute": 40},
        namespace="kube-system",
        nodeName=NODE,
    )
    victim = gpu_pod(
        "victim",
        {"gpupool.io/vgpu": 1, "gpupool.io/vgpu-compute": 40, "gpupool.io/vgpu-memory": 4096},
        nodeSelector={"kubernetes.io/hostname": NODE},
    )
    wait_claims_released(cluster)  # a test before may have left one to the sweep
    # The kubelet, held still, then takes both pods at once, the older (the thief) first.
    kubelet.send_signal(signal.SIGSTOP)
    try:
        assert create(cluster, thief).returncode == 0
        assert create(cluster, victim).returncode == 0
        cluster.wait_for(
            "the victim's claim bound to the node",
            lambda: pod(cluster, "victim")["spec"].get("nodeName") == NODE,
            timeout_s=120,
        )
        [waiting] = claims(cluster)
        assert waiting["state"] == "bound"
    finally:
        kubelet.send_signal(signal.SIGCONT)
    try:
        cluster.wait_for(
            "the kubelet to refuse the thief",
            lambda: pod(cluster, "thief", "kube-system")["status"].get("phase") == "Failed",
            timeout_s=120,
        )
        status = pod(cluster, "thief", "kube-system")["status"]
        assert status["reason"] == "UnexpectedAdmissionError"
        assert "without a claim" in status["message"]
        assert container_record(cluster, "kube-system", "thief") is None
        for claim in claims(cluster):
            # The victim's lease went to no one, or to the victim.
            assert claim["claim"] == waiting["claim"]
            if claim["state"] == "allocated":
                record = container_record(cluster, "default", "victim")
                assert record is not None
                assert record["env"]["GPUPOOL_ALLOCATED_CLAIM"] == waiting["claim"]
    finally:
        delete(cluster, "kube-system", "thief")
        delete(cluster, "default", "victim")
    wait_claims_released(cluster)
