"""The Helm chart, rendered by Helm's own Go SDK (helm-python-sdk) offline, then checked:
Helm's lint, every object well formed, names that refer to each other agree, the TLS
material valid for the webhook's Service, the commands accepted by gpupool's CLI, and the
example pods admitted by gpupool's own webhook."""

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
from gpupool.protocol.v1.tokens import split

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


def test_webhook_and_extender_share_one_certificate_for_the_service(tmp_path: Path) -> None:
    docs = render()
    secret = find(docs, "Secret", "gpupool-k8s-tls")
    webhook = find(docs, "MutatingWebhookConfiguration", "gpupool-k8s")["webhooks"][0]
    config = yaml.safe_load(
        find(docs, "ConfigMap", "gpupool-scheduler-config")["data"]["scheduler-config.yaml"]
    )
    ca = secret["data"]["ca.crt"]
    assert webhook["clientConfig"]["caBundle"] == ca
    (extender,) = config["extenders"]
    assert extender["tlsConfig"]["caData"] == ca
    service = find(docs, "Service", "gpupool-k8s")
    assert webhook["clientConfig"]["service"] == {
        "name": "gpupool-k8s",
        "namespace": NAMESPACE,
        "path": "/webhook/mutate",
        "port": service["spec"]["ports"][0]["port"],
    }
    assert extender["urlPrefix"] == "https://gpupool-k8s.gpupool.svc:8443/extender"
    (tmp_path / "ca.pem").write_bytes(base64.b64decode(ca))
    (tmp_path / "cert.pem").write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
    verified = subprocess.run(
        ["openssl", "verify", "-CAfile", str(tmp_path / "ca.pem"), str(tmp_path / "cert.pem")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verified.returncode == 0, verified.stderr
    names = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(tmp_path / "cert.pem")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "DNS:gpupool-k8s.gpupool.svc" in names


def test_scheduler_profile_consults_the_extender_for_gpupool_resources() -> None:
    docs = render()
    config = yaml.safe_load(
        find(docs, "ConfigMap", "gpupool-scheduler-config")["data"]["scheduler-config.yaml"]
    )
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert [p["schedulerName"] for p in config["profiles"]] == ["gpupool-scheduler"]
    (extender,) = config["extenders"]
    assert (extender["filterVerb"], extender["prioritizeVerb"], extender["bindVerb"]) == (
        "filter",
        "prioritize",
        "bind",
    )
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
    # The extender may read and bind pods, nothing more.
    role = find(docs, "ClusterRole", "gpupool-k8s")
    assert {(r["resources"][0], tuple(r["verbs"])) for r in role["rules"]} == {
        ("pods", ("get", "list")),
        ("pods/binding", ("create",)),
    }


def test_webhook_never_touches_gpupools_own_namespace() -> None:
    webhook = find(render(), "MutatingWebhookConfiguration", "gpupool-k8s")["webhooks"][0]
    (rule,) = webhook["namespaceSelector"]["matchExpressions"]
    assert rule == {
        "key": "kubernetes.io/metadata.name",
        "operator": "NotIn",
        "values": [NAMESPACE, "kube-system"],
    }
    assert webhook["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    assert webhook["admissionReviewVersions"] == ["v1"] and webhook["sideEffects"] == "None"


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


def test_the_admin_token_is_well_formed_and_reaches_every_component() -> None:
    docs = render()
    token = find(docs, "Secret", "gpupool-admin-token")["stringData"]["token"]
    assert split(token) is not None, token
    for kind, name, var in (
        ("Deployment", "gpupool-controller", "GPUPOOL_ADMIN_TOKEN"),
        ("DaemonSet", "gpupool-agent", "GPUPOOL_TOKEN"),
        ("Deployment", "gpupool-k8s", "GPUPOOL_TOKEN"),
    ):
        (container,) = containers(find(docs, kind, name))
        env = {e["name"]: e for e in container["env"]}
        assert env[var]["valueFrom"]["secretKeyRef"] == {
            "name": "gpupool-admin-token",
            "key": "token",
        }
    scheduler_token = render({"auth": {"tokenSecret": "gpupool-scheduler-token"}})
    (k8s,) = containers(find(scheduler_token, "Deployment", "gpupool-k8s"))
    ref = next(e for e in k8s["env"] if e["name"] == "GPUPOOL_TOKEN")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "gpupool-scheduler-token", "key": "token"}


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


def test_extender_admits_only_the_schedulers_client_certificate_the_chart_made(
    tmp_path: Path,
) -> None:
    docs = render()
    args = _k8s_args(docs)
    assert "--client-ca=/etc/gpupool/client-ca/ca.crt" in args
    assert "--extender-client=gpupool-scheduler" in args
    assert not [a for a in args if a.startswith("--insecure")]
    config = yaml.safe_load(
        find(docs, "ConfigMap", "gpupool-scheduler-config")["data"]["scheduler-config.yaml"]
    )
    (extender,) = config["extenders"]
    assert extender["tlsConfig"]["certFile"] == "/etc/gpupool-client/tls.crt"
    assert extender["tlsConfig"]["keyFile"] == "/etc/gpupool-client/tls.key"
    scheduler = find(docs, "Deployment", "gpupool-scheduler")["spec"]["template"]["spec"]
    mounted = {m["name"]: m["mountPath"] for m in scheduler["containers"][0]["volumeMounts"]}
    secrets = {v["name"]: v.get("secret", {}).get("secretName") for v in scheduler["volumes"]}
    assert mounted["client"] == "/etc/gpupool-client"
    assert secrets["client"] == "gpupool-k8s-scheduler-client"
    client = find(docs, "Secret", "gpupool-k8s-scheduler-client")["data"]
    ca = find(docs, "Secret", "gpupool-k8s-client-ca")["data"]["ca.crt"]
    (tmp_path / "ca.pem").write_bytes(base64.b64decode(ca))
    (tmp_path / "client.pem").write_bytes(base64.b64decode(client["tls.crt"]))
    verified = subprocess.run(
        ["openssl", "verify", "-CAfile", str(tmp_path / "ca.pem"), str(tmp_path / "client.pem")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verified.returncode == 0, verified.stderr
    subject = subprocess.run(
        ["openssl", "x509", "-noout", "-subject", "-in", str(tmp_path / "client.pem")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "CN=gpupool-scheduler" in subject or "CN = gpupool-scheduler" in subject


def test_webhook_wants_the_api_servers_token_unless_told_otherwise() -> None:
    docs = render()
    args = _k8s_args(docs)
    assert "--webhook-token-file=/etc/gpupool/webhook-token/token" in args
    token = base64.b64decode(find(docs, "Secret", "gpupool-k8s-webhook-token")["data"]["token"])
    assert len(token) >= 32
    named = _k8s_args(
        render(
            {
                "k8s": {
                    "auth": {
                        "webhookToken": False,
                        "webhookClientNames": ["kube-apiserver"],
                        "webhookClientCA": base64.b64encode(b"PEM").decode(),
                    }
                }
            }
        )
    )
    assert "--webhook-client=kube-apiserver" in named
    assert not [a for a in named if a.startswith("--webhook-token-file")]
    insecure = _k8s_args(render({"k8s": {"auth": {"insecureWebhook": True}}}))
    assert "--insecure-unauthenticated-webhook" in insecure


def test_chart_refuses_a_webhook_nobody_authenticates_to() -> None:
    with pytest.raises(Exception, match="must authenticate to the webhook"):
        render({"k8s": {"auth": {"webhookToken": False}}})
