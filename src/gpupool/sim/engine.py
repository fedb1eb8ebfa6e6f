"""A discrete-event replay: jobs arrive, queue, run for their duration and leave.

The pool is the controller's own `Pool`: arrivals are enqueued and the queue is served
exactly as the controller serves it, at simulated times.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpupool.core import LeaseRequest, Pool, Slice


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    request: LeaseRequest
    arrival_s: float
    duration_s: float | None
    """None: it never ends by itself."""
    kind: str = ""


@dataclass(slots=True)
class Outcome:
    started_s: dict[str, float] = field(default_factory=dict)
    ended_s: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    samples: list[tuple[float, float, int]] = field(default_factory=list)
    """(time, GPU units held, requests waiting) at regular times."""
    busy_unit_s: float = 0.0
    end_s: float = 0.0
    preempted: int = 0


def units_of(slices: Sequence[Slice]) -> float:
    """GPU units a lease holds: whole GPUs 1, slices their compute share."""
    return sum(1.0 if s.whole else min(s.compute_pct / 100, 1.0) for s in slices)


def replay(
    pool: Pool, jobs: Sequence[Job], samples: int = 100, preempt_grace_s: float | None = None
) -> Outcome:
    """Run every job through the pool; jobs still waiting at the end never started.

    With `preempt_grace_s`, blocked higher-priority requests preempt lower-priority
    jobs as the controller does: each victim ends after the grace period and is queued
    again for the rest of its run (it checkpointed).
    """
    out = Outcome()
    by_id = {j.id: j for j in jobs}
    origin: dict[str, str] = {j.id: j.id for j in jobs}
    events: list[tuple[float, int, int, str]] = []  # (time, 0 end / 1 arrival, seq, lease)
    for n, job in enumerate(jobs):
        heapq.heappush(events, (job.arrival_s, 1, n, job.id))
    if not events:
        return out
    first = events[0][0]
    horizon = max(j.arrival_s + (j.duration_s or 0.0) for j in jobs)
    step = max((horizon - first) / max(samples, 1), 1e-9)
    next_sample = first
    last_t = first
    units = 0.0
    seq = len(jobs)
    ends: dict[str, float] = {}
    while events:
        t, kind, _n, lease_id = heapq.heappop(events)
        if kind == 0 and ends.get(lease_id) != t:
            continue  # an end that preemption moved
        while next_sample <= t:
            out.samples.append((round(next_sample, 3), round(units, 3), len(pool.queue)))
            next_sample += step
        out.busy_unit_s += units * (t - last_t)
        last_t = t
        if kind == 0:
            units -= units_of(pool.holdings.get(lease_id, ()))
            pool.release(lease_id)
            del ends[lease_id]
            out.ended_s.setdefault(origin[lease_id], t)
        else:
            pool.enqueue(lease_id, by_id[lease_id].request, now=t)
        for overdue_id, reason in pool.overdue(t):
            pool.release(overdue_id)
            out.failed[origin[overdue_id]] = reason
        for grant in pool.serve_queue(now=t):
            units += units_of(grant.slices)
            out.started_s.setdefault(origin[grant.lease_id], t)
            duration = by_id[grant.lease_id].duration_s
            if duration is not None:
                seq += 1
                ends[grant.lease_id] = t + duration
                heapq.heappush(events, (t + duration, 0, seq, grant.lease_id))
        if preempt_grace_s is None:
            continue
        for plan in pool.plan_preemptions(now=t):
            for victim in plan.victims:
                stop = t + preempt_grace_s
                left = ends.get(victim, stop) - stop
                if left <= 0:
                    continue  # it ends within the grace period anyway
                out.preempted += 1
                seq += 1
                ends[victim] = stop
                heapq.heappush(events, (stop, 0, seq, victim))
                again = f"{origin[victim]}~{seq}"
                job = by_id[victim]
                by_id[again] = Job(again, job.request, stop, left, job.kind)
                origin[again] = origin[victim]
                heapq.heappush(events, (stop, 1, seq, again))
    out.end_s = last_t
    out.samples.append((round(last_t, 3), round(units, 3), len(pool.queue)))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": round(sum(values) / len(values), 3) if values else 0.0,
        "p50": round(percentile(values, 50), 3),
        "p95": round(percentile(values, 95), 3),
        "p99": round(percentile(values, 99), 3),
        "max": round(max(values, default=0.0), 3),
    }
