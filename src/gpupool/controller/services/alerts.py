"""Alerts: the rules shipped for Prometheus (deploy/prometheus/gpupool-rules.yml), and the
same rules evaluated inside the controller for pools that run without Prometheus."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import httpx

from gpupool.controller.services.snapshot import GpuReading, PoolSnapshot

log = logging.getLogger("gpupool.controller")

Severity = Literal["critical", "warning", "info"]
Status = Literal["firing", "resolved"]

MEMORY_FULL_RATIO = 0.95
QUEUE_WAIT_LIMIT_S = 600
RECENT_WINDOW_S = 600
RESOLVED_KEPT = 100


@dataclass(frozen=True, slots=True)
class Finding:
    """One instance of a rule's condition holding now: for which labels, and in words."""

    labels: tuple[tuple[str, str], ...]
    value: float
    summary: str


@dataclass(frozen=True, slots=True)
class Signals:
    """What rules look at: the pool now, and counters' increases over the recent window."""

    snapshot: PoolSnapshot
    xid_increase: dict[str, float]
    preemptions_recent: float


@dataclass(frozen=True, slots=True)
class AlertRule:
    name: str
    expr: str
    """The PromQL of the shipped rules file: the same condition, over the exported metrics."""
    for_s: int
    severity: Severity
    summary: str
    """Prometheus annotation template; the controller words its own findings."""
    description: str
    check: Callable[[Signals], list[Finding]]


def _gpu_labels(g: GpuReading) -> tuple[tuple[str, str], ...]:
    return (("node", g.node), ("gpu", str(g.index)), ("UUID", g.uuid))


def _isolated(signals: Signals) -> list[Finding]:
    return [
        Finding(
            _gpu_labels(g),
            1,
            f"GPU {g.node}/{g.index} is isolated: {g.isolation_reason or 'no reason given'}",
        )
        for g in signals.snapshot.gpus
        if g.mode == "isolated"
    ]


def _xid(signals: Signals) -> list[Finding]:
    out = []
    for g in signals.snapshot.gpus:
        increase = signals.xid_increase.get(g.uuid, 0.0)
        if increase > 0:
            last = f", last Xid {g.xid_last}" if g.xid_last is not None else ""
            out.append(
                Finding(
                    _gpu_labels(g),
                    increase,
                    f"GPU {g.node}/{g.index}: {increase:g} Xid error(s) in 10 min{last}",
                )
            )
    return out


def _memory_full(signals: Signals) -> list[Finding]:
    out = []
    for g in signals.snapshot.gpus:
        if g.memory_used_mib is None or g.memory_mib <= 0:
            continue
        ratio = g.memory_used_mib / g.memory_mib
        if ratio > MEMORY_FULL_RATIO:
            out.append(
                Finding(
                    _gpu_labels(g),
                    round(ratio, 4),
                    f"GPU {g.node}/{g.index} memory {ratio:.0%} full "
                    f"({g.memory_used_mib} of {g.memory_mib} MiB)",
                )
            )
    return out


def _queue_wait(signals: Signals) -> list[Finding]:
    wait = signals.snapshot.queue_oldest_wait_s
    if wait <= QUEUE_WAIT_LIMIT_S:
        return []
    return [
        Finding(
            (),
            round(wait, 1),
            f"a lease request has waited {wait / 60:.0f} min "
            f"({signals.snapshot.queue_length} waiting)",
        )
    ]


def _node_down(signals: Signals) -> list[Finding]:
    return [
        Finding((("node", n.name),), 0, f"node {n.name} sends no heartbeats")
        for n in signals.snapshot.nodes
        if not n.up
    ]


def _preempted(signals: Signals) -> list[Finding]:
    if signals.preemptions_recent <= 0:
        return []
    n = signals.preemptions_recent
    return [Finding((), n, f"{n:g} lease(s) preempted in the last 10 min")]


RULES: tuple[AlertRule, ...] = (
    AlertRule(
        name="GpupoolGpuIsolated",
        expr='gpupool_gpu_mode{mode="isolated"} == 1',
        for_s=0,
        severity="warning",
        summary="GPU {{ $labels.node }}/{{ $labels.gpu }} is isolated",
        description="The GPU is out of service after a fault or an operator's decision; "
        "clear it once it is healthy.",
        check=_isolated,
    ),
    AlertRule(
        name="GpupoolGpuXidErrors",
        expr=f"increase(gpupool_gpu_xid_errors_total[{RECENT_WINDOW_S // 60}m]) > 0",
        for_s=0,
        severity="critical",
        summary="Xid errors on GPU {{ $labels.Hostname }}/{{ $labels.gpu }}",
        description="The driver reported Xid errors; see DCGM_FI_DEV_XID_ERRORS for the last one.",
        check=_xid,
    ),
    AlertRule(
        name="GpupoolGpuMemoryNearlyFull",
        expr="DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE) "
        f"> {MEMORY_FULL_RATIO}",
        for_s=300,
        severity="warning",
        summary="GPU {{ $labels.Hostname }}/{{ $labels.gpu }} memory is nearly full",
        description=f"More than {MEMORY_FULL_RATIO:.0%} of the GPU's memory is in use.",
        check=_memory_full,
    ),
    AlertRule(
        name="GpupoolQueueWaitTooLong",
        expr=f"gpupool_queue_oldest_wait_seconds > {QUEUE_WAIT_LIMIT_S}",
        for_s=60,
        severity="warning",
        summary=f"A lease request has waited more than {QUEUE_WAIT_LIMIT_S // 60} minutes",
        description="The pool is short of the capacity asked for, or a quota holds requests back.",
        check=_queue_wait,
    ),
    AlertRule(
        name="GpupoolNodeDown",
        expr="gpupool_node_up == 0",
        for_s=60,
        severity="critical",
        summary="Node {{ $labels.node }} is down",
        description="The node's agent sends no heartbeats; its GPUs take no new leases.",
        check=_node_down,
    ),
    AlertRule(
        name="GpupoolLeasePreempted",
        expr='increase(gpupool_lease_transitions_total{to="preempted"}'
        f"[{RECENT_WINDOW_S // 60}m]) > 0",
        for_s=0,
        severity="info",
        summary="Leases were preempted",
        description="Higher-priority requests took capacity from running leases.",
        check=_preempted,
    ),
)


def duration_text(seconds: int) -> str:
    """Prometheus' duration words: 0s, 90s, 5m, 2h."""
    if seconds and seconds % 3600 == 0:
        return f"{seconds // 3600}h"
    if seconds and seconds % 60 == 0:
        return f"{seconds // 60}m"
    return f"{seconds}s"


def rules_document(rules: Iterable[AlertRule] = RULES) -> dict[str, Any]:
    """The rules file's content as data; the shipped YAML must parse to exactly this."""
    return {
        "groups": [
            {
                "name": "gpupool",
                "rules": [
                    {
                        "alert": r.name,
                        "expr": r.expr,
                        "for": duration_text(r.for_s),
                        "labels": {"severity": r.severity},
                        "annotations": {"summary": r.summary, "description": r.description},
                    }
                    for r in rules
                ],
            }
        ]
    }


# ---- evaluation -----------------------------------------------------------------------------


class RecentIncrease:
    """How much counters grew within a sliding window; a counter that drops was reset."""

    def __init__(self, window_s: float = RECENT_WINDOW_S) -> None:
        self.window_s = window_s
        self.last: dict[str, float] = {}
        self.steps: dict[str, deque[tuple[float, float]]] = {}

    def observe(self, key: str, value: float, now: float) -> None:
        before = self.last.get(key)
        self.last[key] = value
        if before is None:
            return
        grew = value - before if value >= before else value
        if grew > 0:
            self.steps.setdefault(key, deque()).append((now, grew))

    def increase(self, key: str, now: float) -> float:
        steps = self.steps.get(key)
        if not steps:
            return 0.0
        while steps and now - steps[0][0] > self.window_s:
            steps.popleft()
        return sum(g for _, g in steps)

    def all_increases(self, now: float) -> dict[str, float]:
        return {k: self.increase(k, now) for k in list(self.steps)}


@dataclass(slots=True)
class Alert:
    rule: AlertRule
    labels: tuple[tuple[str, str], ...]
    state: Literal["pending", "firing", "resolved"]
    active_since: float
    value: float
    summary: str
    fired_at: float | None = None
    resolved_at: float | None = None

    def all_labels(self) -> dict[str, str]:
        return {"alertname": self.rule.name, "severity": self.rule.severity, **dict(self.labels)}

    def fingerprint(self) -> str:
        text = ",".join(f"{k}={v}" for k, v in sorted(self.all_labels().items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Notice:
    status: Status
    alert: Alert


@dataclass(slots=True)
class Alerts:
    """Rule instances through pending (condition holds, `for` not yet over), firing, resolved."""

    rules: tuple[AlertRule, ...] = RULES
    active: dict[tuple[str, tuple[tuple[str, str], ...]], Alert] = field(default_factory=dict)
    resolved: deque[Alert] = field(default_factory=lambda: deque(maxlen=RESOLVED_KEPT))
    xids: RecentIncrease = field(default_factory=RecentIncrease)
    preemptions: RecentIncrease = field(default_factory=RecentIncrease)
    evaluated_at: float | None = None

    def evaluate(self, snap: PoolSnapshot, preempted_total: float, now: float) -> list[Notice]:
        for g in snap.gpus:
            if g.xid_errors is not None:
                self.xids.observe(g.uuid, g.xid_errors, now)
        self.preemptions.observe("preempted", preempted_total, now)
        signals = Signals(
            snapshot=snap,
            xid_increase=self.xids.all_increases(now),
            preemptions_recent=self.preemptions.increase("preempted", now),
        )
        notices: list[Notice] = []
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for rule in self.rules:
            for finding in rule.check(signals):
                key = (rule.name, finding.labels)
                seen.add(key)
                alert = self.active.get(key)
                if alert is None:
                    alert = Alert(
                        rule, finding.labels, "pending", now, finding.value, finding.summary
                    )
                    self.active[key] = alert
                alert.value, alert.summary = finding.value, finding.summary
                if alert.state == "pending" and now - alert.active_since >= rule.for_s:
                    alert.state = "firing"
                    alert.fired_at = now
                    notices.append(Notice("firing", alert))
        for key in [k for k in self.active if k not in seen]:
            alert = self.active.pop(key)
            if alert.state == "firing":
                alert.state = "resolved"
                alert.resolved_at = now
                self.resolved.appendleft(alert)
                notices.append(Notice("resolved", alert))
        self.evaluated_at = now
        return notices

    def firing(self) -> list[Alert]:
        order = {"critical": 0, "warning": 1, "info": 2}
        alerts = [a for a in self.active.values() if a.state == "firing"]
        return sorted(alerts, key=lambda a: (order[a.rule.severity], -(a.fired_at or 0)))

    def pending(self) -> list[Alert]:
        return [a for a in self.active.values() if a.state == "pending"]

    def firing_counts(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {(r.name, r.severity): 0 for r in self.rules}
        for alert in self.firing():
            counts[(alert.rule.name, alert.rule.severity)] += 1
        return counts


# ---- the webhook ----------------------------------------------------------------------------


def _rfc3339(t: float | None) -> str:
    if t is None:
        return "0001-01-01T00:00:00Z"
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def webhook_body(notices: list[Notice], external_url: str) -> dict[str, Any]:
    """Alertmanager's webhook format (version 4), so existing receivers understand it."""
    alerts = []
    for n in notices:
        a = n.alert
        alerts.append(
            {
                "status": n.status,
                "labels": a.all_labels(),
                "annotations": {"summary": a.summary, "description": a.rule.description},
                "startsAt": _rfc3339(a.fired_at or a.active_since),
                "endsAt": _rfc3339(a.resolved_at if n.status == "resolved" else None),
                "generatorURL": f"{external_url}/#/alerts",
                "fingerprint": a.fingerprint(),
            }
        )
    status: Status = "firing" if any(n.status == "firing" for n in notices) else "resolved"
    return {
        "version": "4",
        "groupKey": "gpupool",
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "gpupool-webhook",
        "groupLabels": {},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": external_url,
        "alerts": alerts,
    }


@dataclass(slots=True)
class WebhookStatus:
    url: str | None
    sent: int = 0
    failed: int = 0
    last_error: str | None = None
    last_sent_at: float | None = None


class Webhook:
    """Posts notices in the background, retrying a few times; never blocks evaluation."""

    RETRIES = 3

    def __init__(
        self,
        url: str | None,
        external_url: str,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.status = WebhookStatus(url)
        self.external_url = external_url
        self._queue: asyncio.Queue[list[Notice]] = asyncio.Queue(maxsize=1000)
        self._transport = transport

    def send(self, notices: list[Notice]) -> None:
        if self.status.url is None or not notices:
            return
        try:
            self._queue.put_nowait(notices)
        except asyncio.QueueFull:
            self.status.failed += 1
            self.status.last_error = "too many undelivered notices: dropped"

    async def run(self) -> None:
        if self.status.url is None:
            return
        async with httpx.AsyncClient(timeout=5.0, transport=self._transport) as client:
            while True:
                notices = await self._queue.get()
                try:
                    await self._deliver(client, webhook_body(notices, self.external_url))
                finally:
                    self._queue.task_done()

    async def _deliver(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        assert self.status.url is not None
        delay_s = 1.0
        for attempt in range(1, self.RETRIES + 1):
            try:
                response = await client.post(self.status.url, json=body)
                if response.status_code < 300:
                    self.status.sent += 1
                    self.status.last_sent_at = time.time()
                    self.status.last_error = None
                    return
                error = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
            self.status.last_error = error
            if attempt < self.RETRIES:
                await asyncio.sleep(delay_s)
                delay_s *= 2
        self.status.failed += 1
        log.warning("alert webhook %s failed: %s", self.status.url, self.status.last_error)

    async def drain(self, timeout_s: float = 3.0) -> None:
        """Give queued notices a moment to go out at shutdown."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._queue.join()
