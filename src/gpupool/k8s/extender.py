"""The kube-scheduler extender: filter, prioritize and bind GPU pods with the pool's placement.

The scheduler sends ExtenderArgs and ExtenderBindingArgs as Go encodes them (field names
such as `Pod`, `NodeNames`, `PodUID`; older schedulers sent lowercase tags), and decodes
our answers case-insensitively, as Go's encoding/json does. Bind is where a pod's claim
becomes a lease: the controller grants the request on the chosen node, then the pod is
bound; if the binding fails the lease is released again.

Preempt: the scheduler's own preemption sees gpupool's resources only as device counts, so
on a node whose GPUs are full it finds nothing to evict. The extender asks the pool which
claimed pods of lower priority on each node would make room, adds them to the scheduler's
victims (the scheduler evicts only pods of that node), and drops the nodes where no such
set exists. The victims' claims end with their pods (the sweep).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from gpupool.client.sdk import ApiError, ControllerUnreachable, PoolClient
from gpupool.k8s.kube import KubeApi, KubeError
from gpupool.k8s.pods import Pod, PodRefused, asks_for_gpus, claim_of, gpu_ask, pod_name
from gpupool.k8s.resources import CLAIM_LABEL
from gpupool.protocol.v1.k8s import ClaimCreate, PlacementAnswer, PlacementQuery, PreemptionQuery

log = logging.getLogger(__name__)

ENDED_PHASES = frozenset({"Succeeded", "Failed"})


def field(args: Mapping[str, Any], name: str) -> Any:
    """`args[name]`, matching the key without regard to case (as Go decodes JSON)."""
    if name in args:
        return args[name]
    low = name.lower()
    return next((v for k, v in args.items() if k.lower() == low), None)


class BindRefused(Exception):
    """The pod cannot be bound to the node now; the scheduler retries it later."""


@dataclass
class SweepResult:
    kept: int = 0
    released: int = 0


class Extender:
    def __init__(self, pool: PoolClient, kube: KubeApi, admit_timeout_s: float = 300.0) -> None:
        self.pool = pool
        self.kube = kube
        self.admit_timeout_s = admit_timeout_s
        """A claim bound this long without a container (a node whose kubelet never admits the
        pod) is released: it would hold its node's one admission slot for ever."""

    # ---- filter and prioritize ----------------------------------------------------------

    async def filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        pod: Pod = field(args, "Pod") or {}
        names, node_objects = _candidates(args)
        try:
            answer = await self._placement(pod, names)
        except PodRefused as exc:
            return _filter_result([], node_objects, {}, {n: str(exc) for n in names})
        except (ApiError, ControllerUnreachable) as exc:
            return {"Error": f"gpupool controller: {exc}"}
        if answer is None:  # not a direct GPU pod: gpupool has no say
            return _filter_result(names, node_objects, {}, {})
        fits = [f.node for f in answer.nodes if f.fits]
        # Nodes no preemption could help are "unresolvable": the scheduler does not try there.
        retry = {
            f.node: f.reason or "does not fit" for f in answer.nodes if not f.fits and not f.never
        }
        never = {f.node: f.reason or "does not fit" for f in answer.nodes if f.never}
        for name in names:
            if not _is_pool_node_name(name):
                never[name] = "not a gpupool node (its name is not one a node registers with)"
        return _filter_result(fits, node_objects, retry, never)

    async def prioritize(self, args: Mapping[str, Any]) -> list[dict[str, Any]]:
        pod: Pod = field(args, "Pod") or {}
        names, _ = _candidates(args)
        try:
            answer = await self._placement(pod, names)
        except (PodRefused, ApiError, ControllerUnreachable) as exc:
            log.warning("prioritize %s: %s", pod_name(pod), exc)
            return [{"Host": n, "Score": 0} for n in names]
        if answer is None:
            return [{"Host": n, "Score": 0} for n in names]
        scores = {f.node: f.score for f in answer.nodes}
        return [{"Host": n, "Score": scores.get(n, 0)} for n in names]

    async def _placement(self, pod: Pod, names: list[str]) -> PlacementAnswer | None:
        if not asks_for_gpus(pod):
            return None
        ask = gpu_ask(pod)
        if ask.access == "remote":
            return None
        try:
            query = PlacementQuery(
                request=ask.lease_request(), nodes=[n for n in names if _is_pool_node_name(n)]
            )
        except ValidationError as exc:
            raise PodRefused(f"the pod's GPU request is not valid: {_first_error(exc)}") from None
        return await asyncio.to_thread(self.pool.k8s_placement, query)

    # ---- preempt -------------------------------------------------------------------------

    async def preempt(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """ExtenderPreemptionArgs -> ExtenderPreemptionResult (victims by UID, per node)."""
        pod: Pod = field(args, "Pod") or {}
        proposed = _proposed_victims(args)
        try:
            ask = gpu_ask(pod) if asks_for_gpus(pod) else None
        except PodRefused as exc:
            log.info("preempt %s: %s; no node", pod_name(pod), exc)
            return {"NodeNameToMetaVictims": {}}
        if ask is None or ask.access == "remote":
            return {"NodeNameToMetaVictims": _meta(proposed)}
        nodes = [n for n in proposed if _is_pool_node_name(n)]
        try:
            evictable = await self._evictable(pod)
            offered = {n: evictable.get(n, {}) for n in nodes}
            query = PreemptionQuery(
                request=ask.lease_request(),
                nodes={n: list(by_claim) for n, by_claim in offered.items()},
            )
            answer = await asyncio.to_thread(self.pool.k8s_preemption, query)
        except ValidationError as exc:
            log.info("preempt %s: %s; no node", pod_name(pod), _first_error(exc))
            return {"NodeNameToMetaVictims": {}}
        except (ApiError, ControllerUnreachable, KubeError) as exc:
            # No answer means no eviction: never evict pods for room the pool did not confirm.
            log.warning("preempt %s: %s; no node this time", pod_name(pod), exc)
            return {"NodeNameToMetaVictims": {}}
        result: dict[str, _Victims] = {}
        for verdict in answer.nodes:
            if not verdict.helps:
                log.info("preempt %s: not on %s: %s", pod_name(pod), verdict.node, verdict.reason)
                continue
            uids, pdb = proposed[verdict.node]
            extra = [offered[verdict.node][c] for c in verdict.claims]
            result[verdict.node] = (list(dict.fromkeys([*uids, *extra])), pdb)
        return {"NodeNameToMetaVictims": _meta(result)}

    async def _evictable(self, preemptor: Pod) -> dict[str, dict[str, str]]:
        """node -> claim -> pod UID of the live claimed pods of lower priority (one list of
        the claimed pods for all candidate nodes, however many the scheduler sent)."""
        mine = _k8s_priority(preemptor)
        out: dict[str, dict[str, str]] = {}
        for victim in await self.kube.pods_with_label(CLAIM_LABEL):
            meta = victim.get("metadata") or {}
            claim, uid = claim_of(victim), str(meta.get("uid") or "")
            node = str((victim.get("spec") or {}).get("nodeName") or "")
            phase = (victim.get("status") or {}).get("phase")
            if not (claim and uid and node) or meta.get("deletionTimestamp"):
                continue
            if phase not in ENDED_PHASES and _k8s_priority(victim) < mine:
                out.setdefault(node, {})[claim] = uid
        return out

    # ---- bind ----------------------------------------------------------------------------

    async def bind(self, args: Mapping[str, Any]) -> dict[str, Any]:
        namespace = str(field(args, "PodNamespace") or "")
        name = str(field(args, "PodName") or "")
        uid = str(field(args, "PodUID") or "")
        node = str(field(args, "Node") or "")
        if not (namespace and name and node):
            return {"Error": "ExtenderBindingArgs needs PodName, PodNamespace and Node"}
        try:
            pod = await self.kube.get_pod(namespace, name)
        except KubeError as exc:
            return {"Error": str(exc)}
        actual_uid = str((pod.get("metadata") or {}).get("uid", ""))
        if uid and actual_uid != uid:
            return {"Error": f"pod {namespace}/{name} is now {actual_uid}, not {uid}"}
        try:
            claim = await self._claim(pod, node)
        except BindRefused as exc:
            return {"Error": str(exc)}
        try:
            await self.kube.bind(namespace, name, uid or actual_uid, node)
        except KubeError as exc:
            if claim is not None:
                await self._release(claim)
            return {"Error": str(exc)}
        log.info("bound %s/%s to %s (claim %s)", namespace, name, node, claim or "none")
        return {"Error": ""}

    async def _claim(self, pod: Pod, node: str) -> str | None:
        """The pod's claim, granted on `node`; None for a pod that needs none."""
        try:
            if not asks_for_gpus(pod):
                return None
            ask = gpu_ask(pod)
        except PodRefused as exc:
            raise BindRefused(str(exc)) from exc
        if ask.access == "remote":
            return None
        claim = claim_of(pod)
        if claim is None:
            raise BindRefused(
                f"pod {pod_name(pod)} has no {CLAIM_LABEL} label: was it admitted "
                "through the gpupool webhook?"
            )
        try:
            body = ClaimCreate(
                claim=claim, node=node, pod=pod_name(pod), request=ask.lease_request()
            )
        except ValidationError as exc:
            why = _first_error(exc)
            raise BindRefused(f"pod {pod_name(pod)} cannot be claimed: {why}") from None
        try:
            await asyncio.to_thread(self.pool.create_claim, body)
        except (ApiError, ControllerUnreachable) as exc:
            raise BindRefused(f"gpupool: {exc}") from exc
        return claim

    async def _release(self, claim: str) -> None:
        try:
            await asyncio.to_thread(self.pool.release_claim, claim)
        except (ApiError, ControllerUnreachable) as exc:
            log.warning("could not release claim %s (its lease will expire): %s", claim, exc)

    # ---- claims follow their pods ---------------------------------------------------------

    async def sweep(self) -> SweepResult:
        """Heartbeat the leases of claims whose pods live; release those whose pods ended."""
        result = SweepResult()
        claims = await asyncio.to_thread(self.pool.claims)
        if not claims:
            return result
        pods = await self.kube.pods_with_label(CLAIM_LABEL)
        live = {
            c: p
            for p in pods
            if (c := claim_of(p)) and (p.get("status") or {}).get("phase") not in ENDED_PHASES
        }
        now = datetime.now(UTC)
        for claim in claims:
            granted = claim.lease.granted_at or claim.lease.created_at
            stuck = (
                claim.state == "bound" and (now - granted).total_seconds() > self.admit_timeout_s
            )
            try:
                if claim.claim in live and not stuck:
                    await asyncio.to_thread(self.pool.heartbeat_claim, claim.claim)
                    result.kept += 1
                else:
                    await asyncio.to_thread(self.pool.release_claim, claim.claim)
                    result.released += 1
                    why = "no container took it in time" if stuck else "its pod is gone or ended"
                    log.info("claim %s: %s; lease released", claim.claim, why)
            except ApiError as exc:
                log.warning("claim %s: %s", claim.claim, exc)
        return result


_POOL_NODE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def _is_pool_node_name(name: str) -> bool:
    """Whether `name` could be a gpupool node's (NodeRegister's rule); others never are."""
    return bool(_POOL_NODE_NAME.match(name))


_Victims = tuple[list[str], int]
"""The UIDs of a node's victims and the PodDisruptionBudget violations evicting them costs."""


def _proposed_victims(args: Mapping[str, Any]) -> dict[str, _Victims]:
    """The scheduler's victims per node, as UIDs, whichever form it sent them in."""
    out: dict[str, _Victims] = {}
    meta = field(args, "NodeNameToMetaVictims")
    if meta is not None:
        for node, victims in meta.items():
            body = victims or {}
            uids = [str(field(p, "UID") or "") for p in field(body, "Pods") or []]
            out[str(node)] = ([u for u in uids if u], int(field(body, "NumPDBViolations") or 0))
        return out
    for node, victims in (field(args, "NodeNameToVictims") or {}).items():
        body = victims or {}
        pods = field(body, "Pods") or []
        uids = [str((p.get("metadata") or {}).get("uid") or "") for p in pods]
        out[str(node)] = ([u for u in uids if u], int(field(body, "NumPDBViolations") or 0))
    return out


def _meta(victims: Mapping[str, _Victims]) -> dict[str, Any]:
    return {
        node: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": pdb}
        for node, (uids, pdb) in victims.items()
    }


def _k8s_priority(pod: Pod) -> int:
    """The pod's priority as the scheduler compares it (from its priorityClass; 0 unset)."""
    value = (pod.get("spec") or {}).get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return str(exc)
    where = ".".join(str(p) for p in errors[0]["loc"])
    return f"{where}: {errors[0]['msg']}" if where else errors[0]["msg"]


def _candidates(args: Mapping[str, Any]) -> tuple[list[str], list[dict[str, Any]] | None]:
    """Node names, and the Node objects when the scheduler sent whole nodes."""
    names = field(args, "NodeNames")
    if names is not None:
        return [str(n) for n in names], None
    nodes = field(args, "Nodes") or {}
    items = list(nodes.get("items") or [])
    return [str((n.get("metadata") or {}).get("name", "")) for n in items], items


def _filter_result(
    fits: list[str],
    node_objects: list[dict[str, Any]] | None,
    failed: dict[str, str],
    unresolvable: dict[str, str],
) -> dict[str, Any]:
    """An ExtenderFilterResult in the form the scheduler asked in (names or Node objects)."""
    result: dict[str, Any] = {
        "FailedNodes": failed,
        "FailedAndUnresolvableNodes": unresolvable,
        "Error": "",
    }
    if node_objects is None:
        result["NodeNames"] = fits
    else:
        keep = set(fits)
        result["Nodes"] = {
            "apiVersion": "v1",
            "kind": "NodeList",
            "items": [n for n in node_objects if (n.get("metadata") or {}).get("name") in keep],
        }
    return result
