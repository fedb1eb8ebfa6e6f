"""The fill-up protocol: pods arrive one at a time and never leave, until 130 % is asked for.

Every pod of the file once, in an order shuffled by the seed, then pods drawn from the
file with replacement until the arrived GPU request passes 130 % of capacity. A pod that
does not fit fails and is dropped (it still counts as arrived). At every whole percent
of arrived GPU request: allocated GPU % of capacity and the fragmented share of idle GPU.
`keep_order` replays the file exactly as given, once each.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from gpupool.sim.cluster import (
    allocated_milli,
    build_pool,
    capacity_gpus,
    demands_of,
    fragmentation_pct,
    request_of,
)
from gpupool.sim.trace import NodeSpec, PodSpec

TARGET_PCT = 130


def arrival_order(pods: Sequence[PodSpec], capacity_milli: int, seed: int) -> list[PodSpec]:
    rng = random.Random(seed)
    order = list(pods)
    rng.shuffle(order)
    asked = sum(p.gpu_request_milli() for p in order)
    if not any(p.gpu_request_milli() for p in pods):
        return order
    while asked * 100 <= TARGET_PCT * capacity_milli:
        pod = pods[rng.randrange(len(pods))]
        order.append(pod)
        asked += pod.gpu_request_milli()
    return order


def run_fillup(
    nodes: Sequence[NodeSpec],
    pods: Sequence[PodSpec],
    policy: str = "default",
    seed: int = 0,
    keep_order: bool = False,
) -> dict[str, Any]:
    capacity = capacity_gpus(nodes)
    capacity_milli = 1000 * capacity
    pool = build_pool(nodes, policy, seed, workload=demands_of(pods))
    order = list(pods) if keep_order else arrival_order(pods, capacity_milli, seed)
    curve: list[dict[str, float]] = []
    arrived = 0
    allocated = 0
    next_pct = 1
    for i, pod in enumerate(order):
        request = request_of(pod)
        result = pool.try_grant(f"p{i}", request)
        asked = pod.gpu_request_milli()
        arrived += asked
        if not isinstance(result, str):
            allocated += asked
        while capacity_milli and arrived * 100 >= next_pct * capacity_milli:
            curve.append(
                {
                    "arrived_pct": next_pct,
                    "allocated_pct": round(100.0 * allocated / capacity_milli, 3),
                    "frag_pct": round(fragmentation_pct(pool), 3),
                }
            )
            next_pct += 1
    assert allocated == allocated_milli(pool) or not capacity_milli
    return {"policy": policy, "seed": seed, "capacity_gpus": capacity, "curve": curve}
