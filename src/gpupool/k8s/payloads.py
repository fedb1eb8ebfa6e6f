"""The shapes of what the scheduler and the API server send, checked before anything reads
them: a payload of the wrong shape is a 400 with the path of what is wrong, never a 500.

Only the parts gpupool reads are checked (a Pod's metadata, containers, volumes...); the
rest passes as it came. A JSON null counts as absent, as Go's encoding/json writes nil
maps and slices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpupool.k8s.extender import field

MAX_NODES = 5000
"""The most nodes one scheduling question may name (Kubernetes' own largest cluster)."""


class MalformedPayload(ValueError):
    """A payload whose shape is not what Kubernetes sends; the message names the path."""


Check = Callable[[Any, str], None]


def _object(value: Any, where: str) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise MalformedPayload(f"{where} must be an object, got {_kind(value)}")
    return value


def _list(value: Any, where: str) -> list[Any] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise MalformedPayload(f"{where} must be a list, got {_kind(value)}")
    return value


def _string(value: Any, where: str) -> None:
    if value is not None and not isinstance(value, str):
        raise MalformedPayload(f"{where} must be a string, got {_kind(value)}")


def _boolean(value: Any, where: str) -> None:
    if value is not None and not isinstance(value, bool):
        raise MalformedPayload(f"{where} must be true or false, got {_kind(value)}")


def _string_map(value: Any, where: str) -> None:
    mapping = _object(value, where)
    for key, item in (mapping or {}).items():
        if not isinstance(item, str):
            raise MalformedPayload(f"{where}.{key} must be a string, got {_kind(item)}")


def _quantities(value: Any, where: str) -> None:
    mapping = _object(value, where)
    for key, item in (mapping or {}).items():
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise MalformedPayload(f"{where}.{key} must be a quantity, got {_kind(item)}")


def _strings(value: Any, where: str) -> None:
    for i, item in enumerate(_list(value, where) or []):
        _string(item, f"{where}[{i}]")
        if item is None:
            raise MalformedPayload(f"{where}[{i}] must be a string, got null")


def _each(value: Any, where: str, check: Check) -> None:
    for i, item in enumerate(_list(value, where) or []):
        if not isinstance(item, dict):
            raise MalformedPayload(f"{where}[{i}] must be an object, got {_kind(item)}")
        check(item, f"{where}[{i}]")


def _env_var(env: Any, where: str) -> None:
    _string(env.get("name"), f"{where}.name")
    _string(env.get("value"), f"{where}.value")
    _object(env.get("valueFrom"), f"{where}.valueFrom")


def _container(container: Any, where: str) -> None:
    _string(container.get("name"), f"{where}.name")
    _strings(container.get("command"), f"{where}.command")
    _strings(container.get("args"), f"{where}.args")
    _each(container.get("env"), f"{where}.env", _env_var)
    _list(container.get("envFrom"), f"{where}.envFrom")
    security = _object(container.get("securityContext"), f"{where}.securityContext") or {}
    _boolean(security.get("privileged"), f"{where}.securityContext.privileged")
    capabilities = (
        _object(security.get("capabilities"), f"{where}.securityContext.capabilities") or {}
    )
    _strings(capabilities.get("add"), f"{where}.securityContext.capabilities.add")
    resources = _object(container.get("resources"), f"{where}.resources") or {}
    _quantities(resources.get("limits"), f"{where}.resources.limits")
    _quantities(resources.get("requests"), f"{where}.resources.requests")


def _volume(volume: Any, where: str) -> None:
    _string(volume.get("name"), f"{where}.name")
    host_path = _object(volume.get("hostPath"), f"{where}.hostPath") or {}
    _string(host_path.get("path"), f"{where}.hostPath.path")


def check_pod(pod: Any, where: str = "Pod") -> None:
    """Raise MalformedPayload unless the parts of `pod` gpupool reads have their types."""
    body = _object(pod, where)
    if body is None:
        return
    meta = _object(body.get("metadata"), f"{where}.metadata") or {}
    for key in ("name", "namespace", "generateName", "uid"):
        _string(meta.get(key), f"{where}.metadata.{key}")
    _string_map(meta.get("labels"), f"{where}.metadata.labels")
    _string_map(meta.get("annotations"), f"{where}.metadata.annotations")
    spec = _object(body.get("spec"), f"{where}.spec") or {}
    _each(spec.get("containers"), f"{where}.spec.containers", _container)
    _each(spec.get("initContainers"), f"{where}.spec.initContainers", _container)
    _each(spec.get("ephemeralContainers"), f"{where}.spec.ephemeralContainers", _container)
    _string(spec.get("runtimeClassName"), f"{where}.spec.runtimeClassName")
    _each(spec.get("volumes"), f"{where}.spec.volumes", _volume)
    _boolean(spec.get("hostPID"), f"{where}.spec.hostPID")
    _string(spec.get("nodeName"), f"{where}.spec.nodeName")
    _string(spec.get("schedulerName"), f"{where}.spec.schedulerName")
    priority = spec.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise MalformedPayload(f"{where}.spec.priority must be an integer, got {_kind(priority)}")
    status = _object(body.get("status"), f"{where}.status") or {}
    _string(status.get("phase"), f"{where}.status.phase")


def check_extender_args(args: Mapping[str, Any]) -> None:
    """ExtenderArgs (filter, prioritize): a Pod, and node names or Node objects."""
    pod = field(args, "Pod")
    if pod is None:
        raise MalformedPayload("Pod is missing")
    check_pod(pod)
    _strings(field(args, "NodeNames"), "NodeNames")
    if len(field(args, "NodeNames") or ()) > MAX_NODES:
        raise MalformedPayload(f"NodeNames: more than {MAX_NODES} nodes")
    nodes = _object(field(args, "Nodes"), "Nodes") or {}
    items = _list(nodes.get("items"), "Nodes.items") or []
    if len(items) > MAX_NODES:
        raise MalformedPayload(f"Nodes.items: more than {MAX_NODES} nodes")
    for i, node in enumerate(items):
        node_object = _object(node, f"Nodes.items[{i}]")
        if node_object is None:
            raise MalformedPayload(f"Nodes.items[{i}] must be an object, got null")
        meta = _object(node_object.get("metadata"), f"Nodes.items[{i}].metadata") or {}
        _string(meta.get("name"), f"Nodes.items[{i}].metadata.name")


def _victims(value: Any, where: str) -> None:
    """Victims or MetaVictims: Pods (Pod objects, or MetaPods with a UID) and a count."""
    body = _object(value, where) or {}
    for i, victim in enumerate(_list(field(body, "Pods"), f"{where}.Pods") or []):
        pod = _object(victim, f"{where}.Pods[{i}]")
        if pod is None:
            raise MalformedPayload(f"{where}.Pods[{i}] must be an object, got null")
        _string(field(pod, "UID"), f"{where}.Pods[{i}].UID")
        meta = _object(pod.get("metadata"), f"{where}.Pods[{i}].metadata") or {}
        _string(meta.get("uid"), f"{where}.Pods[{i}].metadata.uid")
    count = field(body, "NumPDBViolations")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
        raise MalformedPayload(f"{where}.NumPDBViolations must be an integer")


def check_preemption_args(args: Mapping[str, Any]) -> None:
    """ExtenderPreemptionArgs: the Pod, and each node's victims (whole pods, or their UIDs
    when the extender is nodeCacheCapable)."""
    pod = field(args, "Pod")
    if pod is None:
        raise MalformedPayload("Pod is missing")
    check_pod(pod)
    for name in ("NodeNameToVictims", "NodeNameToMetaVictims"):
        nodes = _object(field(args, name), name) or {}
        if len(nodes) > MAX_NODES:
            raise MalformedPayload(f"{name}: more than {MAX_NODES} nodes")
        for node, victims in nodes.items():
            _victims(victims, f"{name}.{node}")


def check_binding_args(args: Mapping[str, Any]) -> None:
    """ExtenderBindingArgs: which pod (name, namespace, uid) goes to which node."""
    for name in ("PodName", "PodNamespace", "PodUID", "Node"):
        _string(field(args, name), name)


def check_admission_review(body: Mapping[str, Any]) -> None:
    """An AdmissionReview (v1) with its request; the object is checked as a Pod when the
    request is for one (other kinds pass untouched by the webhook)."""
    if body.get("kind") != "AdmissionReview":
        raise MalformedPayload(f"kind must be AdmissionReview, got {_short(body.get('kind'))}")
    request = _object(body.get("request"), "request")
    if request is None:
        raise MalformedPayload("request is missing")
    _string(request.get("uid"), "request.uid")
    _string(request.get("operation"), "request.operation")
    _string(request.get("subResource"), "request.subResource")
    kind = _object(request.get("kind"), "request.kind") or {}
    for key in ("group", "version", "kind"):
        _string(kind.get(key), f"request.kind.{key}")
    if kind.get("kind") == "Pod":
        check_pod(request.get("object"), "request.object")
        check_pod(request.get("oldObject"), "request.oldObject")


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"a number ({_short(value)})"
    return names.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
