"""The Helm chart, rendered by Helm's own Go SDK (helm-python-sdk) offline, then checked:
Helm's lint, every object well formed, names that refer to each other agree, the commands
accepted by gpupool's CLI, and the example pods admitted by gpupool's own webhook (the TLS
material and the rest of the chart's safety: test_chart_safety.py)."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from admission import admission_review

from gpupool.k8s.webhook import WebhookSettings, review

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk (dev extra) bundles Helm's renderer"
)

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "gpupool"
NAMESPACE = "gpupool"


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values or {}, name="gpupool", namespace=NAMESPACE)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"] if "template" in doc["spec"] else doc["spec"]
    return list(spec["containers"])


def test_helm_lint_finds_no_error() -> None:
    result = helm.lint(str(CHART))
    assert result["errors"] == []
    assert [m for m in result["messages"] if m["severity"] > 1] == []  # only "icon is recommended"


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"examples": {"enabled": True}},
        {"postgresql": {"enabled": False}, "externalDatabase": {"existingSecret": "pg-url"}},
        {"scheduler": {"enabled": False}, "agent": {"fake": "2xH100-80GB"}},
        {
            "auth": {"tokenSecret": "gpupool-scheduler-token", "joinTokenSecret": "j"},
            "k8s": {"remoteTokenSecret": "t"},
        },
    ],
)
def test_every_object_is_well_formed(values: dict[str, Any]) -> None:
    docs = render(values)
    seen = set()
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and name == name.lower(), name
        key = (doc["kind"], doc["metadata"].get("namespace"), name)
        assert key not in seen, f"{key} twice"
        seen.add(key)
        if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            selector = doc["spec"]["selector"]["matchLabels"]
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items(), f"{name}: selector does not match its pods"


def test_agent_serves_the_device_plugin_in_the_kubelets_directory() -> None:
    agent = find(render(), "DaemonSet", "gpupool-agent")
    (container,) = containers(agent)
    assert "--device-plugin" in container["args"]
    assert "--kubelet-dir=/var/lib/kubelet/device-plugins" in container["args"]
    assert "--node=$(NODE_NAME)" in container["args"]
    volumes = {v["name"]: v for v in agent["spec"]["template"]["spec"]["volumes"]}
    assert volumes["device-plugins"]["hostPath"]["path"] == "/var/lib/kubelet/device-plugins"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    # MPS pipe paths the plugin hands the kubelet are host paths: same path inside.
    assert mounts["data"] == volumes["data"]["hostPath"]["path"]
    # The MPS daemons' /dev/shm is a host directory the plugin names to slices' containers.
    assert mounts["mps-shm"] == "/dev/shm"
    assert f"--mps-shm-dir={volumes['mps-shm']['hostPath']['path']}" in container["args"]
    assert "privileged" not in container.get("securityContext", {})


def test_chart_commands_are_accepted_by_the_gpupool_cli() -> None:
    """Each container's arguments, with --help added: click parses every option first, so an
    option the CLI does not know fails with exit 2 before the eager --help prints."""
    docs = render({"agent": {"fake": "2xH100-80GB"}, "k8s": {"remoteTokenSecret": "t"}})
    for kind, name in (
        ("Deployment", "gpupool-controller"),
        ("DaemonSet", "gpupool-agent"),
        ("Deployment", "gpupool-k8s"),
        ("Job", "gpupool-init-secrets"),
    ):
        (container,) = containers(find(docs, kind, name))
        done = subprocess.run(
            [sys.executable, "-m", "gpupool.cli", *container["args"], "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{name}: {done.stderr}"
        assert "Usage:" in done.stdout


def test_scheduler_profile_consults_the_extender_for_gpupool_resources() -> None:
    docs = render()
    config = yaml.safe_load(
        find(docs, "ConfigMap", "gpupool-scheduler-config")["data"]["scheduler-config.yaml"]
    )
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert [p["schedulerName"] for p in config["profiles"]] == ["gpupool-scheduler"]
    (extender,) = config["extenders"]
    verbs = ("filterVerb", "prioritizeVerb", "preemptVerb", "bindVerb")
    assert [extender[v] for v in verbs] == ["filter", "prioritize", "preempt", "bind"]
    assert extender["nodeCacheCapable"] is True and extender["enableHTTPS"] is True
    managed = {r["name"]: r["ignoredByScheduler"] for r in extender["managedResources"]}
    assert managed == {
        "gpupool.io/vgpu": False,
        "gpupool.io/gpu": False,
        "gpupool.io/vgpu-compute": True,
        "gpupool.io/vgpu-memory": True,
    }
    (k8s,) = containers(find(docs, "Deployment", "gpupool-k8s"))
    assert "--scheduler-name=gpupool-scheduler" in k8s["args"]
    (scheduler,) = containers(find(docs, "Deployment", "gpupool-scheduler"))
    assert "--config=/etc/gpupool/scheduler-config.yaml" in scheduler["command"]
    # The extender may read and bind pods, and set its own webhooks' caBundle; nothing more.
    role = find(docs, "ClusterRole", "gpupool-k8s")
    assert {
        (r["resources"][0], tuple(r["verbs"]), tuple(r.get("resourceNames", ())))
        for r in role["rules"]
    } == {
        ("pods", ("get", "list"), ()),
        ("pods/binding", ("create",), ()),
        ("mutatingwebhookconfigurations", ("get", "patch"), ("gpupool-k8s",)),
    }


def test_example_pods_are_admitted_by_the_webhook_as_documented() -> None:
    docs = render({"examples": {"enabled": True}})
    examples = {
        d["metadata"]["name"]: d for d in docs if d["metadata"].get("namespace") == "default"
    }
    assert set(examples) == {"notebook", "train-resnet", "profile-kernels"}
    settings = WebhookSettings(new_claim=lambda: "c-example000001")
    for name, doc in examples.items():
        pod = (
            doc
            if doc["kind"] == "Pod"
            else {"metadata": {"name": name, "namespace": "default"}, **doc["spec"]["template"]}
        )
        answer = review(admission_review(pod), settings)["response"]
        assert answer["allowed"] is True, (name, answer)
        assert "patch" in answer
    limits = containers(examples["notebook"])[0]["resources"]["limits"]
    assert limits == {
        "gpupool.io/vgpu": 1,
        "gpupool.io/vgpu-compute": 25,
        "gpupool.io/vgpu-memory": 20480,
    }
    assert containers(examples["train-resnet"]["spec"]["template"])[0]["resources"]["limits"] == {
        "gpupool.io/gpu": 2
    }


def test_agents_get_the_join_token_and_no_other_credential_when_one_is_named() -> None:
    """A DaemonSet's agents share one Secret: it must be a join token, which each agent
    trades for its own node's token, never a token that acts for every node."""
    docs = render({"auth": {"joinTokenSecret": "gpupool-join-token"}})
    (agent,) = containers(find(docs, "DaemonSet", "gpupool-agent"))
    env = {e["name"]: e for e in agent["env"]}
    assert "GPUPOOL_TOKEN" not in env
    assert env["GPUPOOL_JOIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "gpupool-join-token",
        "key": "token",
    }
    # The node token it gets is kept in the agent's data dir, which is on the host.
    assert "--data-dir=/var/lib/gpupool" in agent["args"]
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert mounts["data"] == "/var/lib/gpupool"


def _k8s_args(docs: list[dict[str, Any]]) -> list[str]:
    (container,) = containers(find(docs, "Deployment", "gpupool-k8s"))
    return list(container["args"])


def test_chart_refuses_a_webhook_nobody_authenticates_to() -> None:
    with pytest.raises(Exception, match="must authenticate to the webhook"):
        render({"k8s": {"auth": {"webhookToken": False}}})


def test_chart_refuses_a_ca_bundle_that_signed_no_certificate_it_uses() -> None:
    with pytest.raises(Exception, match=r"caBundle goes with k8s\.tls\.existingSecret"):
        render({"k8s": {"tls": {"caBundle": base64.b64encode(b"PEM").decode()}}})
    with pytest.raises(Exception, match=r"k8s\.tls\.caBundle .* is needed"):
        render({"k8s": {"tls": {"existingSecret": "mine"}}})
