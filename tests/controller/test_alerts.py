"""Alerts: the shipped Prometheus rules file, the controller's own evaluation of the same
rules, and the webhook that tells people."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpupool.agent import metrics as agent_metrics
from gpupool.agent.backends import FakeBackend
from gpupool.agent.service import Agent, AgentSettings
from gpupool.controller.services.alerts import RULES, Alerts, Notice, rules_document, webhook_body
from gpupool.controller.services.snapshot import GpuReading, NodeReading, PoolSnapshot
from tests.conftest import AUTH
from tests.controller.inprocess import API, controller, register
from tests.ports import free_port
from tests.timing import scaled

RULES_FILE = Path(__file__).parents[2] / "deploy" / "prometheus" / "gpupool-rules.yml"
DURATION = re.compile(r"^(0|[0-9]+(ms|s|m|h|d|w|y))+$")
PROMQL_WORDS = {
    "increase", "rate", "irate", "changes", "delta", "sum", "max", "min", "avg", "count",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "abs", "clamp_min", "clamp_max", "time", "vector", "absent",
}  # fmt: skip


# ---- the rules file ---------------------------------------------------------------------------


def test_rules_file_is_exactly_the_rules_the_controller_evaluates() -> None:
    assert yaml.safe_load(RULES_FILE.read_text()) == rules_document()


def test_every_rule_has_the_fields_prometheus_needs() -> None:
    doc = yaml.safe_load(RULES_FILE.read_text())
    groups = doc["groups"]
    assert [g["name"] for g in groups] == ["gpupool"]
    names = set()
    for rule in groups[0]["rules"]:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"])
        assert rule["alert"] not in names
        names.add(rule["alert"])
        assert isinstance(rule["expr"], str) and rule["expr"].strip()
        assert rule["expr"].count("(") == rule["expr"].count(")")
        assert rule["expr"].count("{") == rule["expr"].count("}")
        assert DURATION.match(rule["for"]), rule["for"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        for template in rule["annotations"].values():
            assert template.count("{{") == template.count("}}")
    wanted = {
        "GpuIsolated",
        "GpuXidErrors",
        "GpuMemoryNearlyFull",
        "QueueWaitTooLong",
        "NodeDown",
        "LeasePreempted",
    }
    assert {n.removeprefix("Gpupool") for n in names} == wanted


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    tokens = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return tokens - PROMQL_WORDS


def exported_names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_rule_expressions_use_only_metrics_that_gpupool_exports(tmp_path: Path) -> None:
    with controller(tmp_path / "ctl") as client:
        register(client, gpus=1)
        controller_text = client.get("/metrics").text
    backend = FakeBackend.from_spec("1xH100-80GB", node_name="n")
    agent = Agent(
        AgentSettings(controller_url="http://127.0.0.1:9", data_dir=tmp_path, node_name="n"),
        backend=backend,
    )
    agent_text = agent_metrics.exposition(agent.metrics_view()).decode()
    exported = exported_names(controller_text) | exported_names(agent_text)
    for rule in RULES:
        used = metric_names(rule.expr)
        assert used, rule.expr
        assert used <= exported, f"{rule.name} uses {used - exported}, not exported"


def test_rules_file_passes_promtool_where_it_is_installed() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed; the structural checks above stand in for it")
    done = subprocess.run(
        [promtool, "check", "rules", str(RULES_FILE)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    config = RULES_FILE.with_name("prometheus.yml")
    done = subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Series in, alerts out: the PromQL fires when the controller's own evaluation does.
    tests = RULES_FILE.with_name("gpupool-rules.test.yml")
    done = subprocess.run(
        [promtool, "test", "rules", tests.name], capture_output=True, text=True, cwd=tests.parent
    )
    assert done.returncode == 0, done.stdout + done.stderr


# ---- evaluation inside the controller ---------------------------------------------------------


def gpu(index: int = 0, **changes: Any) -> GpuReading:
    base = GpuReading(
        uuid=f"GPU-{index}", node="n1", index=index, model="H100", memory_mib=81920, mode="virtual",
        target_mode=None, healthy=True, simulated=True, compute_granted_pct=0, memory_granted_mib=0,
        leases=0, whole=False, utilization_pct=0.0, memory_used_mib=0, temperature_c=30.0,
        power_w=60.0, xid_errors=0, xid_last=None, isolation_reason=None,
    )  # fmt: skip
    return replace(base, **changes)


def snapshot(
    gpus: list[GpuReading] | None = None,
    nodes_down: tuple[str, ...] = (),
    queue_wait_s: float = 0.0,
) -> PoolSnapshot:
    gpus = gpus if gpus is not None else [gpu()]
    nodes = [NodeReading("n1", True, "fake", len(gpus), 8, {}, 1.0)]
    nodes += [NodeReading(n, False, "fake", 0, 8, {}, 100.0) for n in nodes_down]
    return PoolSnapshot(
        at=0.0, gpus=gpus, nodes=nodes, tenants=[], leases_by_state={},
        queue_length=1 if queue_wait_s else 0, queue_oldest_wait_s=queue_wait_s,
        compute_capacity_pct=100, compute_granted_pct=0, compute_used_pct=0.0,
        memory_capacity_mib=81920, memory_granted_mib=0, memory_used_mib=0, fragmentation=0.0,
    )  # fmt: skip


def names(notices: list[Notice]) -> list[tuple[str, str]]:
    return [(n.status, n.alert.rule.name) for n in notices]


def test_node_down_fires_after_its_for_duration_and_resolves_when_back() -> None:
    alerts = Alerts()
    assert names(alerts.evaluate(snapshot(nodes_down=("n2",)), 0, now=1000.0)) == []
    assert [a.rule.name for a in alerts.pending()] == ["GpupoolNodeDown"]
    assert names(alerts.evaluate(snapshot(nodes_down=("n2",)), 0, now=1059.0)) == []
    fired = alerts.evaluate(snapshot(nodes_down=("n2",)), 0, now=1060.0)
    assert names(fired) == [("firing", "GpupoolNodeDown")]
    assert dict(fired[0].alert.labels) == {"node": "n2"}
    assert alerts.firing_counts()[("GpupoolNodeDown", "critical")] == 1
    assert names(alerts.evaluate(snapshot(), 0, now=1070.0)) == [("resolved", "GpupoolNodeDown")]
    assert alerts.firing() == [] and [a.rule.name for a in alerts.resolved] == ["GpupoolNodeDown"]


def test_a_condition_that_ends_before_its_for_duration_never_fires() -> None:
    alerts = Alerts()
    alerts.evaluate(snapshot(queue_wait_s=700), 0, now=0.0)
    assert names(alerts.evaluate(snapshot(), 0, now=30.0)) == []
    assert alerts.pending() == [] and list(alerts.resolved) == []


def test_isolated_gpu_fires_at_once_with_its_reason() -> None:
    alerts = Alerts()
    isolated = gpu(mode="isolated", isolation_reason="xid: Xid 79: GPU has fallen off the bus")
    fired = alerts.evaluate(snapshot([isolated]), 0, now=5.0)
    assert names(fired) == [("firing", "GpupoolGpuIsolated")]
    assert "fallen off the bus" in fired[0].alert.summary
    assert dict(fired[0].alert.labels) == {"node": "n1", "gpu": "0", "UUID": "GPU-0"}


def test_xid_errors_fire_when_the_count_grows_and_clear_after_ten_quiet_minutes() -> None:
    alerts = Alerts()
    assert names(alerts.evaluate(snapshot([gpu(xid_errors=2)]), 0, now=0.0)) == []  # known before
    fired = alerts.evaluate(snapshot([gpu(xid_errors=3, xid_last=48)]), 0, now=10.0)
    assert names(fired) == [("firing", "GpupoolGpuXidErrors")]
    assert "last Xid 48" in fired[0].alert.summary
    assert names(alerts.evaluate(snapshot([gpu(xid_errors=3)]), 0, now=300.0)) == []
    assert names(alerts.evaluate(snapshot([gpu(xid_errors=3)]), 0, now=611.0)) == [
        ("resolved", "GpupoolGpuXidErrors")
    ]
    # An agent restart resets its count: errors after that still count.
    assert names(alerts.evaluate(snapshot([gpu(xid_errors=1)]), 0, now=700.0)) == [
        ("firing", "GpupoolGpuXidErrors")
    ]


def test_memory_nearly_full_waits_five_minutes() -> None:
    alerts = Alerts()
    full = [gpu(memory_used_mib=80000)]
    assert names(alerts.evaluate(snapshot(full), 0, now=0.0)) == []
    assert names(alerts.evaluate(snapshot(full), 0, now=300.0)) == [
        ("firing", "GpupoolGpuMemoryNearlyFull")
    ]


def test_preempted_leases_fire_an_info_alert_for_ten_minutes() -> None:
    alerts = Alerts()
    alerts.evaluate(snapshot(), 4, now=0.0)
    assert names(alerts.evaluate(snapshot(), 5, now=1.0)) == [("firing", "GpupoolLeasePreempted")]
    assert names(alerts.evaluate(snapshot(), 5, now=602.0)) == [
        ("resolved", "GpupoolLeasePreempted")
    ]


def test_webhook_body_follows_alertmanagers_format() -> None:
    alerts = Alerts()
    fired = alerts.evaluate(snapshot([gpu(mode="isolated", isolation_reason="bad")]), 0, now=1.7e9)
    body = webhook_body(fired, "http://ctl:8900")
    assert body["version"] == "4" and body["status"] == "firing"
    [alert] = body["alerts"]
    assert alert["labels"] == {
        "alertname": "GpupoolGpuIsolated",
        "severity": "warning",
        "node": "n1",
        "gpu": "0",
        "UUID": "GPU-0",
    }
    assert alert["startsAt"].endswith("Z") and alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert alert["generatorURL"] == "http://ctl:8900/#/alerts"
    assert len(alert["fingerprint"]) == 16


# ---- the webhook, from a running controller ---------------------------------------------------


class Receiver:
    """An HTTP endpoint on loopback that keeps what it is sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def wait_for(self, status: str, name: str, timeout_s: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + scaled(timeout_s)
        while time.monotonic() < deadline:
            for body in self.bodies:
                for alert in body["alerts"]:
                    if alert["status"] == status and alert["labels"]["alertname"] == name:
                        return dict(alert)
            time.sleep(0.05)
        raise AssertionError(f"no {status} {name} posted; got {self.bodies}")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    yield r
    r.server.shutdown()


def test_controller_posts_firing_and_resolved_alerts_to_the_webhook(
    tmp_path: Path, receiver: Receiver
) -> None:
    with controller(tmp_path, webhook_url=receiver.url) as client:
        [uuid, _] = register(client, gpus=2)
        client.post(
            f"{API}/gpus/{uuid}/isolate",
            json={"reason": "fan failed"},
            headers={"X-Gpupool-Actor": "ops-1"},
        )
        fired = receiver.wait_for("firing", "GpupoolGpuIsolated")
        assert fired["labels"]["UUID"] == uuid
        assert "fan failed" in fired["annotations"]["summary"]
        shown = client.get(f"{API}/alerts").json()
        assert [a["name"] for a in shown["firing"]] == ["GpupoolGpuIsolated"]
        assert shown["webhook"]["configured"] is True
        client.post(f"{API}/gpus/{uuid}/clear")
        receiver.wait_for("resolved", "GpupoolGpuIsolated")
        shown = client.get(f"{API}/alerts").json()
        assert shown["firing"] == [] and [a["name"] for a in shown["resolved"]] == [
            "GpupoolGpuIsolated"
        ]
        assert client.get(f"{API}/alerts").json()["webhook"]["sent"] >= 2


@pytest.mark.slow
def test_gpupool_controller_alert_webhook_option_reaches_the_receiver(
    tmp_path: Path, receiver: Receiver
) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "gpupool.cli", "controller", "--port", str(port)]
    argv += ["--data-dir", str(tmp_path), "--alert-webhook", receiver.url]
    with (tmp_path / "controller.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        api = f"http://127.0.0.1:{port}/api/v1"
        deadline = time.monotonic() + scaled(30)
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "controller did not start"
            try:
                if httpx.get(f"{api}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        node = {"name": "n1", "gpus": [{"uuid": "GPU-n1-0", "model": "H100", "memory_mib": 1024}]}
        httpx.post(f"{api}/nodes", json=node, headers=AUTH).raise_for_status()
        httpx.post(
            f"{api}/gpus/GPU-n1-0/isolate", json={"reason": "xid 79"}, headers=AUTH
        ).raise_for_status()
        fired = receiver.wait_for("firing", "GpupoolGpuIsolated")
        assert fired["generatorURL"] == f"http://127.0.0.1:{port}/#/alerts"
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(15))
