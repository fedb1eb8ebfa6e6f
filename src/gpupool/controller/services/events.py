"""The append-only event log: who did what, when."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpupool.controller.models import EventRow, utcnow
from gpupool.controller.views import event_out
from gpupool.protocol.v1.api import EventOut


def record(
    session: Session, actor: str, kind: str, subject: str, message: str, **data: Any
) -> None:
    session.add(
        EventRow(at=utcnow(), actor=actor, kind=kind, subject=subject, message=message, data=data)
    )


def list_events(
    session: Session,
    since_id: int | None = None,
    limit: int = 100,
    kind: str | None = None,
    subject: str | None = None,
) -> list[EventOut]:
    query = select(EventRow)
    if since_id is not None:
        query = query.where(EventRow.id > since_id).order_by(EventRow.id).limit(limit)
        rows = list(session.scalars(query.where(*_filters(kind, subject))))
    else:
        query = query.where(*_filters(kind, subject)).order_by(EventRow.id.desc()).limit(limit)
        rows = list(reversed(list(session.scalars(query))))
    return [event_out(r) for r in rows]


def _filters(kind: str | None, subject: str | None) -> list[Any]:
    out: list[Any] = []
    if kind:
        out.append(EventRow.kind.like(kind.replace("*", "%")))
    if subject:
        out.append(EventRow.subject == subject)
    return out
