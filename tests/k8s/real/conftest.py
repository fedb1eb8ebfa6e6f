"""The real control plane (control_plane.py), one for the whole session: it takes a minute
to start, and the tests leave it as they found it (their pods and nodes deleted)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from control_plane import NAMESPACE, CannotRun, ControlPlane, binaries, control_plane

CHART = Path(__file__).resolve().parents[3] / "deploy" / "helm" / "gpupool"
# The control plane's version: the chart renders its API versions (the scheduler's
# configuration v1beta1, PodDisruptionBudget policy/v1beta1) for it.
KUBE_VERSION = "1.20.2"


def render_chart(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart as `helm template` renders it, by Helm's own Go SDK."""
    helm = pytest.importorskip(
        "helm_python", reason="helm-python-sdk (dev extra) renders the chart"
    )
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values or {}, name="gpupool", namespace=NAMESPACE)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


@pytest.fixture(scope="session")
def cluster() -> Iterator[ControlPlane]:
    try:
        binaries()
    except CannotRun as exc:
        pytest.skip(f"no real Kubernetes control plane here: {exc}")
    with control_plane(lambda: render_chart({"kubeVersion": KUBE_VERSION})) as cp:
        yield cp
