"""Tables for people and JSON for scripts: how every resource is printed."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from gpupool.core.units import format_mib, format_size
from gpupool.protocol.v1.api import (
    EventOut,
    GpuOut,
    HaOut,
    LeaseOut,
    NodeOut,
    PoolSummary,
    QueueEntryOut,
    TenantOut,
)


class OutputFormat(StrEnum):
    TABLE = "table"
    JSON = "json"


OutputOption = Annotated[
    OutputFormat,
    typer.Option("--output", "-o", help="table for people, json for scripts."),
]


def stdout_console() -> Console:
    # Off a terminal (pipes, CI) rich would squeeze tables into 80 columns.
    width = None if sys.stdout.isatty() else 200
    return Console(width=width, highlight=False)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def print_json(data: BaseModel | Sequence[BaseModel] | dict[str, Any]) -> None:
    if isinstance(data, BaseModel):
        payload: Any = data.model_dump(mode="json")
    elif isinstance(data, dict):
        payload = data
    else:
        payload = [item.model_dump(mode="json") for item in data]
    typer.echo(json.dumps(payload, indent=2))


def show(
    output: OutputFormat, data: BaseModel | Sequence[BaseModel], table: Table | Group | Panel
) -> None:
    """Print `data` as JSON or its rendering `table`, as the user asked."""
    if output is OutputFormat.JSON:
        print_json(data)
    else:
        stdout_console().print(table)


def note(message: str) -> None:
    """A status line for people, on stderr so that stdout stays clean for scripts."""
    stderr_console().print(message, soft_wrap=True)


# ---- small formats ----------------------------------------------------------------------


def utc(moment: datetime) -> datetime:
    """Timestamps from SQLite come back naive; they are UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def seconds_since(moment: datetime | None, until: datetime | None = None) -> float | None:
    if moment is None:
        return None
    end = utc(until) if until is not None else datetime.now(UTC)
    return max(0.0, (end - utc(moment)).total_seconds())


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    return f"{hours // 24}d{hours % 24:02d}h"


def clock(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    return utc(moment).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def request_text(lease: LeaseOut) -> str:
    """What a lease asks for, as people say it: `1 x 25% 20GiB` or `2 x whole`."""
    if lease.physical:
        return f"{lease.gpus} x whole GPU"
    parts = [f"{lease.gpus} x"]
    parts.append(f"{lease.compute_pct}%" if lease.compute_pct is not None else "100%")
    if lease.memory_mib is not None:
        parts.append(format_mib(lease.memory_mib))
    elif lease.slices:
        parts.append(format_mib(lease.slices[0].memory_mib))
    return " ".join(parts)


def placement_text(lease: LeaseOut) -> str:
    if not lease.slices:
        return "-"
    return ", ".join(f"{s.node}:{s.gpu_index}" for s in lease.slices)


_STATE_STYLE = {
    "queued": "yellow",
    "granted": "green",
    "active": "bold green",
    "idle": "cyan",
    "swapped": "magenta",
    "migrating": "magenta",
    "preempted": "red",
    "released": "dim",
    "up": "green",
    "down": "red",
    "virtual": "cyan",
    "physical": "blue",
    "draining": "yellow",
    "isolated": "red",
}


def styled(word: str) -> Text:
    return Text(word, style=_STATE_STYLE.get(word, ""))


# ---- tables -----------------------------------------------------------------------------


def cpu_text(node: NodeOut) -> str:
    """'16 cores, 23 % busy': what the server has and how loaded it is (its agent's report)."""
    cores = f"{node.cpu_count} cores" if node.cpu_count else "-"
    busy = node.host.get("cpu_pct")
    return f"{cores}, {busy:.0f} % busy" if isinstance(busy, int | float) else cores


def host_memory_text(node: NodeOut) -> str:
    """'12.3 / 64 GiB used' (programs' memory, page cache excluded)."""
    used, total = node.host.get("memory_used_mib"), node.host.get("memory_total_mib")
    total = total if isinstance(total, int) else node.memory_mib
    if not isinstance(total, int):
        return "-"
    if not isinstance(used, int):
        return format_size(total)
    return f"{format_size(used).removesuffix(' GiB')} / {format_size(total)} used"


def ready_workers_text(node: NodeOut) -> Text:
    """'2/4': workers ready now / kept ahead of their leases (`--ready-workers`); 'off' at 0;
    '-' for an agent that does not say. Short of the target with a start failing: yellow."""
    ready, wanted = node.host.get("ready_workers"), node.host.get("ready_workers_wanted")
    if not isinstance(ready, int) or not isinstance(wanted, int):
        return Text("-")
    if node.host.get("ready_workers_per_gpu") == 0:
        return Text("off")
    short = ready < wanted and bool(node.host.get("ready_workers_problem"))
    return Text(f"{ready}/{wanted}", style="yellow" if short else "")


def nodes_table(nodes: Iterable[NodeOut]) -> Table:
    table = Table(title="nodes", title_justify="left")
    columns = ("NAME", "STATE", "BACKEND", "GPUS", "READY", "CPU", "MEMORY", "ADDRESS", "DRIVER")
    for column in (*columns, "LAST SEEN"):
        table.add_column(column, justify="right" if column in ("GPUS", "READY") else "left")
    for node in nodes:
        table.add_row(
            node.name,
            styled(node.state),
            node.backend,
            str(node.gpu_count),
            ready_workers_text(node),
            cpu_text(node),
            host_memory_text(node),
            node.address or "-",
            node.driver_version or "-",
            f"{duration(seconds_since(node.last_seen_at))} ago",
        )
    return table


def mode_text(gpu: GpuOut) -> Text:
    text = styled(gpu.mode)
    if gpu.target_mode is not None and gpu.target_mode != gpu.mode:
        text.append(f" -> {gpu.target_mode}")
    return text


def gpus_table(gpus: Iterable[GpuOut], title: str = "GPUs") -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("NODE")
    table.add_column("IDX", justify="right")
    table.add_column("UUID", overflow="fold")
    table.add_column("MODEL")
    table.add_column("MODE")
    table.add_column("HEALTH")
    table.add_column("COMPUTE", justify="right")
    table.add_column("MEMORY", justify="right")
    table.add_column("LEASES", justify="right")
    table.add_column("UTIL", justify="right")
    for gpu in gpus:
        util = gpu.telemetry.get("utilization_pct")
        model = Text(gpu.model)
        if gpu.simulated and "simulated" not in gpu.model.lower():
            model.append(" (simulated)", style="yellow")
        table.add_row(
            gpu.node,
            str(gpu.index),
            gpu.uuid,
            model,
            mode_text(gpu),
            Text("ok", style="green") if gpu.healthy else Text("FAULT", style="bold red"),
            f"{gpu.compute_granted_pct}%",
            f"{format_mib(gpu.memory_granted_mib)} / {format_mib(gpu.memory_mib)}",
            str(len(gpu.leases)),
            f"{util:.0f}%" if isinstance(util, int | float) else "-",
        )
    return table


def gpu_detail(gpu: GpuOut) -> Table:
    table = Table(title=f"GPU {gpu.uuid}", title_justify="left", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows: list[tuple[str, str | Text]] = [
        ("node", f"{gpu.node} (index {gpu.index})"),
        (
            "model",
            gpu.model
            + (" (simulated)" if gpu.simulated and "simulated" not in gpu.model.lower() else ""),
        ),
        ("memory", format_mib(gpu.memory_mib)),
        ("mode", mode_text(gpu)),
        ("healthy", "yes" if gpu.healthy else "NO"),
        ("granted", f"{gpu.compute_granted_pct}% compute, {format_mib(gpu.memory_granted_mib)}"),
        ("leases", ", ".join(gpu.leases) or "-"),
        ("pci bus", gpu.pci_bus_id or "-"),
    ]
    if gpu.isolation_reason:
        rows.append(("isolated because", gpu.isolation_reason))
    for key, value in sorted(gpu.telemetry.items()):
        if value is not None and key != "processes":
            rows.append((key, str(value)))
    for key, value in rows:
        table.add_row(key, value)
    return table


def leases_table(leases: Iterable[LeaseOut], title: str = "leases") -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("ID", overflow="fold")
    table.add_column("STATE")
    table.add_column("TENANT")
    table.add_column("REQUEST")
    table.add_column("ON")
    table.add_column("PRIO", justify="right")
    table.add_column("AGE", justify="right")
    table.add_column("HOLDER", overflow="ellipsis", no_wrap=True, max_width=40)
    table.add_column("NOTE", overflow="fold", max_width=50)
    for lease in leases:
        if lease.state == "queued":
            position = f"#{lease.queue_position} " if lease.queue_position is not None else ""
            remark = f"{position}{lease.waiting_reason or ''}".strip()
        elif lease.state == "released":
            remark = lease.release_reason or ""
        elif lease.swap_reason:
            remark = _swap_remark(lease)
        else:
            remark = ""
        table.add_row(
            lease.id,
            styled(lease.state),
            lease.tenant,
            request_text(lease),
            placement_text(lease),
            str(lease.priority),
            duration(seconds_since(lease.created_at, lease.released_at)),
            lease.holder or "-",
            remark or "-",
        )
    return table


def _swap_remark(lease: LeaseOut) -> str:
    """`swapped out: oversubscription` or, before the client answered, `swap asked: ...`."""
    done = "swapped out" if lease.state == "swapped" else "swap asked"
    return f"{done}: {lease.swap_reason}"


def lease_detail(lease: LeaseOut) -> Group:
    table = Table(title=f"lease {lease.id}", title_justify="left", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows: list[tuple[str, str | Text]] = [
        ("state", styled(lease.state)),
        ("tenant", lease.tenant),
        ("request", request_text(lease)),
        ("access", lease.access),
        ("priority", str(lease.priority)),
        ("holder", lease.holder or "-"),
        ("ttl", f"{lease.ttl_s:g} s"),
        ("created", clock(lease.created_at)),
        ("granted", clock(lease.granted_at)),
        ("last heartbeat", f"{duration(seconds_since(lease.last_heartbeat_at))} ago"),
    ]
    if lease.node:
        rows.append(("node wanted", lease.node))
    if lease.gpu_models:
        rows.append(("models wanted", ", ".join(lease.gpu_models)))
    if lease.state == "queued":
        rows.append(("queue position", str(lease.queue_position or "-")))
        rows.append(("waiting for", lease.waiting_reason or "-"))
    if lease.swap_reason:
        rows.append(("swap", _swap_remark(lease)))
    if lease.released_at is not None:
        rows.append(("released", clock(lease.released_at)))
        rows.append(("why", lease.release_reason or "-"))
    for key, value in rows:
        table.add_row(key, value)
    if not lease.slices:
        return Group(table)
    slices = Table(title="slices", title_justify="left")
    for column in ("NODE", "IDX", "GPU", "COMPUTE", "MEMORY"):
        slices.add_column(column)
    for piece in lease.slices:
        slices.add_row(
            piece.node,
            str(piece.gpu_index),
            piece.gpu_uuid,
            "whole" if piece.whole else f"{piece.compute_pct}%",
            format_mib(piece.memory_mib),
        )
    return Group(table, slices)


def queue_table(entries: Iterable[QueueEntryOut]) -> Table:
    table = Table(title="queue", title_justify="left")
    for column in ("POS", "LEASE", "TENANT", "REQUEST", "PRIO", "WAITING", "WHY"):
        table.add_column(column, justify="right" if column in ("POS", "PRIO") else "left")
    for entry in entries:
        lease = entry.lease
        table.add_row(
            str(entry.position),
            lease.id,
            lease.tenant,
            request_text(lease),
            str(lease.priority),
            duration(seconds_since(lease.created_at)),
            lease.waiting_reason or "-",
        )
    return table


def _limit(used: str, limit: str | None) -> str:
    return f"{used} / {limit}" if limit is not None else f"{used} / -"


def tenants_table(tenants: Iterable[TenantOut]) -> Table:
    table = Table(title="tenants (used / quota)", title_justify="left")
    for column in ("NAME", "WEIGHT", "GPUS", "COMPUTE", "MEMORY", "LEASES", "QUEUED", "MAX PRIO"):
        table.add_column(column, justify="left" if column == "NAME" else "right")
    for tenant in tenants:
        max_memory = None if tenant.max_memory_mib is None else format_mib(tenant.max_memory_mib)
        max_compute = None if tenant.max_compute_pct is None else f"{tenant.max_compute_pct}%"
        table.add_row(
            tenant.name,
            f"{tenant.weight:g}",
            _limit(
                str(tenant.used_gpus), None if tenant.max_gpus is None else str(tenant.max_gpus)
            ),
            _limit(f"{tenant.used_compute_pct}%", max_compute),
            _limit(format_mib(tenant.used_memory_mib), max_memory),
            _limit(
                str(tenant.used_leases),
                None if tenant.max_leases is None else str(tenant.max_leases),
            ),
            str(tenant.queued_leases),
            "-" if tenant.max_priority is None else str(tenant.max_priority),
        )
    return table


def events_table(events: Iterable[EventOut]) -> Table:
    table = Table(title="events", title_justify="left")
    table.add_column("ID", justify="right")
    table.add_column("AT")
    table.add_column("ACTOR")
    table.add_column("KIND")
    table.add_column("SUBJECT", overflow="fold")
    table.add_column("MESSAGE", overflow="fold")
    for event in events:
        table.add_row(
            str(event.id),
            clock(event.at),
            event.actor,
            event.kind,
            event.subject,
            event.message,
        )
    return table


def event_line(event: EventOut) -> Text:
    text = Text(f"{event.id:>6} {clock(event.at)} ", style="dim")
    text.append(f"{event.kind:<22} ", style="bold")
    text.append(f"{event.subject} ")
    text.append(event.message)
    text.append(f"  ({event.actor})", style="dim")
    return text


def pool_panel(pool: PoolSummary) -> Panel:
    table = Table(show_header=False, box=None)
    table.add_column("field", style="bold")
    table.add_column("value")
    gpus = ", ".join(f"{n} {mode}" for mode, n in sorted(pool.gpus.items()) if n) or "none"
    leases = ", ".join(f"{n} {state}" for state, n in sorted(pool.leases.items()) if n) or "none"
    ratios = ", ".join(f"{name} x{value:g}" for name, value in sorted(pool.ratios.items()))
    table.add_row("nodes", f"{pool.nodes_up} up, {pool.nodes_down} down")
    table.add_row("GPUs", gpus)
    table.add_row(
        "compute",
        f"{pool.compute_granted_pct}% granted of {pool.compute_capacity_pct}%",
    )
    table.add_row(
        "memory",
        f"{format_mib(pool.memory_granted_mib)} granted of {format_mib(pool.memory_capacity_mib)}",
    )
    table.add_row("leases", leases)
    table.add_row("queued", str(pool.queued))
    table.add_row("oversubscription", ratios or "-")
    if pool.ha is not None and pool.ha.enabled:
        table.add_row("leader", ha_leader(pool.ha))
        table.add_row("controllers", ha_members(pool.ha))
    title = "pool" + (" [yellow](SIMULATED GPUs)[/yellow]" if pool.simulated else "")
    return Panel(table, title=title, title_align="left", expand=False)


def simulated_banner(spec: str, why: str) -> Panel:
    return Panel(
        f"[bold]SIMULATED GPUs[/bold]: {spec} ({why}).\n"
        "Leases, quotas and the queue are real; the GPUs and their telemetry are not.",
        border_style="yellow",
        style="yellow",
        expand=False,
    )


def ha_leader(ha: HaOut) -> str:
    if ha.leader is None:
        return "[red]none[/red] (a takeover is under way)"
    since = seconds_since(ha.leader_since)
    return f"{ha.leader} (epoch {ha.epoch}, for {duration(since)})"


def ha_members(ha: HaOut) -> str:
    """Each controller: its role, or how long it has been silent when it is down."""
    parts = []
    for member in ha.members:
        state: str
        if member.up:
            state = member.role
        elif member.role == "stopped":
            state = "[yellow]stopped[/yellow]"
        else:
            state = f"[red]down[/red], silent {duration(member.last_seen_s)}"
        mine = " (answered)" if member.url == ha.me else ""
        parts.append(f"{member.url} {state}{mine}")
    return "\n".join(parts) or "-"
