"""The admission webhook on real AdmissionReview v1 payloads."""

from __future__ import annotations

from typing import Any

import pytest
from admission import admission_review, apply_patch, pod

from gpupool.k8s.webhook import WebhookSettings, review

SETTINGS = WebhookSettings(
    scheduler_name="gpupool-scheduler",
    controller_url="http://gpupool-controller.gpupool:8900",
    token_secret=("gpupool-token", "token"),
    new_claim=lambda: "c-fixedclaim0001",
)
SLICE = {"gpupool.io/vgpu": "1", "gpupool.io/vgpu-compute": "25", "gpupool.io/vgpu-memory": "20480"}


def answer(obj: dict[str, Any], **kw: Any) -> dict[str, Any]:
    out = review(admission_review(obj, **kw), SETTINGS)
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    response: dict[str, Any] = out["response"]
    return response


def refused(obj: dict[str, Any]) -> str:
    response = answer(obj)
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    message: str = response["status"]["message"]
    return message


def test_direct_slice_gets_a_claim_the_gpupool_scheduler_and_loses_escape_variables() -> None:
    env = [
        {"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "100"},
        {"name": "CUDA_VISIBLE_DEVICES", "value": "0,1,2,3"},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
        {"name": "LD_PRELOAD", "value": "/tmp/unlimit.so"},
        {"name": "LD_LIBRARY_PATH", "value": "/tmp/fake-cuda"},
        {"name": "GPUPOOL_CLAIM", "value": "c-someoneelses0001"},
        {"name": "GPUPOOL_LEASE", "value": "l-someoneelses"},
        {"name": "GPUPOOL_URL", "value": "http://gpupool-controller.gpupool:8900"},
        {"name": "EPOCHS", "value": "3"},
    ]
    obj = pod(SLICE, env=env)
    response = answer(obj)
    assert response["allowed"] is True
    after = apply_patch(obj, response)
    assert after["metadata"]["labels"]["gpupool.io/claim"] == "c-fixedclaim0001"
    assert after["spec"]["schedulerName"] == "gpupool-scheduler"
    container = after["spec"]["containers"][0]
    assert container["env"] == [
        {"name": "GPUPOOL_URL", "value": "http://gpupool-controller.gpupool:8900"},  # their own
        {"name": "EPOCHS", "value": "3"},
        {"name": "GPUPOOL_CLAIM", "value": "c-fixedclaim0001"},
    ]
    assert container["resources"]["limits"] == SLICE  # the extender and plugin need them


def test_a_claim_label_set_by_the_user_is_replaced() -> None:
    obj = pod(SLICE)
    obj["metadata"]["labels"] = {"gpupool.io/claim": "c-stolenclaim000001", "app": "nb"}
    after = apply_patch(obj, answer(obj))
    assert after["metadata"]["labels"] == {"gpupool.io/claim": "c-fixedclaim0001", "app": "nb"}


def test_claim_label_cannot_change_on_update() -> None:
    old = pod(SLICE)
    old["metadata"]["labels"] = {"gpupool.io/claim": "c-fixedclaim0001"}
    new = pod(SLICE)
    new["metadata"]["labels"] = {"gpupool.io/claim": "c-otherclaim00001"}
    response = answer(new, operation="UPDATE", old=old)
    assert response["allowed"] is False
    assert "cannot change" in response["status"]["message"]
    same = answer(old, operation="UPDATE", old=old)
    assert same["allowed"] is True and "patch" not in same


def test_whole_gpus_pod_is_direct_with_a_claim() -> None:
    obj = pod({"gpupool.io/gpu": "2"}, name="train")
    after = apply_patch(obj, answer(obj))
    assert after["metadata"]["labels"]["gpupool.io/claim"] == "c-fixedclaim0001"


def test_remote_pod_runs_under_gpupool_run_and_needs_no_gpu_node() -> None:
    obj = pod(
        SLICE,
        annotations={
            "gpupool.io/access": "remote",
            "gpupool.io/priority": "40",
            "gpupool.io/tenant": "team-a",
        },
        command=["python", "train.py"],
    )
    obj["spec"]["containers"][0]["args"] = ["--epochs", "3"]
    after = apply_patch(obj, answer(obj))
    container = after["spec"]["containers"][0]
    assert container["command"] == [
        "gpupool",
        "run",
        "--remote",
        "--gpus",
        "1",
        "--compute",
        "25%",
        "--tenant",
        "team-a",
        "--priority",
        "40",
        "--memory",
        "20480MiB",
        "--",
        "python",
        "train.py",
        "--epochs",
        "3",
    ]
    assert "args" not in container
    assert container["resources"]["limits"] == {}
    assert {"name": "GPUPOOL_URL", "value": "http://gpupool-controller.gpupool:8900"} in container[
        "env"
    ]
    token = next(e for e in container["env"] if e["name"] == "GPUPOOL_TOKEN")
    assert token["valueFrom"] == {"secretKeyRef": {"name": "gpupool-token", "key": "token"}}
    assert "gpupool.io/claim" not in (after["metadata"].get("labels") or {})
    assert "schedulerName" not in after["spec"]


def test_pod_without_gpus_is_untouched_unless_it_sets_nvidia_variables() -> None:
    plain = pod(None, env=[{"name": "PORT", "value": "80"}])
    response = answer(plain)
    assert response["allowed"] is True and "patch" not in response
    sneaky = pod(None, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])
    after = apply_patch(sneaky, answer(sneaky))
    assert after["spec"]["containers"][0]["env"] == []
    assert "schedulerName" not in after["spec"]


@pytest.mark.parametrize(
    ("limits", "extra", "reason"),
    [
        (
            {"gpupool.io/vgpu": "1", "gpupool.io/gpu": "1", "gpupool.io/vgpu-compute": "25"},
            {},
            "both",
        ),
        ({"gpupool.io/gpu": "1", "gpupool.io/vgpu-compute": "25"}, {}, "takes whole GPUs"),
        ({"gpupool.io/vgpu-compute": "25"}, {}, "without gpupool.io/vgpu"),
        ({"gpupool.io/vgpu": "1"}, {}, "needs gpupool.io/vgpu-compute"),
        ({"gpupool.io/vgpu": "1", "gpupool.io/vgpu-compute": "150"}, {}, "1..100"),
        (
            {
                "gpupool.io/vgpu": "1",
                "gpupool.io/vgpu-compute": "25",
                "gpupool.io/vgpu-memory": "8Gi",
            },
            {},
            "8192, not 8Gi",
        ),
        ({"gpupool.io/vgpu": "2", "gpupool.io/vgpu-compute": "25"}, {}, "one MPS daemon per GPU"),
        (SLICE, {"securityContext": {"privileged": True}}, "privileged"),
        (SLICE, {"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}, "SYS_ADMIN"),
        (SLICE, {"envFrom": [{"configMapRef": {"name": "cuda-settings"}}]}, "envFrom"),
    ],
)
def test_contradictory_or_unsafe_gpu_pods_are_refused_with_the_reason(
    limits: dict[str, str], extra: dict[str, Any], reason: str
) -> None:
    obj = pod(limits)
    obj["spec"]["containers"][0].update(extra)
    assert reason in refused(obj)


def test_pod_level_escapes_are_refused() -> None:
    assert "hostPID" in refused(pod(SLICE, hostPID=True))
    assert "spec.nodeName" in refused(pod(SLICE, nodeName="gpu-node-1"))
    devices = pod(SLICE, volumes=[{"name": "dev", "hostPath": {"path": "/dev/nvidia0"}}])
    assert "/dev/nvidia0" in refused(devices)
    two = pod(SLICE)
    two["spec"]["containers"].append(
        {"name": "side", "image": "x", "resources": {"limits": {"gpupool.io/gpu": "1"}}}
    )
    assert "only one container" in refused(two)
    remote_whole = pod(
        {"gpupool.io/gpu": "1"}, annotations={"gpupool.io/access": "remote"}, command=["x"]
    )
    assert "always direct" in refused(remote_whole)
    remote_no_command = pod(SLICE, annotations={"gpupool.io/access": "remote"})
    assert "give the command" in refused(remote_no_command)
    bad_priority = pod(SLICE, annotations={"gpupool.io/priority": "high"})
    assert "gpupool.io/priority" in refused(bad_priority)
    mismatch = pod(SLICE)
    mismatch["spec"]["containers"][0]["resources"]["requests"] = {"gpupool.io/vgpu-compute": "50"}
    assert "differs from limit" in refused(mismatch)


def test_priority_comes_from_the_priority_class_when_not_annotated() -> None:
    from gpupool.k8s.pods import gpu_ask

    assert gpu_ask(pod(SLICE, priority=100)).priority == 100
    assert gpu_ask(pod(SLICE, priority=2000000000)).priority == 1000
    assert gpu_ask(pod(SLICE, priority=5, annotations={"gpupool.io/priority": "7"})).priority == 7


def test_a_remote_pod_keeps_its_own_tenant_token() -> None:
    mine = {"name": "GPUPOOL_TOKEN", "valueFrom": {"secretKeyRef": {"name": "mine", "key": "t"}}}
    obj = pod(SLICE, annotations={"gpupool.io/access": "remote"}, command=["python"], env=[mine])
    container = apply_patch(obj, answer(obj))["spec"]["containers"][0]
    assert [e for e in container["env"] if e["name"] == "GPUPOOL_TOKEN"] == [mine]


@pytest.mark.parametrize(
    ("written", "mib"),
    [("8000", 8000), ("8k", 8000), ("8e3", 8000), ("8E3", 8000), ("1M", 1000000), ("1.5k", 1500)],
)
def test_every_form_the_api_server_stores_a_whole_number_in_is_accepted(
    written: str, mib: int
) -> None:
    """The API server stores `gpupool.io/vgpu-memory: 8000` as `8k` before the webhook sees it."""
    obj = pod(
        {**SLICE, "gpupool.io/vgpu-memory": written},
        annotations={"gpupool.io/access": "remote"},
        command=["python"],
    )
    command = apply_patch(obj, answer(obj))["spec"]["containers"][0]["command"]
    assert command[command.index("--memory") + 1] == f"{mib}MiB"


@pytest.mark.parametrize("written", ["8Gi", "1Ki", "1500m", "0.5", "-1", "8x", "1e99"])
def test_memory_that_is_no_whole_number_of_mib_is_refused(written: str) -> None:
    assert "vgpu-memory" in refused(pod({**SLICE, "gpupool.io/vgpu-memory": written}))


def test_a_request_equal_to_its_limit_in_another_form_is_accepted() -> None:
    obj = pod({**SLICE, "gpupool.io/vgpu-memory": "8k"})
    obj["spec"]["containers"][0]["resources"]["requests"] = {"gpupool.io/vgpu-memory": "8000"}
    assert answer(obj)["allowed"] is True


def test_a_second_call_on_a_remote_pod_it_changed_is_idempotent() -> None:
    """reinvocationPolicy IfNeeded: a later webhook changed the pod, the API server asks again."""
    obj = pod(SLICE, annotations={"gpupool.io/access": "remote"}, command=["python", "train.py"])
    first = apply_patch(obj, answer(obj))
    first["spec"]["containers"][0]["env"].append({"name": "SIDECAR", "value": "1"})
    again = answer(first)
    assert again["allowed"] is True, again
    assert apply_patch(first, again) == first


def test_a_second_call_still_strips_what_a_later_webhook_added() -> None:
    obj = pod(SLICE, annotations={"gpupool.io/access": "remote"}, command=["python"])
    first = apply_patch(obj, answer(obj))
    first["spec"]["containers"][0]["env"].append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"})
    after = apply_patch(first, answer(first))
    names = [e["name"] for e in after["spec"]["containers"][0]["env"]]
    assert "NVIDIA_VISIBLE_DEVICES" not in names
    assert after["spec"]["containers"][0]["command"] == first["spec"]["containers"][0]["command"]
