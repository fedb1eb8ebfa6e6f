"""The chart's fail-safe admission, versions, security settings, schema and secrets, checked
on Helm's own rendering (helm-python-sdk): the webhook's match conditions are evaluated with
a CEL interpreter on real pods, and the init-secrets Job's own command is run against an API
server on loopback to make the Secrets the rendered objects refer to."""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from admission import pod
from fake_apiserver import FakeApiServer
from test_chart import CHART, NAMESPACE, containers, find, render

from gpupool.agent import mps

helm = pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")
celpy = pytest.importorskip("celpy", reason="cel-python (dev extra) evaluates matchConditions")

WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job")


def rendered_text(values: dict[str, Any] | None = None) -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests: dict[str, str] = chart.render(values or {}, name="gpupool", namespace=NAMESPACE)
        return manifests


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def test_helm_template_renders_the_same_every_time_and_no_secret_material() -> None:
    """GitOps tools render with `helm template`: nothing random may be in the output."""
    first, second = rendered_text(), rendered_text()
    assert first == second
    docs = render()
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == []
    text = "\n".join(first.values())
    assert "BEGIN CERTIFICATE" not in text and "PRIVATE KEY" not in text


def test_a_bad_value_is_refused_by_the_schema_with_its_path() -> None:
    with pytest.raises(helm.HelmError, match="/agent/cdiDevices"):
        render({"agent": {"cdiDevices": "all-of-them"}})
    with pytest.raises(helm.HelmError, match="gpuPodsFailurePolicy"):
        render({"k8s": {"webhook": {"gpuPodsFailurePolicy": "Maybe"}}})
    with pytest.raises(helm.HelmError, match="replicsa"):
        render({"k8s": {"replicsa": 3}})  # a typo is an error, not a silent default
    lint = helm.lint(str(CHART), {"agent": {"vgpuSlots": 0}})
    assert any("/agent/vgpuSlots" in e for e in lint["errors"]), lint


def _webhooks(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    config = find(render(values), "MutatingWebhookConfiguration", "gpupool-k8s")
    return {w["name"]: w for w in config["webhooks"]}


def _matches(webhook: dict[str, Any], operation: str, obj: dict[str, Any], old: Any) -> bool:
    env = celpy.Environment()
    for condition in webhook.get("matchConditions") or []:
        program = env.program(env.compile(condition["expression"]))
        activation = {
            "object": celpy.json_to_cel(obj),
            "oldObject": celpy.json_to_cel(old),
            "request": celpy.json_to_cel({"operation": operation}),
        }
        result = program.evaluate(activation)
        assert isinstance(result, celpy.celtypes.BoolType), (condition["name"], result)
        if not result:
            return False
    return True


SLICE = {"gpupool.io/vgpu": "1", "gpupool.io/vgpu-compute": "25"}


@pytest.mark.parametrize(
    ("operation", "obj", "old", "gpu"),
    [
        ("CREATE", pod(SLICE), None, True),
        ("CREATE", pod({"gpupool.io/gpu": "2"}), None, True),
        ("CREATE", pod(None, annotations={"gpupool.io/tenant": "ml"}), None, True),
        ("CREATE", pod(None), None, False),
        ("CREATE", pod({"cpu": "1", "nvidia.com/gpu": "1"}), None, False),
        (
            "CREATE",
            {
                **pod(None),
                "spec": {
                    **pod(None)["spec"],
                    "initContainers": [
                        {"name": "i", "resources": {"limits": {"gpupool.io/gpu": "1"}}}
                    ],
                },
            },
            None,
            True,
        ),
        # An update (or kubectl debug) of a pod that holds a claim.
        (
            "UPDATE",
            pod(None),
            {**pod(None), "metadata": {"name": "n", "labels": {"gpupool.io/claim": "c-1"}}},
            True,
        ),
        ("UPDATE", pod(None), pod(None), False),
    ],
)
def test_gpu_pods_and_the_others_go_to_exactly_one_webhook_each(
    operation: str, obj: dict[str, Any], old: Any, gpu: bool
) -> None:
    hooks = _webhooks()
    assert set(hooks) == {"gpu-pods.gpupool.io", "pods.gpupool.io"}
    assert _matches(hooks["gpu-pods.gpupool.io"], operation, obj, old) is gpu
    assert _matches(hooks["pods.gpupool.io"], operation, obj, old) is not gpu


def test_gpu_pods_fail_closed_and_other_pods_open_and_may_opt_out() -> None:
    hooks = _webhooks()
    gpu, other = hooks["gpu-pods.gpupool.io"], hooks["pods.gpupool.io"]
    assert gpu["failurePolicy"] == "Fail" and other["failurePolicy"] == "Ignore"
    # Opting out is for pods without GPUs only: a GPU pod without its claim is refused anyway.
    assert "objectSelector" not in gpu
    assert other["objectSelector"] == {
        "matchExpressions": [
            {"key": "gpupool.io/skip-webhook", "operator": "NotIn", "values": ["true"]}
        ]
    }
    for hook in (gpu, other):
        assert hook["namespaceSelector"]["matchExpressions"][0] == {
            "key": "kubernetes.io/metadata.name",
            "operator": "NotIn",
            "values": [NAMESPACE, "kube-system"],
        }
        assert hook["rules"][0]["resources"] == ["pods", "pods/ephemeralcontainers"]
        assert hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]
        assert hook["admissionReviewVersions"] == ["v1"] and hook["sideEffects"] == "None"
        assert hook["timeoutSeconds"] == 10
        assert "caBundle" not in hook["clientConfig"]  # set in the cluster by `k8s serve`
    # Before matchConditions (1.28), one entry for every pod, failing open.
    (old,) = _webhooks({"kubeVersion": "1.27.3"}).values()
    assert old["name"] == "pods.gpupool.io" and old["failurePolicy"] == "Ignore"
    assert "matchConditions" not in old


def test_the_webhook_has_two_replicas_on_two_nodes_and_a_disruption_budget() -> None:
    docs = render()
    deployment = find(docs, "Deployment", "gpupool-k8s")
    assert deployment["spec"]["replicas"] == 2
    spec = deployment["spec"]["template"]["spec"]
    term = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    pdb = find(docs, "PodDisruptionBudget", "gpupool-k8s")
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["minAvailable"] == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert (
        find(render({"kubeVersion": "1.20.2"}), "PodDisruptionBudget", "gpupool-k8s")["apiVersion"]
        == "policy/v1beta1"
    )


@pytest.mark.parametrize(
    ("version", "image", "api"),
    [
        ("1.20.2", "v1.20.2", "kubescheduler.config.k8s.io/v1beta1"),
        ("1.22.17", "v1.22.17", "kubescheduler.config.k8s.io/v1beta2"),
        ("1.24.9", "v1.24.9", "kubescheduler.config.k8s.io/v1beta3"),
        ("v1.29.4-eks-036c24b", "v1.29.4", "kubescheduler.config.k8s.io/v1"),
    ],
)
def test_the_second_scheduler_matches_the_clusters_version(
    version: str, image: str, api: str
) -> None:
    docs = render({"kubeVersion": version})
    (scheduler,) = containers(find(docs, "Deployment", "gpupool-scheduler"))
    assert scheduler["image"] == f"registry.k8s.io/kube-scheduler:{image}"
    config = find(docs, "ConfigMap", "gpupool-scheduler-config")["data"]["scheduler-config.yaml"]
    assert yaml.safe_load(config)["apiVersion"] == api
    pinned = render({"scheduler": {"image": {"tag": "v1.30.1"}}})
    (scheduler,) = containers(find(pinned, "Deployment", "gpupool-scheduler"))
    assert scheduler["image"] == "registry.k8s.io/kube-scheduler:v1.30.1"
    # Helm's own idea of the cluster when nothing is set: a release of v1.x.y, never empty.
    (default,) = containers(find(render(), "Deployment", "gpupool-scheduler"))
    assert default["image"].startswith("registry.k8s.io/kube-scheduler:v1.")


def test_every_container_is_restricted_probed_and_bounded() -> None:
    docs = render()
    for name, spec in pod_specs(docs):
        pod_security = spec.get("securityContext") or {}
        assert pod_security.get("seccompProfile") == {"type": "RuntimeDefault"}, name
        for container in spec["containers"]:
            where = f"{name}/{container['name']}"
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            assert "privileged" not in security, where
            resources = container["resources"]
            assert resources["requests"]["cpu"] and resources["requests"]["memory"], where
            assert resources["limits"]["memory"], where
            if name != "gpupool-init-secrets":  # a Job that runs once has nothing to probe
                assert container.get("readinessProbe") and container.get("livenessProbe"), where
        if name == "gpupool-agent":
            # Root with three capabilities, said in the template, and nothing more.
            assert pod_security["runAsUser"] == 0
            (agent,) = spec["containers"]
            assert agent["securityContext"]["capabilities"]["add"] == ["SETUID", "SETGID", "CHOWN"]
            assert not spec.get("hostPID") and not spec.get("hostNetwork")
            # Its root is read-only: every directory the agent writes is a volume of its own.
            mounted = [Path(m["mountPath"]) for m in agent["volumeMounts"]]
            args = dict(a.removeprefix("--").split("=", 1) for a in agent["args"] if "=" in a)
            writes = [Path("/tmp"), Path("/dev/shm"), mps.SHARED_BASE.parent]
            writes += [Path(args["data-dir"]), Path(args["kubelet-dir"])]
            for path in writes:
                assert any(path.is_relative_to(m) for m in mounted), f"{path}: read-only"
        else:
            assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] > 0, name
    postgres = find(docs, "StatefulSet", "gpupool-postgresql")["spec"]["template"]["spec"]
    assert postgres["securityContext"]["runAsUser"] == 70


def test_service_account_tokens_are_mounted_only_where_the_api_is_called() -> None:
    """A pod gets its token exactly when its service account is granted something: a
    component that starts calling the API needs both its binding and its token."""
    docs = render()
    bound = {
        subject["name"]
        for d in docs
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
        for subject in d["subjects"]
        if subject["kind"] == "ServiceAccount"
    }
    assert bound == {"gpupool-k8s", "gpupool-scheduler", "gpupool-init-secrets", "gpupool-agent"}
    for name, spec in pod_specs(docs):
        account = spec.get("serviceAccountName", "default")
        mounted = spec.get("automountServiceAccountToken", True) is not False
        assert mounted == (account in bound), name
    for d in docs:
        if d["kind"] == "ServiceAccount" and d["metadata"]["name"] not in bound:
            assert d["automountServiceAccountToken"] is False, d["metadata"]["name"]


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer().start()
    yield server
    server.stop()


def test_the_init_job_makes_every_secret_the_chart_refers_to(
    api: FakeApiServer, tmp_path: Path
) -> None:
    docs = render()
    job = find(docs, "Job", "gpupool-init-secrets")
    hooks = job["metadata"]["annotations"]
    assert hooks["helm.sh/hook"] == "pre-install,pre-upgrade"
    (container,) = containers(job)
    done = subprocess.run(
        [sys.executable, "-m", "gpupool.cli", *container["args"], "--kube-api", api.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    made = {name for ns, name in api.secrets if ns == NAMESPACE}
    referred: set[str] = set()
    for _name, spec in pod_specs(docs):
        for volume in spec.get("volumes") or []:
            if "secret" in volume:
                referred.add(volume["secret"]["secretName"])
        for c in spec["containers"]:
            for env in c.get("env") or []:
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    referred.add(ref["name"])
    assert referred <= made, referred - made
    # The server certificate is for the Service the webhook and the extender call.
    secret = api.secrets[(NAMESPACE, "gpupool-k8s-tls")]["data"]
    (tmp_path / "ca.pem").write_bytes(base64.b64decode(secret["ca.crt"]))
    (tmp_path / "cert.pem").write_bytes(base64.b64decode(secret["tls.crt"]))
    names = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(tmp_path / "cert.pem")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    service = find(docs, "Service", "gpupool-k8s")["metadata"]["name"]
    assert f"DNS:{service}.{NAMESPACE}.svc" in names
    config = yaml.safe_load(
        find(docs, "ConfigMap", "gpupool-scheduler-config")["data"]["scheduler-config.yaml"]
    )
    (extender,) = config["extenders"]
    assert extender["tlsConfig"]["caFile"] == "/etc/gpupool-ca/ca.crt"
    assert extender["urlPrefix"] == f"https://{service}.{NAMESPACE}.svc:8443/extender"
    client = api.secrets[(NAMESPACE, "gpupool-k8s-scheduler-client")]["data"]
    assert client["ca.crt"] == secret["ca.crt"]  # one CA for both


def test_k8s_serve_sets_its_webhooks_ca_and_the_runtime_class_when_asked() -> None:
    (k8s,) = containers(find(render(), "Deployment", "gpupool-k8s"))
    assert "--webhook-configuration=gpupool-k8s" in k8s["args"]
    assert "--tls-ca=/etc/gpupool/tls/ca.crt" in k8s["args"]
    assert not [a for a in k8s["args"] if a.startswith("--runtime-class")]
    docs = render({"k8s": {"gpuPodRuntimeClassName": "nvidia"}})
    (k8s,) = containers(find(docs, "Deployment", "gpupool-k8s"))
    assert "--runtime-class=nvidia" in k8s["args"]
    (agent,) = containers(
        find(render({"agent": {"cdiDevices": "uuid"}}), "DaemonSet", "gpupool-agent")
    )
    assert "--cdi-devices=uuid" in agent["args"] and "--device-nodes" in agent["args"]


def test_notes_say_how_to_reach_the_pool_and_get_the_admin_token() -> None:
    notes = next(t for p, t in rendered_text().items() if p.endswith("NOTES.txt"))
    assert "port-forward svc/gpupool-controller 8900" in notes
    assert "get secret gpupool-admin-token -o jsonpath='{.data.token}' | base64 -d" in notes
    assert "gpupool-k8s-webhook-token" in notes
