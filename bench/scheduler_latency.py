"""Placement decision latency with 10,000 GPUs on 1,000 servers and 1,000 queued requests.

A decision is what the controller runs for one event: a request arrives (enqueue, then
serve the queue) or a lease ends (release, then serve the queue). The pool is full, so
every decision walks a queue of about 1,000 waiting requests. Wall-clock percentiles include
the time the OS gave the CPU to other processes; `cpu_*` counts this thread's CPU only.

    .venv/bin/python bench/scheduler_latency.py  → bench/results/scheduler_latency.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from gpupool.core import FAIR, Gpu, GpuMode, LeaseRequest, Pool, Quota

RESULTS = Path(__file__).parent / "results" / "scheduler_latency.json"
TENANTS = {f"team-{i}": Quota(weight=1.0 + (i % 3)) for i in range(10)}


def random_request(rng: random.Random) -> LeaseRequest:
    tenant = rng.choice(list(TENANTS))
    roll = rng.random()
    if roll < 0.30:
        return LeaseRequest(tenant=tenant, compute_pct=25)
    if roll < 0.50:
        return LeaseRequest(tenant=tenant, compute_pct=50)
    if roll < 0.62:
        return LeaseRequest(tenant=tenant, compute_pct=rng.choice([10, 20, 30, 40]))
    if roll < 0.80:
        return LeaseRequest(tenant=tenant, compute_pct=100)
    if roll < 0.90:
        return LeaseRequest(tenant=tenant, gpus=2, compute_pct=100)
    if roll < 0.95:
        return LeaseRequest(tenant=tenant, gpus=8, compute_pct=100, span_nodes=False)
    return LeaseRequest(tenant=tenant, physical=True, gpus=rng.choice([1, 2]))


def build(nodes: int, gpus_per_node: int, seed: int) -> Pool:
    pool = Pool(queue_policy=FAIR)
    pool.quotas.update(TENANTS)
    for n in range(nodes):
        node = f"node-{n:04d}"
        pool.set_node_up(node, True)
        for i in range(gpus_per_node):
            mode = GpuMode.PHYSICAL if n % 10 == 0 else GpuMode.VIRTUAL
            pool.upsert_gpu(Gpu(f"{node}-g{i}", node, "NVIDIA H100 80GB", 81920, i, mode))
    return pool


def run(
    nodes: int, gpus_per_node: int, queued: int, decisions: int, seed: int
) -> dict[str, object]:
    rng = random.Random(seed)
    pool = build(nodes, gpus_per_node, seed)
    next_id = 0
    misses = 0
    while misses < 200:
        next_id += 1
        if isinstance(pool.try_grant(f"l{next_id}", random_request(rng)), str):
            misses += 1
    clock = 0.0
    while len(pool.queue) < queued:
        next_id += 1
        pool.enqueue(f"l{next_id}", random_request(rng), now=clock)
    pool.serve_queue(now=clock)
    times: list[float] = []
    arrivals: list[float] = []
    releases: list[float] = []
    cpu_times: list[float] = []
    gc.collect()
    gc.freeze()  # the pool's long-lived objects: as a long-running controller would
    for _ in range(decisions):
        clock += 0.5
        if len(pool.queue) < queued or not pool.holdings:
            next_id += 1
            request = random_request(rng)
            start, cpu = time.perf_counter(), time.thread_time()
            pool.enqueue(f"l{next_id}", request, now=clock)
            pool.serve_queue(now=clock)
            took = time.perf_counter() - start
            cpu_times.append(time.thread_time() - cpu)
            arrivals.append(took)
        else:
            victim = rng.choice(list(pool.holdings))
            start, cpu = time.perf_counter(), time.thread_time()
            pool.release(victim)
            pool.serve_queue(now=clock)
            took = time.perf_counter() - start
            cpu_times.append(time.thread_time() - cpu)
            releases.append(took)
        times.append(took)
    gpus = nodes * gpus_per_node

    def pct(values: list[float], q: float) -> float:
        return round(statistics.quantiles(values, n=1000)[int(q * 10) - 1] * 1000, 3)

    return {
        "gpus": gpus,
        "nodes": nodes,
        "queued": len(pool.queue),
        "p50_ms": pct(times, 50),
        "p99_ms": pct(times, 99),
        "decisions": decisions,
        "arrival_p50_ms": pct(arrivals, 50),
        "arrival_p99_ms": pct(arrivals, 99),
        "release_p50_ms": pct(releases, 50),
        "release_p99_ms": pct(releases, 99),
        "max_ms": round(max(times) * 1000, 3),
        "cpu_p50_ms": pct(cpu_times, 50),
        "cpu_p99_ms": pct(cpu_times, 99),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "policy": pool.policy.name,
        "queue_policy": "priority, weighted dominant share, FIFO; reservations with backfill",
        "held_leases": len(pool.holdings),
        "machine": f"{platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus-per-node", type=int, default=10)
    parser.add_argument("--queued", type=int, default=1000)
    parser.add_argument("--decisions", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = run(args.nodes, args.gpus_per_node, args.queued, args.decisions, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
