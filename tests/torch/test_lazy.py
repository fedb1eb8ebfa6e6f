"""A lazy attach's request: checked when the program attaches, not at its first GPU op."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from gpupool.torch.lazy import LAZY_ENV, lease_request


def test_a_lazy_request_is_remote_and_takes_compute_as_people_write_it() -> None:
    request = lease_request({"compute": "30%", "memory": "8GiB", "gpus": 2})
    assert (request.access, request.compute_pct, request.memory_mib(), request.gpus) == (
        "remote",
        30,
        8192,
        2,
    )
    assert request.ttl_s is not None and "(lazy)" in request.holder


def test_a_lazy_request_comes_from_the_environment_as_gpupool_run_sets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(LAZY_ENV, json.dumps({"memory": "2048MiB", "tenant": "team-a"}))
    request = lease_request(None)
    assert (request.tenant, request.memory_mib()) == ("team-a", 2048)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"physical": True}, "remote lease"),
        ({"access": "direct"}, "remote lease"),
        ({"memory": "lots"}, "memory"),
        ({"compute": 140}, "compute"),
        ({"gpus": 0}, "gpus"),
    ],
)
def test_a_bad_lazy_request_fails_at_attach_saying_why(
    fields: dict[str, object], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        lease_request(fields)


def test_a_malformed_environment_request_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LAZY_ENV, "{not json")
    with pytest.raises(ValueError, match=LAZY_ENV):
        lease_request(None)
