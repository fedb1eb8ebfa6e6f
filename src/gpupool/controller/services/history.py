"""The pool's recent past, kept in memory at a bounded size: samples in rings of fixed length,
each coarser ring holding averages of the finer one (5 s for an hour, 1 min for a day, ...)."""

from __future__ import annotations

import json
import logging
import math
import os
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("gpupool.controller")

NAN = math.nan


@dataclass(frozen=True, slots=True)
class TierSpec:
    step_s: int
    points: int
    entities: bool
    """Whether series of single GPUs and nodes are kept at this step (pool series always are)."""

    @property
    def span_s(self) -> int:
        return self.step_s * self.points


TIERS = (
    TierSpec(step_s=5, points=720, entities=True),  # 1 hour
    TierSpec(step_s=60, points=1440, entities=True),  # 24 hours
    TierSpec(step_s=600, points=1008, entities=False),  # 7 days
)

PEAK_SUFFIXES = ("queue_length", "queue_wait_s")
"""Series where a coarse point keeps the highest sample, not the mean: a queue that was long
for a minute must still show when the minute is averaged away."""


def is_pool_key(key: str) -> bool:
    return key.startswith("pool.")


class Ring:
    """A fixed number of points, each a time and one value per named series.

    Values are 32-bit floats (NaN: no sample), so a series of 1,440 points costs under 6 KiB.
    """

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.t = array("d", [NAN]) * spec.points
        self.values: dict[str, array[float]] = {}
        self.last_seen: dict[str, float] = {}
        self.head = 0
        self.count = 0

    def append(self, t: float, values: Mapping[str, float]) -> None:
        i = self.head
        self.t[i] = t
        for key, value in values.items():
            column = self.values.get(key)
            if column is None:
                column = self.values[key] = array("f", [NAN]) * self.spec.points
            column[i] = value
            self.last_seen[key] = t
        for key, column in self.values.items():
            if key not in values:
                column[i] = NAN
        self.head = (i + 1) % self.spec.points
        self.count = min(self.count + 1, self.spec.points)
        self._forget_gone(t)

    def _forget_gone(self, now: float) -> None:
        # A GPU removed from the pool leaves only NaNs after one span: drop its column.
        span = self.spec.span_s
        for key in [k for k, seen in self.last_seen.items() if now - seen > span]:
            self.values.pop(key, None)
            self.last_seen.pop(key, None)

    def indices(self) -> Iterable[int]:
        """Positions from oldest to newest."""
        start = (self.head - self.count) % self.spec.points
        for k in range(self.count):
            yield (start + k) % self.spec.points

    def series(self, key: str, since: float) -> tuple[list[float], list[float | None]]:
        column = self.values.get(key)
        times: list[float] = []
        values: list[float | None] = []
        for i in self.indices():
            t = self.t[i]
            if t < since:
                continue
            times.append(t)
            v = column[i] if column is not None else NAN
            values.append(None if math.isnan(v) else round(v, 4))
        return times, values


class Bucket:
    """Samples of one coarse step being gathered, to be written as one point."""

    def __init__(self) -> None:
        self.start: int | None = None
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.peaks: dict[str, float] = {}

    def add(self, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            if math.isnan(value):
                continue
            self.sums[key] = self.sums.get(key, 0.0) + value
            self.counts[key] = self.counts.get(key, 0) + 1
            if value > self.peaks.get(key, -math.inf):
                self.peaks[key] = value

    def point(self) -> dict[str, float]:
        out = {}
        for key, total in self.sums.items():
            if key.endswith(PEAK_SUFFIXES):
                out[key] = self.peaks[key]
            else:
                out[key] = total / self.counts[key]
        return out


class History:
    """Rings of every tier, fed with one sample per tick; asks nothing of the database."""

    def __init__(self, tiers: tuple[TierSpec, ...] = TIERS) -> None:
        self.tiers = tiers
        self.rings = [Ring(spec) for spec in tiers]
        self.buckets = [Bucket() for _ in tiers]
        self.latest: dict[str, float] = {}
        self.latest_at: float | None = None

    def add(self, t: float, values: Mapping[str, float]) -> None:
        """One sample; each tier writes a point when its step is over."""
        self.latest = dict(values)
        self.latest_at = t
        for n, (spec, ring) in enumerate(zip(self.tiers, self.rings, strict=True)):
            start = int(t // spec.step_s) * spec.step_s
            bucket = self.buckets[n]
            if bucket.start is None:
                bucket.start = start
            elif start != bucket.start:
                point = bucket.point()
                if point:
                    ring.append(bucket.start + spec.step_s / 2, point)
                bucket = self.buckets[n] = Bucket()
                bucket.start = start
            kept = values if spec.entities else {k: v for k, v in values.items() if is_pool_key(k)}
            bucket.add(kept)

    def keys(self) -> list[str]:
        return sorted(self.rings[0].values) if self.rings else []

    def query(
        self, keys: Iterable[str], range_s: float, now: float, max_points: int = 400
    ) -> dict[str, Any]:
        """The finest tier that covers `range_s`, thinned to at most `max_points` points."""
        keys = list(keys)
        pool_only = all(is_pool_key(k) for k in keys)
        usable = [
            (spec, ring)
            for spec, ring in zip(self.tiers, self.rings, strict=True)
            if spec.entities or pool_only
        ]
        spec, ring = next(
            ((s, r) for s, r in usable if s.span_s >= range_s),
            usable[-1] if usable else (self.tiers[0], self.rings[0]),
        )
        since = now - range_s
        out_t: list[float] = []
        out: dict[str, list[float | None]] = {}
        for key in keys:
            times, values = ring.series(key, since)
            out_t = times
            out[key] = values
        # The step being gathered is shown too, so charts move with every sample.
        partial = self.buckets[self.rings.index(ring)].point()
        if partial and self.latest_at is not None and (not out_t or self.latest_at > out_t[-1]):
            out_t = [*out_t, self.latest_at]
            for key in keys:
                value = partial.get(key)
                out[key] = [*out[key], None if value is None else round(value, 4)]
        stride = max(1, math.ceil(len(out_t) / max_points))
        if stride > 1:
            out_t, out = _thin(out_t, out, stride)
        return {"step_s": spec.step_s * stride, "t": out_t, "series": out}

    # ---- persistence: only the pool's coarse tiers, so a restart keeps the day's charts ----

    def dump(self) -> dict[str, Any]:
        tiers = []
        for spec, ring in zip(self.tiers, self.rings, strict=True):
            if spec.step_s < 60:
                continue
            idx = list(ring.indices())
            tiers.append(
                {
                    "step_s": spec.step_s,
                    "t": [ring.t[i] for i in idx],
                    "series": {
                        key: [None if math.isnan(col[i]) else col[i] for i in idx]
                        for key, col in ring.values.items()
                        if is_pool_key(key)
                    },
                }
            )
        return {"version": 1, "tiers": tiers}

    def restore(self, data: Mapping[str, Any]) -> None:
        if data.get("version") != 1:
            return
        by_step = {spec.step_s: ring for spec, ring in zip(self.tiers, self.rings, strict=True)}
        for tier in data.get("tiers", []):
            ring = by_step.get(int(tier.get("step_s", 0)))
            if ring is None:
                continue
            series: dict[str, list[float | None]] = tier.get("series", {})
            for k, t in enumerate(tier.get("t", [])):
                point: dict[str, float] = {}
                for key, vals in series.items():
                    value = vals[k] if k < len(vals) else None
                    if value is not None:
                        point[key] = float(value)
                ring.append(float(t), point)


def _thin(
    times: list[float], series: dict[str, list[float | None]], stride: int
) -> tuple[list[float], dict[str, list[float | None]]]:
    out_t = [times[i] for i in range(0, len(times), stride)]
    out: dict[str, list[float | None]] = {}
    for key, values in series.items():
        thinned: list[float | None] = []
        for i in range(0, len(values), stride):
            chunk = [v for v in values[i : i + stride] if v is not None]
            if not chunk:
                thinned.append(None)
            elif key.endswith(PEAK_SUFFIXES):
                thinned.append(max(chunk))
            else:
                thinned.append(round(sum(chunk) / len(chunk), 4))
        out[key] = thinned
    return out_t, out


def save(history: History, path: Path) -> None:
    """Write atomically: a crash mid-write leaves the previous file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(history.dump(), separators=(",", ":")))
    os.replace(tmp, path)


def load(history: History, path: Path) -> None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:
        log.warning("history file %s unreadable (%s); starting empty", path, exc)
        return
    history.restore(data)
