"""Every malformed ExtenderArgs, ExtenderBindingArgs or AdmissionReview gets a 4xx with a
reason, never a 500: hypothesis replaces any part of real payloads with any JSON value."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from admission import admission_review, pod
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.exceptions import StarletteDeprecationWarning

from gpupool.client.sdk import ControllerUnreachable
from gpupool.k8s.app import ServeSettings, create_app
from gpupool.k8s.callers import Callers
from gpupool.k8s.kube import KubeError

with warnings.catch_warnings():
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

SLICE = {"gpupool.io/vgpu": "1", "gpupool.io/vgpu-compute": "25", "gpupool.io/vgpu-memory": "20480"}


class NoController:
    """The pool as the extender sees it when the controller is away (fast, no sockets)."""

    def k8s_placement(self, _query: Any) -> Any:
        raise ControllerUnreachable("http://127.0.0.1:9", "no controller in this test")

    def create_claim(self, _body: Any) -> Any:
        raise ControllerUnreachable("http://127.0.0.1:9", "no controller in this test")

    def release_claim(self, _claim: str) -> Any:
        raise ControllerUnreachable("http://127.0.0.1:9", "no controller in this test")

    def claims(self) -> list[Any]:
        return []


class NoApiServer:
    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        raise KubeError(f"pod {namespace}/{name} not found")

    async def bind(self, *_args: Any) -> None:
        raise KubeError("no API server in this test")

    async def pods_with_label(self, _label: str) -> list[Any]:
        return []

    async def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    serve = ServeSettings(
        controller_url="http://127.0.0.1:9", sweep_interval_s=3600, callers=Callers.insecure()
    )
    app = create_app(serve, NoController(), NoApiServer())  # type: ignore[arg-type]
    with TestClient(app) as client:
        yield client


def _remote_pod() -> dict[str, Any]:
    return pod(
        SLICE,
        annotations={"gpupool.io/access": "remote", "gpupool.io/tenant": "team-a"},
        command=["python", "train.py"],
        env=[{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}, {"name": "A", "value": "1"}],
        volumes=[{"name": "data", "hostPath": {"path": "/data"}}],
    )


VALID: dict[str, list[dict[str, Any]]] = {
    "/extender/filter": [
        {"Pod": pod(SLICE), "NodeNames": ["gpu-a", "gpu-b"]},
        {"Pod": pod(SLICE), "Nodes": {"items": [{"metadata": {"name": "gpu-a"}}]}},
        {"Pod": pod(None), "NodeNames": ["cpu-1"]},
    ],
    "/extender/prioritize": [{"Pod": pod(SLICE), "NodeNames": ["gpu-a"]}],
    "/extender/bind": [
        {"PodName": "notebook", "PodNamespace": "team-a", "PodUID": "u-1", "Node": "gpu-a"}
    ],
    "/webhook/mutate": [
        admission_review(pod(SLICE)),
        admission_review(_remote_pod()),
        admission_review(pod(SLICE), operation="UPDATE", old=pod(SLICE)),
        admission_review(pod(None, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])),
    ],
}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a JSON document that a value can be put at."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*prefix, i))


def _replace(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    out = copy.deepcopy(document)
    parent = out
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return out


@st.composite
def malformed(draw: st.DrawFn) -> tuple[str, Any]:
    """A real payload with one of its parts (any depth, the whole included) replaced."""
    route = draw(st.sampled_from(sorted(VALID)))
    document = draw(st.sampled_from(VALID[route]))
    path = draw(st.sampled_from(list(_paths(document))))
    return route, _replace(document, path, draw(json_values))


def _assert_answered(response: Any) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert response.status_code == 400, response.text
        reason = response.json()
        assert isinstance(reason["Error"], str) and reason["Error"], reason


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(malformed())
def test_any_part_of_a_payload_replaced_gets_an_answer_or_a_400_never_a_500(
    http: TestClient, case: tuple[str, Any]
) -> None:
    route, body = case
    _assert_answered(http.post(route, json=body))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(sorted(VALID)), json_values)
def test_any_json_value_as_the_whole_body_gets_a_400_or_an_answer(
    http: TestClient, route: str, body: Any
) -> None:
    _assert_answered(http.post(route, json=body))


@pytest.mark.parametrize(
    ("route", "body", "reason"),
    [
        ("/extender/filter", {"Pod": 5}, "Pod must be an object, got a number (5)"),
        ("/extender/prioritize", {"Pod": [1]}, "Pod must be an object, got a list"),
        ("/extender/filter", {"NodeNames": ["a"]}, "Pod is missing"),
        ("/extender/filter", {"Pod": {}, "NodeNames": "a"}, "NodeNames must be a list"),
        (
            "/extender/filter",
            {"Pod": {"spec": {"containers": [{"resources": {"limits": []}}]}}},
            "Pod.spec.containers[0].resources.limits must be an object",
        ),
        ("/extender/bind", {"PodName": {"x": 1}}, "PodName must be a string"),
        ("/webhook/mutate", {"kind": "AdmissionReview", "request": 5}, "request must be an"),
        (
            "/webhook/mutate",
            {"kind": "AdmissionReview", "request": {"kind": {"kind": "Pod"}, "object": 5}},
            "request.object must be an object",
        ),
        ("/webhook/mutate", {"kind": "Pod"}, "kind must be AdmissionReview"),
        ("/webhook/mutate", [1, 2], "body must be a JSON object"),
    ],
)
def test_malformed_payload_gets_400_naming_what_is_wrong(
    http: TestClient, route: str, body: Any, reason: str
) -> None:
    response = http.post(route, json=body)
    assert response.status_code == 400, response.text
    assert reason in response.json()["Error"]


def test_body_that_is_not_json_gets_400(http: TestClient) -> None:
    response = http.post("/extender/filter", content=b"{not json", headers={"Content-Type": "x"})
    assert response.status_code == 400
    assert response.json()["Error"] == "body is not JSON"
