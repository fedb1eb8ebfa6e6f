"""A team's week as the pool sees it, and how many pooled GPUs it needs.

N engineers each day: notebook sessions that hold a slice while open, short debug runs,
and now and then a training run on whole GPUs. Interactive work asks at priority 5 and
may preempt training (priority 0, checkpointed, 30 s grace); every engineer is a tenant
of equal weight. The report answers: the fewest GPUs that keep the 95th percentile wait
for an interactive slice under 60 s, against dedicating 1.5 GPUs to each engineer.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from gpupool.core import FAIR, Gpu, LeaseRequest, Pool, Quota
from gpupool.sim.engine import Job, Outcome, percentile, replay

HOUR = 3600.0
GPU_MEMORY_MIB = 81920
GPUS_PER_SERVER = 8
INTERACTIVE = 5
TARGET_WAIT_S = 60.0
DEDICATED_PER_ENGINEER = 1.5
PREEMPT_GRACE_S = 30.0


@dataclass(frozen=True, slots=True)
class TeamShape:
    notebooks_per_day: float = 2.0
    notebook_median_s: float = 1.0 * HOUR
    debug_runs_per_day: float = 6.0
    debug_median_s: float = 8 * 60.0
    training_chance_per_day: float = 0.12
    training_median_s: float = 3.0 * HOUR
    burst_median_s: float = 5 * 60.0
    """A notebook's GPU work comes in bursts (a cell that trains or evaluates)..."""
    think_median_s: float = 12 * 60.0
    """...between which its user reads, edits and thinks: the GPU does nothing."""


def _lognormal(rng: random.Random, median: float, sigma: float, cap: float) -> float:
    return min(cap, median * math.exp(rng.gauss(0.0, sigma)))


def workload(
    engineers: int,
    days: int,
    seed: int,
    shape: TeamShape | None = None,
    idle_release_s: float | None = None,
) -> list[Job]:
    """The jobs of `engineers` people over `days` working days, deterministic in `seed`.

    With `idle_release_s` (elastic remote slices), an open notebook holds its slice only
    during its bursts of GPU work and for idle_release_s after each; in between its tensors
    sit in host memory and the slice serves others. Each burst is then a request of its own,
    and its wait is the pause its user sees at the first GPU op after thinking."""
    shape = shape or TeamShape()
    rng = random.Random(seed)
    bursts = random.Random(seed * 7919 + 1)  # its own stream: the other jobs stay the same
    jobs: list[Job] = []
    for person in range(engineers):
        tenant = f"eng-{person:03d}"
        for day in range(days):
            start = day * 24 * HOUR + 9 * HOUR + rng.gauss(0.0, 0.75 * HOUR)
            length = 8.5 * HOUR
            for _ in range(_poisson(rng, shape.notebooks_per_day)):
                at = start + rng.random() * length
                compute = 25 if rng.random() < 0.7 else 50
                request = LeaseRequest(tenant=tenant, compute_pct=compute, priority=INTERACTIVE)
                open_s = _lognormal(rng, shape.notebook_median_s, 0.7, 4 * HOUR)
                name = f"{tenant}-d{day}-nb{len(jobs)}"
                if idle_release_s is None:
                    jobs.append(Job(name, request, at, open_s, "notebook"))
                    continue
                for i, (burst_at, held_s) in enumerate(
                    _bursts(bursts, shape, at, open_s, idle_release_s)
                ):
                    jobs.append(Job(f"{name}-b{i}", request, burst_at, held_s, "notebook"))
            for _ in range(_poisson(rng, shape.debug_runs_per_day)):
                at = start + rng.random() * length
                compute = 50 if rng.random() < 0.5 else 100
                jobs.append(
                    Job(
                        f"{tenant}-d{day}-dbg{len(jobs)}",
                        LeaseRequest(tenant=tenant, compute_pct=compute, priority=INTERACTIVE),
                        at,
                        _lognormal(rng, shape.debug_median_s, 0.8, 1 * HOUR),
                        "debug",
                    )
                )
            if rng.random() < shape.training_chance_per_day:
                at = start + rng.random() * length
                gpus = rng.choices((1, 2, 4), weights=(0.5, 0.35, 0.15))[0]
                jobs.append(
                    Job(
                        f"{tenant}-d{day}-train{len(jobs)}",
                        LeaseRequest(tenant=tenant, gpus=gpus, compute_pct=100, priority=0),
                        at,
                        _lognormal(rng, shape.training_median_s, 0.8, 16 * HOUR),
                        "training",
                    )
                )
    jobs.sort(key=lambda j: (j.arrival_s, j.id))
    return jobs


def _bursts(
    rng: random.Random, shape: TeamShape, at: float, open_s: float, idle_release_s: float
) -> list[tuple[float, float]]:
    """(start, seconds held) of each burst of an open notebook, the idle timeout included."""
    out: list[tuple[float, float]] = []
    t, end = at, at + open_s
    while t < end:
        burst = _lognormal(rng, shape.burst_median_s, 0.8, 1 * HOUR)
        think = _lognormal(rng, shape.think_median_s, 0.9, 2 * HOUR)
        held = min(burst + min(idle_release_s, think), end - t)
        out.append((t, max(held, 1.0)))
        t += burst + think
    return out


def _poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def pool_of(gpus: int, engineers: int) -> Pool:
    pool = Pool(queue_policy=FAIR)
    for person in range(engineers):
        pool.quotas[f"eng-{person:03d}"] = Quota()
    for i in range(gpus):
        node = f"gpu-server-{i // GPUS_PER_SERVER:02d}"
        pool.set_node_up(node, True)
        pool.upsert_gpu(
            Gpu(
                f"{node}-g{i % GPUS_PER_SERVER}",
                node,
                "NVIDIA H100 80GB",
                GPU_MEMORY_MIB,
                i % GPUS_PER_SERVER,
            )
        )
    return pool


def _waits(jobs: list[Job], outcome: Outcome, kinds: tuple[str, ...]) -> list[float]:
    end = outcome.end_s
    return [outcome.started_s.get(j.id, end) - j.arrival_s for j in jobs if j.kind in kinds]


def trial(jobs: list[Job], gpus: int, engineers: int) -> dict[str, Any]:
    outcome = replay(pool_of(gpus, engineers), jobs, samples=50, preempt_grace_s=PREEMPT_GRACE_S)
    interactive = _waits(jobs, outcome, ("notebook", "debug"))
    training = _waits(jobs, outcome, ("training",))
    busy_s = sum(
        (j.duration_s or 0.0)
        * (j.request.gpus * (1.0 if j.request.compute_pct >= 100 else j.request.compute_pct / 100))
        for j in jobs
    )
    span = outcome.end_s - jobs[0].arrival_s if jobs else 0.0
    return {
        "gpus": gpus,
        "p95_slice_wait_s": round(percentile(interactive, 95), 1),
        "p50_slice_wait_s": round(percentile(interactive, 50), 1),
        "p95_training_wait_s": round(percentile(training, 95), 1),
        "preemptions": outcome.preempted,
        "busy_gpu_hours": round(busy_s / HOUR, 1),
        "span_hours": round(span / HOUR, 1),
    }


def report(
    engineers: int, days: int = 5, seed: int = 0, idle_release_s: float | None = None
) -> dict[str, Any]:
    """Search the fewest GPUs meeting the 60 s p95 target for interactive slices."""
    jobs = workload(engineers, days, seed, idle_release_s=idle_release_s)
    dedicated = math.ceil(DEDICATED_PER_ENGINEER * engineers)
    tried: dict[int, dict[str, Any]] = {}

    def meets(gpus: int) -> bool:
        if gpus not in tried:
            tried[gpus] = trial(jobs, gpus, engineers)
        return float(tried[gpus]["p95_slice_wait_s"]) < TARGET_WAIT_S

    low, high = 1, max(dedicated, 1)
    while not meets(high) and high < 8 * dedicated:
        low, high = high + 1, high * 2
    while low < high:
        mid = (low + high) // 2
        if meets(mid):
            high = mid
        else:
            low = mid + 1
    best = tried[high]
    hours = float(best["span_hours"]) or 1.0
    return {
        "engineers": engineers,
        "days": days,
        "seed": seed,
        "idle_release_s": idle_release_s,
        "target_p95_slice_wait_s": TARGET_WAIT_S,
        "dedicated_gpus": dedicated,
        "pooled_gpus": high,
        "dedicated_per_pooled": round(dedicated / high, 2) if high else None,
        "p95_slice_wait_s": best["p95_slice_wait_s"],
        "p95_training_wait_s": best["p95_training_wait_s"],
        "preemptions": best["preemptions"],
        "jobs": {
            kind: sum(1 for j in jobs if j.kind == kind)
            for kind in ("notebook", "debug", "training")
        },
        "busy_gpu_hours": best["busy_gpu_hours"],
        "pooled_utilisation_pct": round(100 * best["busy_gpu_hours"] / (high * hours), 1),
        "dedicated_utilisation_pct": round(100 * best["busy_gpu_hours"] / (dedicated * hours), 1),
        "tried": [tried[g] for g in sorted(tried)],
    }
