"""Real AdmissionReview v1 payloads for pods, and a JSONPatch applier to read the answers."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any


def pod(
    limits: dict[str, str] | None = None,
    *,
    name: str = "notebook",
    namespace: str = "team-a",
    annotations: dict[str, str] | None = None,
    env: list[dict[str, Any]] | None = None,
    command: list[str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": "pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime",
    }
    if limits is not None:
        container["resources"] = {"limits": dict(limits)}
    if env is not None:
        container["env"] = env
    if command is not None:
        container["command"] = command
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"containers": [container], **spec},
    }
    if annotations:
        body["metadata"]["annotations"] = annotations
    return body


def admission_review(
    obj: dict[str, Any], operation: str = "CREATE", old: dict[str, Any] | None = None
) -> dict[str, Any]:
    """As the API server sends it (admission.k8s.io/v1)."""
    request: dict[str, Any] = {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
        "requestResource": {"group": "", "version": "v1", "resource": "pods"},
        "name": obj["metadata"].get("name"),
        "namespace": obj["metadata"].get("namespace"),
        "operation": operation,
        "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
        "object": obj,
        "oldObject": old,
        "dryRun": False,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
    }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def apply_patch(obj: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """Apply the response's JSONPatch (RFC 6902: add, replace, remove) to a copy of `obj`."""
    out = copy.deepcopy(obj)
    if "patch" not in response:
        return out
    assert response["patchType"] == "JSONPatch"
    for op in json.loads(base64.b64decode(response["patch"])):
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        target: Any = out
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if op["op"] in ("add", "replace"):
            if isinstance(target, list):
                target.insert(len(target) if last == "-" else int(last), op["value"])
            else:
                target[last] = op["value"]
        elif op["op"] == "remove":
            del target[int(last) if isinstance(target, list) else last]
        else:
            raise AssertionError(f"unexpected op {op['op']}")
    return out
