"""docs/kubernetes.md's commands that sit in its sentences, not in its shell blocks
(test_real_docs.py walks those). Each inline `gpupool ...`, `kubectl ...` and `helm ...` of
the doc is either run here on the real control plane, with the doc's placeholders (`GPU-...`,
`gpp_...`, `ID`) filled in from the cluster, and what the doc says it does is checked; or it
is named with the reason it is no command to run (a command's name in a sentence, a synopsis
of options). An inline command that is neither, or a named one gone from the doc, fails.

`helm` commands run through Helm's Go SDK (no helm binary here) with the same arguments. The
commands leave the cluster as they found it: the GPU goes back to `virtual`, the tokens are
revoked, the Secret and the annotation made are removed, the delete is a server-side dry run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from control_plane import API_PORT, CONTROLLER_PORT, NAMESPACE, ControlPlane

from conftest import CHART, KUBE_VERSION

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DOC = Path(__file__).resolve().parents[3] / "docs" / "kubernetes.md"
CLAIMS = f"http://127.0.0.1:{CONTROLLER_PORT}/api/v1/k8s/claims"
INLINE = re.compile(r"`((?:gpupool|kubectl|helm) [^`]+)`")

# Named, not run: the doc mentions a command, or lists options, inside a sentence.
NAMED = {
    "helm install": "the install's name; test_real_docs.py does what it does",
    "helm template": "the render's name; the rendered chart is what every test here applies",
    "helm uninstall": "a name in a sentence (what uninstall leaves behind: the Secrets the "
    "delete below removes)",
    "helm upgrade": "a name in a sentence; the annotate before it runs below",
    "kubectl describe pod": "a name in a sentence (where the scheduler's scores show)",
    "kubectl debug": "a name in a sentence; test_real_cluster.py adds an ephemeral container",
    "gpupool lease create": "a name in a sentence (the lease a claim makes is that one)",
    "gpupool run": "a name in a sentence; the remote-pod synopsis below is its form",
    "gpupool k8s serve": "the name of the process the harness starts with its pod's arguments",
    "gpupool k8s init-secrets": "a name in a sentence; its whole form runs below",
    "gpupool run --remote --gpus N --compute P% --memory MMiB --tenant T --priority P -- "
    "<command> <args>": "the command the webhook gives a remote-access pod (a synopsis); "
    "test_real_cluster.py checks a real pod's command has this form",
    "gpupool agent --device-plugin [--kubelet-dir /var/lib/kubelet/device-plugins] "
    "[--vgpu-slots 10]": "a synopsis; the harness starts the agent with --device-plugin and "
    "--kubelet-dir (ControlPlane.start_agent), and the kubelet calls its Allocate",
    "gpupool agent --device-nodes": "an option's name (the default); tests/k8s/"
    "test_devicenodes.py and bench/gpu/k8s_device_nodes.py check what it gives",
    "gpupool agent --cdi-devices uuid|index": "an option's values; tests/k8s/test_devicenodes.py",
}

GPU_MODE = "gpupool gpu mode GPU-... physical"
SHOW_ONLY = "helm template gpupool deploy/helm/gpupool --show-only templates/webhook.yaml"
SCHEDULER_TOKEN = "gpupool token create k8s --role scheduler"
SCHEDULER_SECRET = (
    "kubectl -n gpupool create secret generic gpupool-scheduler-token --from-literal=token=gpp_..."
)
JOIN_TOKEN = "gpupool token create gpu-nodes --role join --max-nodes 64 --expires 30d"
TOKEN_LS = "gpupool token ls"
TOKEN_REVOKE = "gpupool token revoke ID"
LEASE_LS = "gpupool lease ls"
INIT_SECRETS = (
    "gpupool k8s init-secrets --namespace gpupool --service gpupool-k8s --admin-token "
    "gpupool-admin-token --tls gpupool-k8s-tls --scheduler-client gpupool-k8s-scheduler-client "
    "--client-ca gpupool-k8s-client-ca"
)
DELETE_SECRETS = (
    "kubectl -n gpupool delete secret -l app.kubernetes.io/managed-by=gpupool-init-secrets"
)
ANNOTATE = (
    "kubectl -n gpupool annotate secret gpupool-k8s-tls gpupool-k8s-scheduler-client "
    "gpupool-k8s-client-ca gpupool-k8s-webhook-token gpupool-postgresql "
    "helm.sh/resource-policy=keep"
)
BAD_VALUE = "helm template deploy/helm/gpupool --set agent.cdiDevices=all"
LABEL_NS = "kubectl label ns kube-system kubernetes.io/metadata.name=kube-system"
RUN = {
    GPU_MODE,
    SHOW_ONLY,
    SCHEDULER_TOKEN,
    SCHEDULER_SECRET,
    JOIN_TOKEN,
    TOKEN_LS,
    TOKEN_REVOKE,
    LEASE_LS,
    INIT_SECRETS,
    DELETE_SECRETS,
    ANNOTATE,
    BAD_VALUE,
    LABEL_NS,
}


def inline_commands(markdown: str) -> list[str]:
    """The doc's inline commands outside its fenced blocks, whitespace as one space."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return [" ".join(found.split()) for found in INLINE.findall(prose)]


def words(command: str) -> list[str]:
    return command.split()


def test_every_inline_command_is_run_or_named() -> None:
    found = set(inline_commands(DOC.read_text()))
    assert not RUN & set(NAMED)
    assert found - RUN - set(NAMED) == set(), "inline commands neither run nor named here"
    assert (RUN | set(NAMED)) - found == set(), "commands named here are gone from the doc"


def render(values: dict[str, Any]) -> dict[str, str]:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) renders")
    with helm.Chart.load(str(CHART)) as chart:
        rendered: dict[str, str] = chart.render(values, name="gpupool", namespace=NAMESPACE)
    return rendered


def test_the_helm_commands_of_the_prose_render_as_the_doc_says() -> None:
    # --show-only templates/webhook.yaml: the extender's entry for your own scheduler.
    assert words(SHOW_ONLY)[-2:] == ["--show-only", "templates/webhook.yaml"]
    manifests = render({"kubeVersion": KUBE_VERSION})
    (webhook,) = [
        text for path, text in manifests.items() if path.endswith("templates/webhook.yaml")
    ]
    assert "name: gpupool-scheduler-config" in webhook and "extenders:" in webhook
    # --set agent.cdiDevices=all: refused by values.schema.json with the doc's message.
    assert words(BAD_VALUE)[-2:] == ["--set", "agent.cdiDevices=all"]
    with pytest.raises(Exception) as refused:
        render({"kubeVersion": KUBE_VERSION, "agent": {"cdiDevices": "all"}})
    doc_message = re.search(r"fails with\s+`([^`]+)`", DOC.read_text())
    assert doc_message is not None
    assert " ".join(doc_message.group(1).split()) in " ".join(str(refused.value).split())


def test_the_inline_commands_run_on_the_real_cluster(cluster: ControlPlane) -> None:
    def gpupool(command: str, *extra: str) -> str:
        return cluster.gpupool(*words(command)[1:], *extra).stdout

    def kubectl(command: str, *extra: str) -> str:
        return cluster.kubectl(*words(command)[1:], *extra).stdout

    # `gpupool gpu mode GPU-... physical`: the node's resources follow within a heartbeat.
    gpus = json.loads(cluster.gpupool("gpus", "-o", "json").stdout)
    uuid = gpus[0]["uuid"]
    vgpu_before = cluster.allocatable("gpupool.io/vgpu")
    gpupool(GPU_MODE.replace("GPU-...", uuid))
    try:
        cluster.wait_for(
            "the node's gpupool.io/gpu after a GPU went physical",
            lambda: (
                cluster.allocatable("gpupool.io/gpu") == 1
                and cluster.allocatable("gpupool.io/vgpu") < vgpu_before
            ),
            watch=["agent", "controller"],
        )
    finally:
        cluster.gpupool("gpu", "mode", uuid, "virtual")
    cluster.wait_for(
        "the node's gpupool.io/vgpu after the GPU went back",
        lambda: cluster.allocatable("gpupool.io/vgpu") == vgpu_before,
        watch=["agent", "controller"],
    )

    # The extender's own token, in the Secret `auth.tokenSecret` names; an agents' join token.
    secret = gpupool(SCHEDULER_TOKEN).strip()
    assert re.fullmatch(r"gpp_\S+", secret), secret
    kubectl(SCHEDULER_SECRET.replace("gpp_...", secret))
    try:
        stored = cluster.kubectl_json("-n", NAMESPACE, "get", "secret", "gpupool-scheduler-token")
        assert set(stored["data"]) == {"token"}
        assert cluster._http_ok(CLAIMS, token=secret), (
            "the scheduler token does not open the extender's endpoints"
        )
        gpupool(JOIN_TOKEN)
        listed = gpupool(TOKEN_LS)
        assert "k8s" in listed and "gpu-nodes" in listed and "scheduler" in listed
        mine = [
            t
            for t in json.loads(cluster.gpupool("token", "ls", "-o", "json").stdout)
            if t["name"] in ("k8s", "gpu-nodes")
        ]
        assert {t["role"] for t in mine} == {"scheduler", "join"}
        for token in mine:
            gpupool(TOKEN_REVOKE.replace("ID", str(token["id"])))
        assert not cluster._http_ok(CLAIMS, token=secret), (
            "a revoked token still opens the extender's endpoints"
        )
    finally:
        cluster.kubectl(
            "-n", NAMESPACE, "delete", "secret", "gpupool-scheduler-token", "--ignore-not-found"
        )
    assert "HOLDER" in gpupool(LEASE_LS).upper()

    # init-secrets by hand, from outside the cluster (the doc's --kube-api flags): it keeps
    # every Secret as it is.
    managed = "app.kubernetes.io/managed-by=gpupool-init-secrets"
    versions = {
        s["metadata"]["name"]: s["metadata"]["resourceVersion"]
        for s in cluster.kubectl_json("-n", NAMESPACE, "get", "secret", "-l", managed)["items"]
    }
    assert {"gpupool-admin-token", "gpupool-k8s-tls"} <= set(versions)
    # By hand, with the operator's own credentials (the hook's Role went with the hook).
    operator = cluster.work / "operator.token"
    operator.write_text(cluster.tokens["admin"])
    done = cluster.gpupool(
        *words(INIT_SECRETS)[1:],
        f"--kube-api=https://127.0.0.1:{API_PORT}",
        f"--kube-token-file={operator}",
        f"--kube-ca-file={cluster.work / 'pki' / 'ca.crt'}",
    )
    assert done.stdout.startswith("created: none; kept: "), done.stdout
    after = {
        s["metadata"]["name"]: s["metadata"]["resourceVersion"]
        for s in cluster.kubectl_json("-n", NAMESPACE, "get", "secret", "-l", managed)["items"]
    }
    assert after == versions, "init-secrets changed a Secret that existed"

    # The delete that removes them, as a server-side dry run: it selects exactly those.
    deleted = kubectl(DELETE_SECRETS, "--dry-run=server")
    assert sorted(re.findall(r'secret "([^"]+)" deleted', deleted)) == sorted(versions)

    # The annotation that keeps them through an upgrade from 0.1.0.
    names = [w for w in words(ANNOTATE)[5:] if "=" not in w]
    kubectl(ANNOTATE)
    try:
        for name in names:
            meta = cluster.kubectl_json("-n", NAMESPACE, "get", "secret", name)["metadata"]
            assert meta["annotations"]["helm.sh/resource-policy"] == "keep", name
    finally:
        cluster.kubectl("-n", NAMESPACE, "annotate", "secret", *names, "helm.sh/resource-policy-")

    # The namespace label 1.20 lacks (the harness set it already, as the doc tells users to).
    kubectl(LABEL_NS)
    labels = cluster.kubectl_json("get", "ns", "kube-system")["metadata"]["labels"]
    assert labels["kubernetes.io/metadata.name"] == "kube-system"
