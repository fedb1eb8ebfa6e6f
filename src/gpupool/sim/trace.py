"""Trace files: the node and pod CSVs of public production GPU-cluster traces.

nodes: `sn,cpu_milli,memory_mib,gpu,model`
pods:  `name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,
        deletion_time,scheduled_time` (columns after `gpu_milli` may be absent)
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpupool.core.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class PodSpec:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    """Thousandths of one GPU for a one-GPU pod; 1000 for whole GPUs."""
    gpu_spec: tuple[str, ...] = ()
    qos: str = ""
    phase: str = ""
    creation_time: float | None = None
    deletion_time: float | None = None
    scheduled_time: float | None = None

    def gpu_request_milli(self) -> int:
        """Thousandths of a GPU the pod asks for in all."""
        if self.num_gpu == 0:
            return 0
        return self.gpu_milli if self.num_gpu == 1 else 1000 * self.num_gpu


def _int(row: dict[str, str], key: str, where: str, default: int | None = None) -> int:
    raw = (row.get(key) or "").strip()
    if not raw:
        if default is not None:
            return default
        raise InvalidRequest(f"{where}: column {key!r} is empty")
    try:
        return int(float(raw))
    except ValueError:
        raise InvalidRequest(f"{where}: {key}={raw!r} is not a number") from None


def _time(row: dict[str, str], key: str) -> float | None:
    raw = (row.get(key) or "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        return None


def _rows(path: Path, required: Iterable[str]) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in reader.fieldnames or []]
            missing = [c for c in required if c not in header]
            if missing:
                raise InvalidRequest(f"{path}: missing column(s) {', '.join(missing)}")
            return [{(k or "").strip(): v for k, v in row.items()} for row in reader]
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path}: {exc.strerror or exc}") from None


def read_nodes(path: Path) -> list[NodeSpec]:
    out = []
    for i, row in enumerate(_rows(path, ("sn", "cpu_milli", "memory_mib", "gpu")), start=2):
        where = f"{path}:{i}"
        out.append(
            NodeSpec(
                name=row["sn"].strip(),
                cpu_milli=_int(row, "cpu_milli", where),
                memory_mib=_int(row, "memory_mib", where),
                gpus=_int(row, "gpu", where, 0),
                model=(row.get("model") or "").strip() or "GPU",
            )
        )
    if not out:
        raise InvalidRequest(f"{path}: no nodes")
    return out


def read_pods(path: Path) -> list[PodSpec]:
    required = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
    out = []
    for i, row in enumerate(_rows(path, required), start=2):
        where = f"{path}:{i}"
        num_gpu = _int(row, "num_gpu", where, 0)
        milli = _int(row, "gpu_milli", where, 0)
        if num_gpu > 1 or (num_gpu == 1 and milli <= 0):
            milli = 1000
        spec = tuple(m.strip() for m in (row.get("gpu_spec") or "").split("|") if m.strip())
        out.append(
            PodSpec(
                name=row["name"].strip(),
                cpu_milli=_int(row, "cpu_milli", where, 0),
                memory_mib=_int(row, "memory_mib", where, 0),
                num_gpu=num_gpu,
                gpu_milli=min(milli, 1000) if num_gpu else 0,
                gpu_spec=spec,
                qos=(row.get("qos") or "").strip(),
                phase=(row.get("pod_phase") or "").strip(),
                creation_time=_time(row, "creation_time"),
                deletion_time=_time(row, "deletion_time"),
                scheduled_time=_time(row, "scheduled_time"),
            )
        )
    return out


NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = (
    "name",
    "cpu_milli",
    "memory_mib",
    "num_gpu",
    "gpu_milli",
    "gpu_spec",
    "qos",
    "pod_phase",
    "creation_time",
    "deletion_time",
    "scheduled_time",
)


def write_nodes(path: Path, nodes: Iterable[NodeSpec]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(NODE_COLUMNS)
        for n in nodes:
            w.writerow([n.name, n.cpu_milli, n.memory_mib, n.gpus, n.model])


def write_pods(path: Path, pods: Iterable[PodSpec]) -> None:
    def t(v: float | None) -> str:
        return "" if v is None else f"{v:g}"

    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(POD_COLUMNS)
        for p in pods:
            w.writerow(
                [
                    p.name,
                    p.cpu_milli,
                    p.memory_mib,
                    p.num_gpu,
                    p.gpu_milli,
                    "|".join(p.gpu_spec),
                    p.qos,
                    p.phase,
                    t(p.creation_time),
                    t(p.deletion_time),
                    t(p.scheduled_time),
                ]
            )
