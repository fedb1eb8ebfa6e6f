"""Bad input gets a 4xx with a reason, and changes nothing."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import register_fake_node


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    from tests.conftest import ControllerProcess, _spawn, _wait_ready, free_port

    port = free_port()
    data_dir = tmp_path_factory.mktemp("bad-input")
    proc = _spawn(port, data_dir, None, {})
    ctl = ControllerProcess(f"http://127.0.0.1:{port}", port, data_dir, None, proc, {})
    try:
        _wait_ready(ctl.url, proc)
        with ctl.client() as c:
            register_fake_node(c, gpus=2)
            assert c.post("/leases", json={"compute_pct": 50, "memory": "1GiB"}).status_code == 201
            yield c
    finally:
        ctl.stop()


def _snapshot(client: httpx.Client) -> tuple[object, ...]:
    return (
        client.get("/leases", params={"state": "all"}).json(),
        client.get("/gpus").json(),
        client.get("/tenants").json(),
        len(client.get("/events", params={"limit": 10000}).json()),
    )


LEASE_CASES = [
    ({"compute_pct": 0, "memory": "1GiB"}, 422, "1..100"),
    ({"compute_pct": 101, "memory": "1GiB"}, 422, "1..100"),
    ({"compute_pct": "abc", "memory": "1GiB"}, 422, "compute"),
    ({"compute_pct": 10, "memory": "-1GiB"}, 422, "positive"),
    ({"compute_pct": 10, "memory": "512"}, 422, "no unit"),
    ({"compute_pct": 10, "memory": "12XB"}, 422, "unit"),
    ({"compute_pct": 10, "memory": "1GiB", "tenant": "nobody"}, 422, "no tenant 'nobody'"),
    ({"compute_pct": 10, "memory": "1GiB", "gpus": 0}, 422, "gpus"),
    ({"compute_pct": 10, "memory": "1GiB", "gpus": 3}, 409, "never be granted"),
    ({"compute_pct": 10, "memory": "200GiB"}, 409, "never be granted"),
    ({"compute_pct": 10, "memory": "1GiB", "colour": "red"}, 422, "colour"),
    ({"physical": True, "compute_pct": 10}, 422, "whole GPUs"),
    ({"compute_pct": 10, "memory": "1GiB", "node": "elsewhere"}, 422, "no node 'elsewhere'"),
    ({"compute_pct": 10, "memory": "1GiB", "priority": -1}, 422, "priority"),
]


@pytest.mark.parametrize(("body", "status", "reason"), LEASE_CASES)
def test_bad_lease_request_is_refused_with_a_reason_and_changes_nothing(
    client: httpx.Client, body: dict[str, object], status: int, reason: str
) -> None:
    before = _snapshot(client)
    response = client.post("/leases", json=body)
    assert response.status_code == status, response.text
    assert reason in response.json()["detail"]
    assert _snapshot(client) == before


def test_malformed_json_is_a_400_and_changes_nothing(client: httpx.Client) -> None:
    before = _snapshot(client)
    response = client.post(
        "/leases", content=b'{"compute_pct": 10,', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"] == "malformed_json"
    assert _snapshot(client) == before


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("post", "/gpus/GPU-nope/mode", {"mode": "physical"}, 404),
        ("post", "/gpus/GPU-sim-node-a-0/mode", {"mode": "sideways"}, 422),
        ("get", "/gpus/GPU-nope", None, 404),
        ("get", "/leases/l-nope", None, 404),
        ("delete", "/leases/l-nope", None, 404),
        ("post", "/gpus/GPU-sim-node-a-0/clear", None, 409),
        ("post", "/tenants", {"name": "bad name!"}, 422),
        ("post", "/tenants", {"name": "t", "quota": {"max_memory": "10"}}, 422),
        ("post", "/tenants", {"name": "default", "weight": 2}, 409),
        ("delete", "/tenants/default", None, 409),
        ("patch", "/tenants/nobody", {"weight": 2}, 404),
        ("get", "/leases?state=sleeping", None, 422),
        ("post", "/nodes/ghost/heartbeat", {}, 404),
    ],
)
def test_bad_operator_requests_are_4xx_with_a_reason(
    client: httpx.Client, method: str, path: str, body: object, status: int
) -> None:
    before = _snapshot(client)
    kwargs = {"json": body} if body is not None else {}
    response = client.request(method.upper(), path, **kwargs)
    assert response.status_code == status, response.text
    assert response.json()["detail"]
    assert _snapshot(client) == before


def test_openapi_document_lists_the_api(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    assert "/api/v1/leases" in spec["paths"]
    assert "/api/v1/gpus/{uuid}/mode" in spec["paths"]
