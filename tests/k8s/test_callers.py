"""`gpupool k8s serve` as a real process over TLS: only the scheduler (its client certificate)
calls the extender, only the API server (its certificate or token) the webhook; everyone
else is refused and changes nothing. Bodies over the limit get a fast 413."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from admission import admission_review, pod
from certs import Pem, make_ca, make_signed
from fake_apiserver import FakeApiServer

from tests.ports import free_port as _free_port
from tests.timing import scaled

pytestmark = pytest.mark.slow

WEBHOOK_TOKEN = "webhook-token-0123456789abcdef"


@dataclass
class Served:
    url: str
    port: int
    ca: Pem
    scheduler: Pem
    apiserver: Pem
    rogue: Pem
    api: FakeApiServer
    log: Path

    def client(self, cert: Pem | None = None, **headers: str) -> httpx.Client:
        context = ssl.create_default_context(cafile=str(self.ca.cert))
        if cert is not None:
            context.load_cert_chain(str(cert.cert), str(cert.key))
        return httpx.Client(base_url=self.url, verify=context, timeout=30, headers=headers)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server for the module: its certificates take seconds to make."""
    tmp_path = tmp_path_factory.mktemp("k8s-callers")
    ca = make_ca(tmp_path / "pki", "cluster-ca")
    server = make_signed(ca, tmp_path / "pki", "gpupool-k8s", server=True)
    rogue_ca = make_ca(tmp_path / "rogue", "rogue-ca")
    token_file = tmp_path / "webhook.token"
    token_file.write_text(WEBHOOK_TOKEN + "\n")
    api = FakeApiServer().start()
    port = _free_port()
    args = [sys.executable, "-m", "gpupool.cli", "--url", "http://127.0.0.1:9", "k8s", "serve"]
    args += ["--host", "127.0.0.1", "--port", str(port), "--kube-api", api.url]
    args += ["--tls-cert", str(server.cert), "--tls-key", str(server.key)]
    args += ["--client-ca", str(ca.cert), "--extender-client", "gpupool-scheduler"]
    args += ["--webhook-client", "kube-apiserver", "--webhook-token-file", str(token_file)]
    args += ["--max-body-mib", "1", "--sweep-interval", "3600"]
    log = tmp_path / "k8s-serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    served = Served(
        f"https://127.0.0.1:{port}",
        port,
        ca,
        make_signed(ca, tmp_path / "pki", "gpupool-scheduler"),
        make_signed(ca, tmp_path / "pki", "kube-apiserver"),
        make_signed(rogue_ca, tmp_path / "rogue", "gpupool-scheduler"),
        api,
        log,
    )
    try:
        deadline = time.monotonic() + scaled(60)
        with served.client() as probe:
            while True:
                try:
                    if probe.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "gpupool k8s serve did not start"
                time.sleep(0.2)
        yield served
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(10))
        api.stop()


FILTER = {"Pod": pod(None, name="web"), "NodeNames": ["node-1", "node-2"]}


def _bind(name: str) -> dict[str, str]:
    return {"PodName": name, "PodNamespace": "team-a", "PodUID": f"uid-{name}", "Node": "node-1"}


def _bindings_of(served: Served, name: str) -> list[object]:
    return [b for b in served.api.bindings if b.get("metadata", {}).get("name") == name]


def test_the_kubelets_probe_needs_no_credential(served: Served) -> None:
    with served.client() as anyone:
        assert anyone.get("/healthz").json() == {"status": "ok"}


def test_scheduler_certificate_calls_the_extender(served: Served) -> None:
    served.api.add_pod(pod(None, name="web-ok"))
    with served.client(served.scheduler) as scheduler:
        assert scheduler.post("/extender/filter", json=FILTER).json()["NodeNames"] == [
            "node-1",
            "node-2",
        ]
        assert scheduler.post("/extender/bind", json=_bind("web-ok")).json() == {"Error": ""}
    assert served.api.pods[("team-a", "web-ok")]["spec"]["nodeName"] == "node-1"


@pytest.mark.parametrize("who", ["nobody", "apiserver", "wrong-token"])
def test_extender_refuses_every_other_caller_and_binds_nothing(served: Served, who: str) -> None:
    name = f"web-{who}"
    served.api.add_pod(pod(None, name=name))
    cert = served.apiserver if who == "apiserver" else None
    headers = {"Authorization": "Bearer guessed-token-0123456789"} if who == "wrong-token" else {}
    with served.client(cert, **headers) as caller:
        for path, body in (("/extender/filter", FILTER), ("/extender/bind", _bind(name))):
            response = caller.post(path, json=body)
            assert response.status_code == 401, response.text
            assert "scheduler" in response.json()["detail"]
    assert "nodeName" not in served.api.pods[("team-a", name)]["spec"]
    assert _bindings_of(served, name) == []
    assert "refused POST /extender/bind" in served.log.read_text()


def test_certificate_of_another_ca_is_refused_in_the_handshake(served: Served) -> None:
    served.api.add_pod(pod(None, name="web-rogue"))
    with served.client(served.rogue) as rogue, pytest.raises(httpx.TransportError):
        rogue.post("/extender/bind", json=_bind("web-rogue"))
    assert _bindings_of(served, "web-rogue") == []


def test_api_server_calls_the_webhook_with_its_certificate_or_its_token(served: Served) -> None:
    review = admission_review(pod({"gpupool.io/gpu": "1"}))
    with served.client(served.apiserver) as apiserver:
        answer = apiserver.post("/webhook/mutate", json=review)
        assert answer.status_code == 200 and answer.json()["response"]["allowed"] is True
    with served.client(Authorization=f"Bearer {WEBHOOK_TOKEN}") as by_token:
        assert by_token.post("/webhook/mutate", json=review).status_code == 200


@pytest.mark.parametrize("who", ["nobody", "scheduler", "wrong-token"])
def test_webhook_refuses_every_other_caller(served: Served, who: str) -> None:
    cert = served.scheduler if who == "scheduler" else None
    headers = {"Authorization": "Bearer " + "x" * 30} if who == "wrong-token" else {}
    with served.client(cert, **headers) as caller:
        response = caller.post("/webhook/mutate", json=admission_review(pod(None)))
    assert response.status_code == 401, response.text
    assert "API server" in response.json()["detail"]


def test_malformed_payload_over_tls_is_a_400_and_oversize_body_a_413(served: Served) -> None:
    with served.client(served.scheduler) as scheduler:
        bad = scheduler.post("/extender/filter", json={"Pod": 5})
        assert bad.status_code == 400
        assert "Pod must be an object" in bad.json()["Error"]
        big = scheduler.post(
            "/extender/filter",
            content=b'{"Pod": {}, "pad": "' + b"x" * (2 * 1024 * 1024) + b'"}',
            headers={"Content-Type": "application/json"},
        )
        assert big.status_code == 413
        assert "1 MiB" in big.json()["Error"]
        assert scheduler.get("/healthz").status_code == 200


def test_unauthenticated_caller_is_refused_before_its_body_is_read(served: Served) -> None:
    with served.client() as anyone:
        response = anyone.post(
            "/webhook/mutate",
            content=b"x" * (2 * 1024 * 1024),
            headers={"Content-Type": "application/json"},
        )
    assert response.status_code == 401
