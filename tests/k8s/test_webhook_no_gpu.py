"""The webhook on pods it cannot fully read: `envFrom` (ConfigMaps, Secrets) and ephemeral
containers (`kubectl debug`) get explicit "no GPU" variables, which win over envFrom; GPU pods
get the configured runtime class."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from admission import admission_review, apply_patch, pod

from gpupool.k8s.webhook import NO_GPU_ENV, WebhookSettings, review

SETTINGS = WebhookSettings(new_claim=lambda: "c-fixedclaim0001")
SLICE = {"gpupool.io/vgpu": "1", "gpupool.io/vgpu-compute": "25", "gpupool.io/vgpu-memory": "20480"}
FROM_CONFIGMAP = [{"configMapRef": {"name": "cuda-everything"}}]
NO_GPU = [{"name": n, "value": v} for n, v in NO_GPU_ENV]


def answer(review_body: dict[str, Any], settings: WebhookSettings = SETTINGS) -> dict[str, Any]:
    response: dict[str, Any] = review(review_body, settings)["response"]
    return response


def admitted(obj: dict[str, Any], settings: WebhookSettings = SETTINGS) -> dict[str, Any]:
    response = answer(admission_review(obj), settings)
    assert response["allowed"] is True, response
    return apply_patch(obj, response)


def effective_env(container: dict[str, Any], configmap: dict[str, str]) -> dict[str, str]:
    """The container's variables as the kubelet makes them: envFrom first, then env, later
    entries replacing earlier ones (Kubernetes' documented precedence)."""
    out: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        out.update({prefix + k: v for k, v in configmap.items()})
    for entry in container.get("env") or []:
        out[entry["name"]] = entry.get("value", "")
    return out


def test_envfrom_on_a_pod_without_gpus_cannot_expose_the_nodes_gpus() -> None:
    obj = pod(None, env=[{"name": "PORT", "value": "80"}])
    obj["spec"]["containers"][0]["envFrom"] = FROM_CONFIGMAP
    obj["spec"]["initContainers"] = [
        {"name": "init", "image": "busybox", "envFrom": FROM_CONFIGMAP}
    ]
    after = admitted(obj)
    main, init = after["spec"]["containers"][0], after["spec"]["initContainers"][0]
    assert main["env"] == [{"name": "PORT", "value": "80"}, *NO_GPU]
    assert init["env"] == NO_GPU
    assert main["envFrom"] == FROM_CONFIGMAP  # the pod keeps its own settings
    hostile = {
        "NVIDIA_VISIBLE_DEVICES": "all",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
        "CUDA_MPS_PIPE_DIRECTORY": "/run/gpupool/mps/pipe",
        "APP_MODE": "prod",
    }
    env = effective_env(main, hostile)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == ""
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == ""
    assert env["APP_MODE"] == "prod" and env["PORT"] == "80"
    # With a prefix the keys land under CUDA_MPS_ all the same: still overridden.
    main["envFrom"] = [{"prefix": "CUDA_MPS_", "configMapRef": {"name": "x"}}]
    assert effective_env(main, {"CLIENT_PRIORITY": "0"})["CUDA_MPS_CLIENT_PRIORITY"] == ""


def test_a_second_call_of_the_webhook_changes_nothing_more() -> None:
    """reinvocationPolicy: IfNeeded calls the webhook again on its own output."""
    obj = pod(None, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])
    obj["spec"]["containers"][0]["envFrom"] = FROM_CONFIGMAP
    once = admitted(obj)
    again = answer(admission_review(once))
    assert again["allowed"] is True and "patch" not in again


def test_a_pod_without_envfrom_is_left_alone() -> None:
    obj = pod(None, env=[{"name": "PORT", "value": "80"}])
    response = answer(admission_review(obj))
    assert response["allowed"] is True and "patch" not in response


def test_a_container_another_device_plugin_gives_gpus_keeps_its_variables() -> None:
    obj = pod({"nvidia.com/gpu": "1"})
    obj["spec"]["containers"][0]["envFrom"] = FROM_CONFIGMAP
    response = answer(admission_review(obj))
    assert response["allowed"] is True and "patch" not in response


def _debug(target: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
    """The AdmissionReview of `kubectl debug`: an UPDATE of pods/ephemeralcontainers."""
    new = copy.deepcopy(target)
    new["spec"].setdefault("ephemeralContainers", []).append(container)
    body = admission_review(new, operation="UPDATE", old=target)
    body["request"]["subResource"] = "ephemeralcontainers"
    body["request"]["resource"] = {"group": "", "version": "v1", "resource": "pods"}
    return body


def test_ephemeral_containers_get_no_gpu_whatever_they_bring() -> None:
    target = pod(None, name="web")
    target["spec"]["ephemeralContainers"] = [{"name": "debugger-old", "image": "busybox"}]
    debugger = {
        "name": "debugger-new",
        "image": "nvidia/cuda:12.4.1-base-ubuntu22.04",
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}, {"name": "X", "value": "1"}],
        "envFrom": FROM_CONFIGMAP,
        "securityContext": {"privileged": True},  # a pod without GPUs may debug as it likes
    }
    body = _debug(target, debugger)
    response = answer(body)
    assert response["allowed"] is True
    after = apply_patch(body["request"]["object"], response)
    old, new = after["spec"]["ephemeralContainers"]
    assert old == {"name": "debugger-old", "image": "busybox"}  # the API server forbids changes
    assert new["env"] == [{"name": "X", "value": "1"}, *NO_GPU]
    again = answer(_debug(target, new))
    assert "patch" not in again


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"securityContext": {"privileged": True}}, "privileged"),
        ({"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}, "SYS_ADMIN"),
        ({"envFrom": FROM_CONFIGMAP}, "envFrom"),
    ],
)
def test_ephemeral_containers_of_gpu_pods_cannot_escape(extra: dict[str, Any], reason: str) -> None:
    target = admitted(pod(SLICE))
    response = answer(_debug(target, {"name": "debugger", "image": "busybox", **extra}))
    assert response["allowed"] is False
    assert "ephemeral container debugger" in response["status"]["message"]
    assert reason in response["status"]["message"]


def test_gpu_pods_get_the_runtime_class_that_gives_them_their_gpus() -> None:
    nvidia = WebhookSettings(runtime_class="nvidia", new_claim=lambda: "c-fixedclaim0001")
    assert admitted(pod(SLICE), nvidia)["spec"]["runtimeClassName"] == "nvidia"
    assert admitted(pod({"gpupool.io/gpu": "1"}), nvidia)["spec"]["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in admitted(pod(SLICE))["spec"]  # not configured: untouched
    remote = pod(SLICE, annotations={"gpupool.io/access": "remote"}, command=["python"])
    assert "runtimeClassName" not in admitted(remote, nvidia)["spec"]  # no GPU on its node
    assert "runtimeClassName" not in admitted(pod(None, env=[]), nvidia)["spec"]
    own = pod(SLICE, runtimeClassName="nvidia")
    assert admitted(own, nvidia)["spec"]["runtimeClassName"] == "nvidia"
    other = answer(admission_review(pod(SLICE, runtimeClassName="kata")), nvidia)
    assert other["allowed"] is False and "runtime class nvidia" in other["status"]["message"]
