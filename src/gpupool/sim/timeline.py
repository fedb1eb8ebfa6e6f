"""The timeline protocol: pods arrive and leave at their trace times; report waits and use.

A pod that waits in the queue still runs for its traced duration once it starts, so its
completion moves later by its wait. Pods with no creation time are left out; pods with
no deletion time never end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpupool.sim.cluster import build_pool, capacity_gpus, demands_of, request_of
from gpupool.sim.engine import Job, replay, summary
from gpupool.sim.trace import NodeSpec, PodSpec


def jobs_of(pods: Sequence[PodSpec]) -> list[Job]:
    jobs = []
    for i, pod in enumerate(pods):
        if pod.creation_time is None:
            continue
        start = pod.scheduled_time if pod.scheduled_time is not None else pod.creation_time
        duration = None
        if pod.deletion_time is not None:
            duration = max(0.0, pod.deletion_time - max(start, pod.creation_time))
        jobs.append(Job(f"p{i}", request_of(pod), pod.creation_time, duration, pod.name))
    jobs.sort(key=lambda j: (j.arrival_s, j.id))
    return jobs


def run_timeline(
    nodes: Sequence[NodeSpec],
    pods: Sequence[PodSpec],
    policy: str = "default",
    seed: int = 0,
    samples: int = 100,
) -> dict[str, Any]:
    capacity = capacity_gpus(nodes)
    pool = build_pool(nodes, policy, seed, workload=demands_of(pods))
    jobs = jobs_of(pods)
    outcome = replay(pool, jobs, samples)
    waits = [outcome.started_s[j.id] - j.arrival_s for j in jobs if j.id in outcome.started_s]
    gpu_waits = [
        outcome.started_s[j.id] - j.arrival_s
        for j in jobs
        if j.id in outcome.started_s and j.request.gpus > 0
    ]
    completions = [outcome.ended_s[j.id] - j.arrival_s for j in jobs if j.id in outcome.ended_s]
    span = (outcome.end_s - jobs[0].arrival_s) if jobs else 0.0
    mean_util = 100.0 * outcome.busy_unit_s / (capacity * span) if capacity and span else 0.0
    return {
        "policy": policy,
        "seed": seed,
        "capacity_gpus": capacity,
        "pods": len(jobs),
        "started": len(outcome.started_s),
        "never_started": len(jobs) - len(outcome.started_s),
        "wait_s": summary(waits),
        "gpu_pod_wait_s": summary(gpu_waits),
        "completion_s": summary(completions),
        "makespan_s": round(span, 3),
        "mean_utilisation_pct": round(mean_util, 3),
        "utilisation": [
            {
                "t_s": t,
                "allocated_pct": round(100.0 * units / capacity, 3) if capacity else 0.0,
                "queued": queued,
            }
            for t, units, queued in outcome.samples
        ],
    }
