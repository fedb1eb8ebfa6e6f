"""A discrete-event replay: jobs arrive, queue, run for their duration and leave.

The pool is the controller's own `Pool`: arrivals are enqueued and the queue is served
exactly as the controller serves it, at simulated times.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpupool.core import LeaseRequest, Pool


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


def held_units(pool: Pool) -> float:
    return sum(
        1.0 if s.whole else min(s.compute_pct / 100, 1.0)
        for slices in pool.holdings.values()
        for s in slices
    )


def replay(pool: Pool, jobs: Sequence[Job], samples: int = 100) -> Outcome:
    """Run every job through the pool; jobs still waiting at the end never started."""
    out = Outcome()
    by_id = {j.id: j for j in jobs}
    events: list[tuple[float, int, int, str]] = []  # (time, 0=end first, seq, job)
    for n, job in enumerate(jobs):
        heapq.heappush(events, (job.arrival_s, 1, n, job.id))
    if not events:
        return out
    first = events[0][0]
    horizon = max(
        j.arrival_s + (j.duration_s or 0.0) for j in jobs
    )  # a first guess for sampling; extended below when queues delay jobs
    step = max((horizon - first) / max(samples, 1), 1e-9)
    next_sample = first
    last_t = first
    units = 0.0
    seq = len(jobs)
    while events:
        t, kind, _n, job_id = heapq.heappop(events)
        while next_sample <= t:
            out.samples.append((round(next_sample, 3), round(units, 3), len(pool.queue)))
            next_sample += step
        out.busy_unit_s += units * (t - last_t)
        last_t = t
        if kind == 0:
            pool.release(job_id)
            out.ended_s[job_id] = t
        else:
            pool.enqueue(job_id, by_id[job_id].request, now=t)
        for lease_id, reason in pool.overdue(t):
            pool.release(lease_id)
            out.failed[lease_id] = reason
        for grant in pool.serve_queue(now=t):
            out.started_s[grant.lease_id] = t
            duration = by_id[grant.lease_id].duration_s
            if duration is not None:
                seq += 1
                heapq.heappush(events, (t + duration, 0, seq, grant.lease_id))
        units = held_units(pool)
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
