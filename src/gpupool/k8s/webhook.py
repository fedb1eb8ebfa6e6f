"""The mutating admission webhook (AdmissionReview v1): GPU pods made safe and schedulable.

For a pod that asks for gpupool GPUs it
- refuses what would let it escape or confuse the pool: privileged containers, host PID,
  device host paths, `envFrom` (it could set any variable), contradictory requests;
- strips variables a tenant could use to get around its limits (CUDA_MPS_*,
  CUDA_VISIBLE_DEVICES, NVIDIA_*, LD_PRELOAD, LD_LIBRARY_PATH, and the GPUPOOL_* variables
  gpupool itself sets: claim, lease, devices);
- direct access: gives the pod a fresh claim id (label + GPUPOOL_CLAIM), which the
  scheduler extender's bind turns into the pod's lease, and the gpupool scheduler's name;
- remote access: takes our resources off (the pod may run on any node) and runs the
  container's command under `gpupool run --remote` with the pod's request.
Every other pod loses the same variables: NVIDIA_VISIBLE_DEVICES=all, under the NVIDIA
runtime, would otherwise expose every GPU of its node outside the pool. Variables a pod
takes from a ConfigMap or Secret (`envFrom`) cannot be read here, so containers with
`envFrom`, and every ephemeral container (`kubectl debug`: no device plugin ever gives one
a GPU), get explicit entries that say "no GPU": Kubernetes lets `env` win over `envFrom`.
"""

from __future__ import annotations

import base64
import copy
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpupool.k8s.pods import (
    OUR_RESOURCES,
    GpuAsk,
    Pod,
    PodRefused,
    asks_for_gpus,
    asks_for_resources,
    claim_of,
    containers,
    gpu_ask,
)
from gpupool.k8s.resources import ACCESS_ANNOTATION, CLAIM_ENV, CLAIM_LABEL

ESCAPE_VARIABLES = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
        # What gpupool itself gives a container (a forged claim or lease must not pass).
        "GPUPOOL_CLAIM",
        "GPUPOOL_ALLOCATED_CLAIM",
        "GPUPOOL_LEASE",
        "GPUPOOL_LEASE_ID",
        "GPUPOOL_DEVICE_IDS",
        "GPUPOOL_SIMULATED",
        "GPUPOOL_WORKERS",
    }
)
ESCAPE_PREFIXES = ("CUDA_MPS_", "NVIDIA_")
"""Stripped from every container of every pod the webhook sees. GPUPOOL_URL and
GPUPOOL_TOKEN stay: a pod may use the pool's API with its own tenant's token."""
DANGEROUS_CAPABILITIES = frozenset({"SYS_ADMIN", "ALL", "CAP_SYS_ADMIN"})
NO_GPU_ENV: tuple[tuple[str, str], ...] = (
    # The NVIDIA container runtime's "not a GPU container" (runc's behaviour).
    ("NVIDIA_VISIBLE_DEVICES", "void"),
    ("CUDA_VISIBLE_DEVICES", ""),
    # Every variable an MPS client reads (CUDA's MPS documentation, appendix of variables).
    ("CUDA_MPS_PIPE_DIRECTORY", ""),
    ("CUDA_MPS_LOG_DIRECTORY", ""),
    ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", ""),
    ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ""),
    ("CUDA_MPS_ENABLE_PER_CTX_DEVICE_MULTIPROCESSOR_PARTITIONING", ""),
    ("CUDA_MPS_CLIENT_PRIORITY", ""),
    ("CUDA_MPS_PROTOCOL_VERSION", ""),
)
"""Appended to the env of containers that get no GPU from gpupool and may carry variables
the webhook cannot see (envFrom, ephemeral containers): an `env` entry wins over `envFrom`."""
OTHER_GPU_VENDORS = ("nvidia.com/",)
"""A container asking for such a resource gets its GPUs from that vendor's device plugin,
whose Allocate sets NVIDIA_VISIBLE_DEVICES: an explicit "void" would take them away."""
EPHEMERAL = "ephemeralcontainers"
REMOTE_WRAPPER = ["gpupool", "run", "--remote"]
"""How a remote-access pod's command starts once the webhook has changed it."""


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    scheduler_name: str | None = "gpupool-scheduler"
    """Set on direct GPU pods, so the scheduler with gpupool's extender places them."""
    controller_url: str = "http://gpupool-controller:8900"
    """What remote-access pods use as GPUPOOL_URL."""
    token_secret: tuple[str, str] | None = None
    """(Secret name, key) whose value remote-access pods get as GPUPOOL_TOKEN."""
    runtime_class: str | None = None
    """Set on direct GPU pods: the RuntimeClass whose handler gives containers the GPUs the
    device plugin names (NVIDIA's, where it is not the nodes' default runtime)."""
    new_claim: Callable[[], str] = field(default=lambda: "c-" + uuid.uuid4().hex[:20])


def review(body: dict[str, Any], settings: WebhookSettings) -> dict[str, Any]:
    """Answer one AdmissionReview (v1) with an AdmissionReview carrying the response."""
    request = body.get("request") or {}
    uid = request.get("uid", "")
    try:
        patch = admit(request, settings)
    except PodRefused as exc:
        response: dict[str, Any] = {
            "uid": uid,
            "allowed": False,
            "status": {"code": 403, "reason": "Forbidden", "message": f"gpupool: {exc}"},
        }
    else:
        response = {"uid": uid, "allowed": True}
        if patch:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def admit(request: dict[str, Any], settings: WebhookSettings) -> list[dict[str, Any]]:
    """The JSONPatch for one admission request (empty: unchanged); PodRefused to deny."""
    kind = (request.get("kind") or {}).get("kind")
    if kind == "Pod" and request.get("subResource") == EPHEMERAL:
        return _admit_ephemeral(request)
    if kind != "Pod" or request.get("subResource"):
        return []
    pod: Pod = request.get("object") or {}
    operation = request.get("operation")
    if operation == "UPDATE":
        old = request.get("oldObject") or {}
        if claim_of(old) != claim_of(pod):
            raise PodRefused(f"the {CLAIM_LABEL} label is set by gpupool and cannot change")
        return []
    if operation != "CREATE":
        return []
    new = copy.deepcopy(pod)
    _strip_escapes(new)
    if asks_for_gpus(pod) and not _already_remote(pod):
        ask = gpu_ask(pod)
        _refuse_unsafe(pod)
        if ask.access == "remote":
            _make_remote(new, ask, settings)
        else:
            _make_direct(new, ask, settings)
    else:
        for container in _all_containers(new):
            if container.get("envFrom"):
                _say_no_gpu(container)
    return _patch(pod, new)


def _admit_ephemeral(request: dict[str, Any]) -> list[dict[str, Any]]:
    """Ephemeral containers being added (the pods/ephemeralcontainers subresource).

    They share the pod's namespaces but never get a device plugin's GPUs: in a GPU pod
    they may not be privileged nor read variables from elsewhere, and in any pod they
    get no GPU. Only the new ones are changed: the API server refuses changes to those
    already there.
    """
    if request.get("operation") != "UPDATE":
        return []
    pod: Pod = request.get("object") or {}
    old_spec = (request.get("oldObject") or {}).get("spec") or {}
    existing = {c.get("name") for c in old_spec.get("ephemeralContainers") or []}
    new = copy.deepcopy(pod)
    added = [
        c
        for c in (new.get("spec") or {}).get("ephemeralContainers") or []
        if c.get("name") not in existing
    ]
    gpu_pod = asks_for_gpus(pod)
    for container in added:
        if gpu_pod:
            _refuse_unsafe_container(container, "ephemeral container")
        _strip_container(container)
        _say_no_gpu(container)
    return _patch(pod, new)


# ---- checks ----------------------------------------------------------------------------------


def _all_containers(pod: Pod) -> list[dict[str, Any]]:
    spec = pod.get("spec") or {}
    return [
        *(spec.get("containers") or []),
        *(spec.get("initContainers") or []),
        *(spec.get("ephemeralContainers") or []),
    ]


def _refuse_unsafe(pod: Pod) -> None:
    spec = pod.get("spec") or {}
    for container in _all_containers(pod):
        _refuse_unsafe_container(container, "container")
    if spec.get("hostPID"):
        raise PodRefused("GPU pods may not use hostPID (they could reach other tenants' GPUs)")
    for volume in spec.get("volumes") or []:
        path = str((volume.get("hostPath") or {}).get("path", ""))
        if path == "/dev" or path.startswith(("/dev/", "/var/lib/kubelet", "/run/nvidia")):
            raise PodRefused(f"volume {volume.get('name', '?')} mounts host path {path}")
    if spec.get("nodeName"):
        raise PodRefused(
            "GPU pods are placed by the gpupool scheduler: remove spec.nodeName "
            "(use a nodeSelector to restrict the nodes)"
        )


def _refuse_unsafe_container(container: dict[str, Any], what: str) -> None:
    name = container.get("name", "?")
    security = container.get("securityContext") or {}
    if security.get("privileged"):
        raise PodRefused(
            f"{what} {name} is privileged: a privileged container sees every GPU of "
            "its node, so GPU pods may not be privileged"
        )
    added = set((security.get("capabilities") or {}).get("add") or [])
    if added & DANGEROUS_CAPABILITIES:
        raise PodRefused(f"{what} {name} adds {sorted(added & DANGEROUS_CAPABILITIES)}")
    if container.get("envFrom"):
        raise PodRefused(
            f"{what} {name} uses envFrom, which could set CUDA_MPS_*, LD_PRELOAD and "
            "the like; list the variables in env instead"
        )


def _strip_escapes(pod: Pod) -> None:
    """Remove the variables of ESCAPE_* from every container."""
    for container in _all_containers(pod):
        _strip_container(container)


def _strip_container(container: dict[str, Any]) -> None:
    env = container.get("env")
    if env:
        kept = [e for e in env if not _escapes(str(e.get("name", "")))]
        if len(kept) != len(env):
            container["env"] = kept


def _escapes(name: str) -> bool:
    return name in ESCAPE_VARIABLES or name.startswith(ESCAPE_PREFIXES)


def _say_no_gpu(container: dict[str, Any]) -> None:
    """Append NO_GPU_ENV (after the escapes were stripped), unless another vendor's device
    plugin gives this container its GPUs. Idempotent: a second call changes nothing."""
    limits = (container.get("resources") or {}).get("limits") or {}
    if any(str(k).startswith(OTHER_GPU_VENDORS) for k in limits):
        return
    names = {n for n, _ in NO_GPU_ENV}
    env = [e for e in container.get("env") or [] if e.get("name") not in names]
    container["env"] = env + [{"name": n, "value": v} for n, v in NO_GPU_ENV]


# ---- mutations -------------------------------------------------------------------------------


def _make_direct(pod: Pod, ask: GpuAsk, settings: WebhookSettings) -> None:
    claim = settings.new_claim()
    meta = pod["metadata"] = pod.get("metadata") or {}
    labels = meta["labels"] = meta.get("labels") or {}
    labels[CLAIM_LABEL] = claim
    container = pod["spec"]["containers"][ask.container]
    env = container["env"] = container.get("env") or []
    env.append({"name": CLAIM_ENV, "value": claim})
    if settings.scheduler_name:
        pod["spec"]["schedulerName"] = settings.scheduler_name
    if settings.runtime_class:
        own = pod["spec"].get("runtimeClassName")
        if own and own != settings.runtime_class:
            raise PodRefused(
                f"GPU pods run with runtime class {settings.runtime_class} (the one that "
                f"gives containers their GPUs), not {own}: remove spec.runtimeClassName"
            )
        pod["spec"]["runtimeClassName"] = settings.runtime_class


def _already_remote(pod: Pod) -> bool:
    """Whether this is a remote-access pod the webhook has already changed.

    With `reinvocationPolicy: IfNeeded` the API server calls the webhook again, within the
    same CREATE, when a later webhook (a sidecar injector) changed the pod: it then has the
    remote annotation, none of our resources and its command under `gpupool run --remote`.
    Admitting it again unchanged (its variables stripped once more) is what a first call
    would end with; reading it as a new GPU request would refuse it. A tenant who writes
    such a pod by hand gets nothing more than a pod that runs `gpupool run --remote` itself.
    """
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if annotations.get(ACCESS_ANNOTATION) != "remote" or asks_for_resources(pod):
        return False
    return any(
        list(c.get("command") or [])[: len(REMOTE_WRAPPER)] == REMOTE_WRAPPER
        for c in containers(pod)
    )


def _make_remote(pod: Pod, ask: GpuAsk, settings: WebhookSettings) -> None:
    container = pod["spec"]["containers"][ask.container]
    command = list(container.get("command") or [])
    if not command:
        raise PodRefused(
            f"container {container.get('name', '?')}: a remote-access pod runs its command "
            "under `gpupool run --remote`, so give the command (spec.containers[].command)"
        )
    for section in ("limits", "requests"):
        values = (container.get("resources") or {}).get(section)
        if values:
            for key in OUR_RESOURCES:
                values.pop(key, None)
    wrapper = [*REMOTE_WRAPPER, "--gpus", str(ask.gpus)]
    wrapper += ["--compute", f"{ask.compute_pct}%", "--tenant", ask.tenant]
    wrapper += ["--priority", str(ask.priority)]
    if ask.memory_mib is not None:
        wrapper += ["--memory", f"{ask.memory_mib}MiB"]
    container["command"] = [*wrapper, "--", *command, *(container.get("args") or [])]
    container.pop("args", None)
    env = container["env"] = container.get("env") or []
    own = {str(e.get("name")) for e in env}
    if "GPUPOOL_URL" not in own:
        env.append({"name": "GPUPOOL_URL", "value": settings.controller_url})
    if settings.token_secret is not None and "GPUPOOL_TOKEN" not in own:
        name, key = settings.token_secret
        env.append(
            {"name": "GPUPOOL_TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}
        )


def _patch(old: Pod, new: Pod) -> list[dict[str, Any]]:
    """JSONPatch ops that turn `old` into `new`, one per changed part ("add" replaces)."""
    ops: list[dict[str, Any]] = []
    for section, keys in (
        ("metadata", ("labels",)),
        (
            "spec",
            (
                "containers",
                "initContainers",
                "ephemeralContainers",
                "schedulerName",
                "runtimeClassName",
            ),
        ),
    ):
        for key in keys:
            before = (old.get(section) or {}).get(key)
            after = (new.get(section) or {}).get(key)
            if before != after:
                ops.append({"op": "add", "path": f"/{section}/{key}", "value": after})
    return ops
