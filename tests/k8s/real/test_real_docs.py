"""docs/kubernetes.md walked through on the real control plane: the commands of its shell
blocks, as the doc writes them, run in one shell inside the cluster's namespace. The few a
test cluster cannot run (an image registry, the helm binary, the controller-manager that
would start the chart's pods) are named below with the reason and with what the harness
does instead; a command in the doc that is neither run nor named fails the test."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from control_plane import NODE, ControlPlane

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DOC = Path(__file__).resolve().parents[3] / "docs" / "kubernetes.md"
NOT_HERE = {
    "docker build": "no image registry or container runtime here; the harness runs the "
    "image's program (gpupool) as host processes of the cluster's namespace",
    "helm install": "no helm binary; Helm's Go SDK renders the chart and the harness does "
    "what `helm install` does with it (ControlPlane.helm_install): the pre-install hooks "
    "applied, the init-secrets Job's command run, the hooks deleted, the rest applied "
    "with `kubectl apply --server-side`",
    "kubectl -n gpupool rollout status": "no controller-manager starts the chart's pods; the "
    "harness runs each pod's process with that pod's arguments, Secrets and service account",
    "kubectl -n gpupool port-forward": "the controller already listens on 127.0.0.1:8900 in "
    "the cluster's namespace",
    "kubectl exec": "the kubelet reports no address on a network of loopback only (it refuses "
    "a loopback node IP), so the API server cannot reach it for exec; the test reads the "
    "container's environment from the fake runtime's record of the container instead",
}
MARK = "### walk-through step"


def shell_commands(markdown: str) -> list[str]:
    """Each command of the doc's ```bash blocks: continuation lines joined, comments gone."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            line = re.sub(r"\s{2,}#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_the_doc_names_every_command_it_does_not_run() -> None:
    commands = shell_commands(DOC.read_text())
    assert len(commands) >= 10
    named = [c for c in commands if c.startswith(tuple(NOT_HERE))]
    assert len(named) == len(NOT_HERE), "a command named here is gone from the doc"


def test_the_install_walk_through_runs_as_written(cluster: ControlPlane) -> None:
    commands = [c for c in shell_commands(DOC.read_text()) if not c.startswith(tuple(NOT_HERE))]
    script = ["set -euo pipefail", f"cd {shlex.quote(str(DOC.parents[1]))}"]
    for i, command in enumerate(commands):
        script += [f"echo '{MARK} {i}'", command]
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig("admin")),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    env.pop("GPUPOOL_TOKEN", None)
    env.pop("GPUPOOL_URL", None)
    try:
        done = subprocess.run(
            cluster.nsenter("bash", "-c", "\n".join(script)),
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{cluster.logs()}"
    finally:
        cluster.kubectl("delete", "pod", "notebook", "--ignore-not-found", "--wait=true")
    steps = dict(zip(commands, re.split(rf"{MARK} \d+\n", done.stdout)[1:], strict=True))

    def out(prefix: str) -> str:
        return next(v for k, v in steps.items() if k.startswith(prefix))

    # 3. the node offers gpupool's resources; the pool sees the same GPUs.
    nodes = out("kubectl get nodes").split()
    assert nodes[nodes.index(NODE) + 1] == "8"  # 2 simulated GPUs, 4 slots each
    assert "H100" in out("gpupool gpus")
    # 4. the notebook's claim on the node, its lease, and what its container got.
    claim, node = out("kubectl get pod notebook").split()
    assert claim.startswith("c-") and node == NODE
    assert f"k8s-claim:{claim}" in out("gpupool lease ls")
    record = json.loads(next(cluster.containers_dir.glob("default_notebook_*.json")).read_text())
    assert record["env"]["GPUPOOL_ALLOCATED_CLAIM"] == claim == record["env"]["GPUPOOL_CLAIM"]
    assert record["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
