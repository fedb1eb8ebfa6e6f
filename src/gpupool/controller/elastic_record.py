"""A remote lease's `elastic` record, read: its worker generation, the handoff under way, the
swap it was ordered, and the answers to its workers' requests for room.

Both services that write the record read it through these: the elastic one (moves, swaps,
restores: services/elastic.py) and the oversubscription one (swap orders and room answers:
services/oversubscription.py), and the lease's view shows the swap reason.
"""

from __future__ import annotations

from typing import Any

from gpupool.controller.models import LeaseRow


def generation(row: LeaseRow) -> int:
    return int((row.elastic or {}).get("gen", 0))


def handoff(row: LeaseRow) -> dict[str, Any] | None:
    value = (row.elastic or {}).get("handoff")
    return value if isinstance(value, dict) else None


def swap_order(row: LeaseRow) -> dict[str, Any] | None:
    value = (row.elastic or {}).get("swap")
    return value if isinstance(value, dict) else None


def swap_reason(row: LeaseRow) -> str | None:
    order = swap_order(row)
    reason = order.get("reason") if order is not None else None
    return reason if isinstance(reason, str) else None


def room_denied_seq(row: LeaseRow, gpu_uuid: str) -> int | None:
    answer = (row.elastic or {}).get("room", {}).get(gpu_uuid)
    if isinstance(answer, dict) and answer.get("verdict") == "denied":
        return int(answer["seq"])
    return None
