"""Tenants and their quotas."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpupool.controller.models import LeaseRow, TenantRow, utcnow
from gpupool.controller.services import auth
from gpupool.controller.services.events import record
from gpupool.controller.services.leases import persist_grants
from gpupool.controller.store import Store, quota_of
from gpupool.controller.views import tenant_out
from gpupool.core import Conflict, LeaseState, NotFound
from gpupool.core.model import quota_text
from gpupool.core.units import format_size, parse_memory_mib
from gpupool.protocol.v1.api import QuotaIn, TenantCreate, TenantOut, TenantUpdate

DEFAULT_TENANT = "default"


def _apply_quota(row: TenantRow, quota: QuotaIn, only_set: bool) -> None:
    fields = quota.model_fields_set if only_set else set(type(quota).model_fields)
    if "max_gpus" in fields:
        row.max_gpus = quota.max_gpus
    if "max_memory" in fields:
        row.max_memory_mib = (
            None if quota.max_memory is None else parse_memory_mib(quota.max_memory)
        )
    if "max_compute_pct" in fields:
        row.max_compute_pct = quota.max_compute_pct
    if "max_leases" in fields:
        row.max_leases = quota.max_leases
    if "max_priority" in fields:
        row.max_priority = quota.max_priority
    if "guaranteed_gpus" in fields:
        row.guaranteed_gpus = quota.guaranteed_gpus or 0.0


def _out(store: Store, row: TenantRow) -> TenantOut:
    queued = sum(1 for q in store.pool.queue.values() if q.request.tenant == row.name)
    return tenant_out(row, store.pool.held_by(row.name), queued)


def ensure_default(store: Store, session: Session) -> None:
    if session.get(TenantRow, DEFAULT_TENANT) is None:
        row = TenantRow(name=DEFAULT_TENANT, weight=1.0, created_at=utcnow())
        session.add(row)
        store.pool.quotas[DEFAULT_TENANT] = quota_of(row)
        record(session, "controller", "tenant.created", DEFAULT_TENANT, "default tenant, no limits")


SETTINGS = (
    "weight",
    "max_gpus",
    "max_memory_mib",
    "max_compute_pct",
    "max_leases",
    "max_priority",
    "guaranteed_gpus",
    "idle_timeout_s",
)
"""What a create sets: a resent create must ask for the same, or it is another request."""


def _row_of(body: TenantCreate) -> TenantRow:
    row = TenantRow(
        name=body.name, weight=body.weight, created_at=utcnow(), idle_timeout_s=body.idle_timeout_s
    )
    _apply_quota(row, body.quota, only_set=False)
    return row


def _differences(existing: TenantRow, asked: TenantRow) -> list[str]:
    return [
        f"{name.removesuffix('_mib')} is {_setting(name, getattr(existing, name))} "
        f"(asked {_setting(name, getattr(asked, name))})"
        for name in SETTINGS
        if getattr(existing, name) != getattr(asked, name)
    ]


def _setting(name: str, value: object) -> str:
    """A tenant setting in words: 'no limit' for None, sizes in GiB."""
    if value is None:
        return "no limit" if name.startswith("max_") else "not set"
    if name == "max_memory_mib" and isinstance(value, int):
        return format_size(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def create(
    store: Store, session: Session, body: TenantCreate, actor: str
) -> tuple[TenantOut, bool]:
    """The tenant, and whether this call made it.

    Creating is idempotent, as a lease request with a `request_id` is: a client that failed
    over to another controller resends a create whose first send may have committed. The
    same settings answer with the tenant as it is (nothing is changed or logged again);
    other settings are a Conflict that names each difference (PATCH changes a tenant)."""
    asked = _row_of(body)
    existing = session.get(TenantRow, body.name)
    if existing is not None and existing.deleted_at is not None:
        return _revive(store, session, existing, asked, actor), True
    if existing is not None:
        differ = _differences(existing, asked)
        if differ:
            raise Conflict(
                f"tenant {body.name!r} exists already with other settings: {'; '.join(differ)}"
            )
        return _out(store, existing), False
    session.add(asked)
    store.pool.quotas[asked.name] = quota_of(asked)
    store.idle_timeouts[asked.name] = asked.idle_timeout_s
    record(session, actor, "tenant.created", asked.name, f"quota: {quota_text(quota_of(asked))}")
    return _out(store, asked), True


def _revive(
    store: Store, session: Session, row: TenantRow, asked: TenantRow, actor: str
) -> TenantOut:
    """A deleted tenant's name created again: the new settings, the old history."""
    for name in SETTINGS:
        setattr(row, name, getattr(asked, name))
    row.deleted_at = None
    row.created_at = asked.created_at
    store.pool.quotas[row.name] = quota_of(row)
    store.idle_timeouts[row.name] = row.idle_timeout_s
    record(
        session,
        actor,
        "tenant.created",
        row.name,
        f"quota: {quota_text(quota_of(row))} (created again; its earlier leases stay in history)",
    )
    return _out(store, row)


def _live_row(session: Session, name: str) -> TenantRow:
    row = session.get(TenantRow, name)
    if row is None or row.deleted_at is not None:
        raise NotFound(f"no tenant {name!r}")
    return row


def update(store: Store, session: Session, name: str, body: TenantUpdate, actor: str) -> TenantOut:
    row = _live_row(session, name)
    if body.weight is not None:
        row.weight = body.weight
    if body.quota is not None:
        _apply_quota(row, body.quota, only_set=True)
    if "idle_timeout_s" in body.model_fields_set:
        row.idle_timeout_s = body.idle_timeout_s
        store.idle_timeouts[name] = row.idle_timeout_s
    store.pool.quotas[name] = quota_of(row)
    record(
        session,
        actor,
        "tenant.updated",
        name,
        f"quota: {quota_text(quota_of(row))}; weight {row.weight:g}",
    )
    # A raised quota may let queued requests of this tenant through.
    persist_grants(store, session, store.pool.serve_queue(), utcnow())
    return _out(store, row)


def delete(store: Store, session: Session, name: str, actor: str) -> None:
    """Delete a tenant that holds nothing; the history of its leases (rows, events) is kept."""
    row = _live_row(session, name)
    if name == DEFAULT_TENANT:
        raise Conflict("the default tenant cannot be deleted")
    live = session.scalar(
        select(func.count())
        .select_from(LeaseRow)
        .where(LeaseRow.tenant == name, LeaseRow.state != LeaseState.RELEASED.value)
    )
    if live:
        raise Conflict(
            f"tenant {name} has {live} live or queued lease(s): release them first "
            f"(`gpupool lease ls --tenant {name}`)"
        )
    total = session.scalar(
        select(func.count()).select_from(LeaseRow).where(LeaseRow.tenant == name)
    )
    auth.drop_tenant_tokens(session, name, actor)
    session.flush()
    store.pool.quotas.pop(name, None)
    store.idle_timeouts.pop(name, None)
    if total:
        # Its leases' rows point to it: the row stays, marked, so their history stays readable.
        row.deleted_at = utcnow()
        record(session, actor, "tenant.deleted", name, f"deleted; its {total} lease(s) kept")
        return
    session.delete(row)
    record(session, actor, "tenant.deleted", name, "deleted")


def list_tenants(store: Store, session: Session) -> list[TenantOut]:
    rows = list(
        session.scalars(
            select(TenantRow).where(TenantRow.deleted_at.is_(None)).order_by(TenantRow.name)
        )
    )
    with store.lock:
        return [_out(store, r) for r in rows]


def get(store: Store, session: Session, name: str) -> TenantOut:
    row = _live_row(session, name)
    with store.lock:
        return _out(store, row)
