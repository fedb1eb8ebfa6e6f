"""Trace generators for development: clusters and pod mixes shaped like public GPU traces.

`openb` imitates the published production trace (mostly 8-GPU servers of several models,
pods that mostly share one GPU, some whole and multi-GPU pods, some CPU-only pods);
`sharing`, `multi` and `constrained` stress one feature each. Deterministic in the seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gpupool.core.errors import InvalidRequest
from gpupool.sim.trace import NodeSpec, PodSpec

MODELS = (("V100M16", 0.30), ("V100M32", 0.20), ("T4", 0.20), ("P100", 0.10), ("A10", 0.20))
SHARE_MILLI = (50, 100, 200, 250, 300, 400, 500, 600, 700, 800)


@dataclass(frozen=True, slots=True)
class Mix:
    """How often each kind of pod comes (fractions of all pods)."""

    cpu_only: float
    sharing: float
    whole: float
    multi: float
    constrained: float


MIXES = {
    "openb": Mix(cpu_only=0.12, sharing=0.45, whole=0.33, multi=0.10, constrained=0.10),
    "sharing": Mix(cpu_only=0.05, sharing=0.80, whole=0.12, multi=0.03, constrained=0.05),
    "multi": Mix(cpu_only=0.05, sharing=0.25, whole=0.30, multi=0.40, constrained=0.05),
    "constrained": Mix(cpu_only=0.10, sharing=0.45, whole=0.30, multi=0.15, constrained=0.60),
}


def _pick(rng: random.Random, weighted: tuple[tuple[str, float], ...]) -> str:
    roll = rng.random() * sum(w for _, w in weighted)
    for value, weight in weighted:
        roll -= weight
        if roll <= 0:
            return value
    return weighted[-1][0]


def cluster(servers: int, seed: int) -> list[NodeSpec]:
    rng = random.Random(seed)
    nodes = []
    for i in range(servers):
        model = _pick(rng, MODELS)
        gpus = rng.choices((8, 4, 2), weights=(0.8, 0.15, 0.05))[0]
        cpu = rng.choice((64_000, 96_000, 96_000, 128_000))
        memory = rng.choice((393_216, 524_288, 786_432))
        nodes.append(NodeSpec(f"node-{i:04d}", cpu, memory, gpus, model))
    return nodes


def pods(count: int, mix_name: str, seed: int, duration_s: float = 0.0) -> list[PodSpec]:
    """`count` pods; with `duration_s` > 0 they get creation and deletion times over it."""
    if mix_name not in MIXES:
        raise InvalidRequest(f"unknown pod mix {mix_name!r} (one of {', '.join(MIXES)})")
    mix = MIXES[mix_name]
    rng = random.Random(seed)
    out = []
    t = 0.0
    rate = count / duration_s if duration_s > 0 else 0.0
    for i in range(count):
        roll = rng.random()
        spec: tuple[str, ...] = ()
        if rng.random() < mix.constrained:
            first = _pick(rng, MODELS)
            spec = (first,) if rng.random() < 0.7 else (first, _pick(rng, MODELS))
            spec = tuple(dict.fromkeys(spec))
        if roll < mix.cpu_only:
            num, milli, cpu = 0, 0, rng.choice((1000, 2000, 4000, 8000, 16_000))
            spec = ()
        elif roll < mix.cpu_only + mix.sharing:
            num, milli = 1, rng.choice(SHARE_MILLI)
            cpu = rng.choice((1000, 2000, 4000, 6000, 8000))
        elif roll < mix.cpu_only + mix.sharing + mix.whole:
            num, milli, cpu = 1, 1000, rng.choice((4000, 8000, 12_000, 16_000))
        else:
            num = rng.choices((2, 4, 8), weights=(0.5, 0.3, 0.2))[0]
            milli, cpu = 1000, num * rng.choice((4000, 8000, 12_000))
        memory = cpu * rng.choice((2, 4, 8))
        created = deleted = None
        if rate > 0:
            t += rng.expovariate(rate)
            created = round(t, 1)
            life = rng.lognormvariate(7.5, 1.2)  # median ~30 min, a long tail of hours
            deleted = round(t + life, 1)
        out.append(
            PodSpec(
                name=f"pod-{i:05d}",
                cpu_milli=cpu,
                memory_mib=memory,
                num_gpu=num,
                gpu_milli=milli,
                gpu_spec=spec,
                qos="LS" if num and milli < 1000 else "BE",
                phase="Running",
                creation_time=created,
                deletion_time=deleted,
                scheduled_time=created,
            )
        )
    return out
