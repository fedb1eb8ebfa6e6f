"""`gpupool lease ...` and `gpupool queue`: ask for GPUs, wait for them, give them back."""

from __future__ import annotations

import socket
import time
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.markup import escape

from gpupool.cli.context import cli_context, default_actor
from gpupool.cli.errors import BadInput, CommandFailed, validation_message
from gpupool.cli.output import (
    OutputFormat,
    OutputOption,
    lease_detail,
    leases_table,
    note,
    print_json,
    queue_table,
    show,
    stderr_console,
)
from gpupool.cli.signals import exit_status_of, terminate_interrupts
from gpupool.client.sdk import ApiError, ControllerUnreachable, PoolClient
from gpupool.core.units import (
    compute_for_memory,
    describe_memory,
    format_mib,
    format_size,
    parse_compute_pct,
    parse_cpu_milli,
    parse_memory_mib,
)
from gpupool.protocol.v1.api import LeaseCreate, LeaseOut

app = typer.Typer(no_args_is_help=True)

LEASE_TTL_S = 3600.0
"""`lease create`'s ttl: a person renews it by hand, so an hour, not the API's 30 s."""
HOLDER_MAX = 256
"""LeaseCreate.holder's max_length."""


def build_request(
    *,
    gpus: int,
    compute: str | None,
    memory: str | None,
    physical: bool,
    priority: int,
    tenant: str | None,
    node: str | None,
    gpu_models: str | None,
    holder: str,
    ttl_s: float,
    wait: bool,
    locality: str | None = None,
    max_wait_s: float | None = None,
    access: str = "direct",
    cpu: str | None = None,
    host_memory: str | None = None,
    idle_timeout_s: float | None = None,
) -> LeaseCreate:
    """Check the user's request here, so that bad input fails before anything is sent."""
    node, prefer_node = resolve_locality(locality, node)
    if max_wait_s is not None and not 0 < max_wait_s <= 30 * 86400:
        raise BadInput(f"--max-wait must be more than 0 s and at most 30 days, got {max_wait_s:g}")
    if idle_timeout_s is not None and not 0 < idle_timeout_s <= 30 * 86400:
        raise BadInput(
            f"--idle-timeout must be more than 0 s and at most 30 days, got {idle_timeout_s:g}"
        )
    if idle_timeout_s is not None and access != "remote":
        raise BadInput("--idle-timeout swaps an idle remote lease out: it needs --remote")
    if not 1 <= gpus <= 256:
        raise BadInput(f"--gpus must be 1..256, got {gpus}")
    if not 0 <= priority <= 1000:
        raise BadInput(f"--priority must be 0..1000, got {priority}")
    if not 0 < ttl_s <= 86400:
        raise BadInput(f"--ttl must be more than 0 and at most 86400 s, got {ttl_s:g}")
    if len(holder) > HOLDER_MAX:
        raise BadInput(f"--holder may be at most {HOLDER_MAX} characters, got {len(holder)}")
    if physical and (compute is not None or memory is not None):
        raise BadInput("a physical lease takes whole GPUs: give no --compute or --memory")
    compute_pct = None if compute is None else parse_compute_pct(compute)
    memory_text = None if memory is None else f"{parse_memory_mib(memory)}MiB"
    models = [m.strip() for m in (gpu_models or "").split(",") if m.strip()]
    try:
        # Left out, the controller charges the token's tenant (or 'default' for operators).
        chosen = {"tenant": tenant} if tenant is not None else {}
        return LeaseCreate(
            **chosen,
            gpus=gpus,
            compute_pct=compute_pct,
            memory=memory_text,
            physical=physical,
            priority=priority,
            access="remote" if access == "remote" else "direct",
            node=node,
            prefer_node=prefer_node,
            gpu_models=models,
            holder=holder,
            ttl_s=ttl_s,
            wait=wait,
            max_wait_s=max_wait_s,
            cpu=None if cpu is None else str(parse_cpu_milli(cpu)) + "m",
            host_memory=None if host_memory is None else f"{parse_memory_mib(host_memory)}MiB",
            idle_timeout_s=idle_timeout_s,
        )
    except ValidationError as exc:
        raise BadInput(validation_message(exc)) from None


CpuOption = Annotated[
    str | None,
    typer.Option("--cpu", help="Cores of the GPU's server a direct lease needs: 4, 0.5 or 500m."),
]
HostMemoryOption = Annotated[
    str | None,
    typer.Option("--host-memory", help="Memory of the GPU's server a direct lease needs: 32GiB."),
]


def resolve_locality(locality: str | None, node: str | None) -> tuple[str | None, str | None]:
    """`--locality`: (server the lease must use, server it prefers).

    Without it a request prefers this server and takes any other when this one is full.
    """
    here = socket.gethostname()
    if locality is None:
        return node, (None if node else here)
    if node is not None:
        raise BadInput("give either --node or --locality, not both")
    if locality == "local":
        return here, None
    if locality == "any":
        return None, None
    if locality.startswith("node=") and len(locality) > 5:
        return locality[5:], None
    raise BadInput(f"--locality must be local, any or node=NAME, got {locality!r}")


def default_holder() -> str:
    return f"{default_actor()}@{socket.gethostname()}"


def _wait_text(lease: LeaseOut, waited_s: float) -> str:
    position = f"#{lease.queue_position}" if lease.queue_position is not None else "?"
    why = f" - {lease.waiting_reason}" if lease.waiting_reason else ""
    # Rich markup: the reason comes from the controller and may hold brackets.
    return escape(f"lease {lease.id} queued at position {position}, waiting {waited_s:.0f}s{why}")


def await_grant(client: PoolClient, lease: LeaseOut) -> LeaseOut:
    """Wait for a queued lease with a live status line, heartbeating it.

    Ctrl-C or SIGTERM cancels the request rather than leaving it queued for its whole ttl.
    """
    if lease.state != "queued":
        return lease
    with terminate_interrupts():
        return _await_grant(client, lease)


def _await_grant(client: PoolClient, lease: LeaseOut) -> LeaseOut:
    console = stderr_console()
    started = time.monotonic()
    try:
        if console.is_terminal:
            with console.status(_wait_text(lease, 0.0)) as status:
                return _checked(
                    client.wait_for_grant(
                        lease.id,
                        on_update=lambda now: status.update(
                            _wait_text(now, time.monotonic() - started)
                        ),
                    )
                )
        seen: set[tuple[int | None, str | None]] = set()

        def log_change(now: LeaseOut) -> None:
            key = (now.queue_position, now.waiting_reason)
            if now.state == "queued" and key not in seen:
                seen.add(key)
                note(_wait_text(now, time.monotonic() - started))

        return _checked(client.wait_for_grant(lease.id, on_update=log_change))
    except KeyboardInterrupt as interrupt:
        cancel(client, lease.id)
        raise typer.Exit(exit_status_of(interrupt)) from None


def _checked(lease: LeaseOut) -> LeaseOut:
    if lease.state in ("released", "preempted"):
        raise CommandFailed(
            f"lease {lease.id} ended while queued: {lease.release_reason or lease.state}"
        )
    return lease


def cancel(client: PoolClient, lease_id: str) -> None:
    try:
        client.release_lease(lease_id)
        note(f"cancelled lease {lease_id}")
    except (ApiError, ControllerUnreachable) as exc:
        note(f"[yellow]could not cancel lease {lease_id}: {escape(str(exc))}[/yellow]")


def granted_text(lease: LeaseOut) -> str:
    """One line saying what was granted where."""
    pieces = []
    for piece in lease.slices:
        size = (
            "whole GPU" if piece.whole else f"{piece.compute_pct}% + {format_mib(piece.memory_mib)}"
        )
        pieces.append(f"{size} of {piece.node}:{piece.gpu_index} ({piece.gpu_uuid})")
    return f"lease {lease.id} granted: " + ("; ".join(pieces) or "no slices")


def _candidate_memories(client: PoolClient, request: LeaseCreate) -> list[int] | None:
    """Memory of the GPUs the request could land on (None: this token may not list GPUs)."""
    try:
        gpus = client.gpus()
    except ApiError:
        return None
    models = [m.lower() for m in request.gpu_models]
    return [
        g.memory_mib
        for g in gpus
        if (request.node is None or g.node == request.node)
        and (not models or any(want in g.model.lower() for want in models))
    ]


def stated_request(
    client: PoolClient, request: LeaseCreate, memory_given: str | None
) -> tuple[LeaseCreate, str]:
    """The request with its defaults made explicit, and one line saying what will be asked,
    shown before anything is granted: a default the user did not see is a surprise."""
    count = f"{request.gpus} slice{'s' if request.gpus > 1 else ''}"
    if request.physical:
        return request, f"asked for {request.gpus} whole physical GPU(s)"
    memory_mib = request.memory_mib()
    memory = ""
    if memory_mib is not None and memory_given is not None:
        memory = f"memory {describe_memory(memory_given)}"
    if request.compute_pct is not None and memory_mib is None:
        memory = (
            f"memory in proportion: {request.compute_pct} % of the GPU's "
            f"({_share_example(client, request, request.compute_pct)}; --memory to choose)"
        )
    if request.compute_pct is None and memory_mib is None:
        return request, (
            f"asked for {count}, each all of a GPU: 100 % compute and all its memory "
            "(give --compute and/or --memory for less)"
        )
    if request.compute_pct is None and memory_mib is not None:
        memories = _candidate_memories(client, request)
        if not memories:
            return request, (
                f"asked for {count}: {memory}; compute in proportion to the memory, "
                "decided by the controller (--compute to choose)"
            )
        pct = compute_for_memory(memory_mib, memories)
        holding = [m for m in memories if m >= memory_mib]
        of = f" of a GPU of {format_size(min(holding))}" if holding else ""
        request = request.model_copy(update={"compute_pct": pct})
        return request, (
            f"asked for {count}: {memory}, compute {pct} % (the memory's part{of}, rounded up; "
            "--compute to choose)"
        )
    return request, f"asked for {count}: compute {request.compute_pct} %, {memory}"


def _share_example(client: PoolClient, request: LeaseCreate, pct: int) -> str:
    memories = _candidate_memories(client, request)
    if not memories:
        return "the memory follows the GPU it lands on"
    gpu = max(memories)
    return f"{format_size(max(1, -(-gpu * pct // 100)))} of a GPU of {format_size(gpu)}"


def ttl_text(ttl_s: float) -> str:
    """A ttl as people read it: '1 h (3600 s)', '30 s'."""
    if ttl_s >= 3600 and ttl_s % 3600 == 0:
        return f"{ttl_s / 3600:g} h ({ttl_s:g} s)"
    if ttl_s >= 60 and ttl_s % 60 == 0:
        return f"{ttl_s / 60:g} min ({ttl_s:g} s)"
    return f"{ttl_s:g} s"


CREATE_HELP = (
    "Ask for GPUs: slices (--compute, --memory) or whole GPUs (--physical).\n\n"
    "Memory: 20Gi = 20 GiB (binary), 20G = 20 GB = 18.6 GiB (decimal), as Kubernetes writes "
    "them. Given alone, memory takes the same part of the GPU's compute (1Gi of an 80 GiB "
    "GPU: 2 %), and compute the same part of its memory; what will be asked is printed first."
    "\n\n"
    "The lease outlives this command: renew it within its ttl (--ttl, default 1 h here, since "
    "a person renews it; programs using the SDK or `gpupool run` heartbeat on their own and "
    "get the controller's --lease-ttl, 30 s) with `gpupool lease renew ID`, and give it back "
    "with `gpupool lease release ID`."
)


@app.command("create", help=CREATE_HELP)
def create(
    ctx: typer.Context,
    gpus: Annotated[int, typer.Option("--gpus", "-n", help="How many GPUs (slices).")] = 1,
    compute: Annotated[
        str | None,
        typer.Option("--compute", "-c", help="Compute share of each GPU, e.g. 25%."),
    ] = None,
    memory: Annotated[
        str | None,
        typer.Option("--memory", "-m", help="Memory on each GPU, e.g. 20GiB or 512MiB."),
    ] = None,
    physical: Annotated[
        bool, typer.Option("--physical", help="Whole, exclusive GPUs from the physical pool.")
    ] = False,
    priority: Annotated[int, typer.Option("--priority", "-p", help="0..1000, higher first.")] = 0,
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant", "-t", help="Tenant to charge (default: the token's, else 'default')."
        ),
    ] = None,
    node: Annotated[str | None, typer.Option("--node", help="Only GPUs of this node.")] = None,
    gpu_model: Annotated[
        str | None, typer.Option("--gpu-model", help="Allowed models, e.g. H100,A100.")
    ] = None,
    ttl: Annotated[
        float,
        typer.Option(
            "--ttl",
            help="Seconds the lease lives without a renewal (gpupool lease renew ID).",
        ),
    ] = LEASE_TTL_S,
    holder: Annotated[
        str | None, typer.Option("--holder", help="Who holds it (default: user@host).")
    ] = None,
    wait: Annotated[
        bool,
        typer.Option("--wait/--no-wait", help="Wait here until granted, or print it queued."),
    ] = True,
    queue: Annotated[
        bool,
        typer.Option(
            "--queue/--no-queue",
            help="Queue when it does not fit now, or fail at once (exit 2).",
        ),
    ] = True,
    locality: Annotated[
        str | None,
        typer.Option(
            "--locality",
            help="local (this server only), any, or node=NAME; default: this server first.",
        ),
    ] = None,
    max_wait: Annotated[
        float | None,
        typer.Option("--max-wait", help="Give up with the reason after this many seconds."),
    ] = None,
    cpu: CpuOption = None,
    host_memory: HostMemoryOption = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    request = build_request(
        gpus=gpus,
        compute=compute,
        memory=memory,
        physical=physical,
        priority=priority,
        tenant=tenant,
        node=node,
        gpu_models=gpu_model,
        holder=holder or default_holder(),
        ttl_s=ttl,
        wait=queue,
        locality=locality,
        max_wait_s=max_wait,
        cpu=cpu,
        host_memory=host_memory,
    )
    with cli_context(ctx).client() as client:
        request, asking = stated_request(client, request, memory)
        lease = client.create_lease(request)
        # Said once the controller has taken the request (a refusal stays one line), and
        # before a queued request waits for its grant.
        note(escape(f"{asking}; kept {ttl_text(request.ttl_s or ttl)} without a renewal"))
        if wait:
            lease = await_grant(client, lease)
    show(output, lease, lease_detail(lease))
    if lease.state == "queued":
        note(
            f"lease {lease.id} is queued at position {lease.queue_position}; "
            f"it is kept for {ttl_text(lease.ttl_s)} without `gpupool lease renew {lease.id}`"
        )
    else:
        note(
            f"renew within {ttl_text(lease.ttl_s)} with `gpupool lease renew {lease.id}`, "
            f"give it back with `gpupool lease release {lease.id}`"
        )


@app.command("ls")
def list_leases(
    ctx: typer.Context,
    state: Annotated[
        str | None, typer.Option("--state", help="Only this state (or 'all').")
    ] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", "-t")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Only leases on this GPU.")] = None,
    node: Annotated[str | None, typer.Option("--node", help="Only leases on this node.")] = None,
    every: Annotated[
        bool, typer.Option("--all", "-a", help="Ended leases too (same as --state all).")
    ] = False,
    limit: Annotated[int | None, typer.Option("--limit", help="At most this many.")] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """List live leases (granted, active, queued...)."""
    if every and state is not None and state != "all":
        raise BadInput("give --all or --state, not both")
    if limit is not None and limit < 1:
        raise BadInput(f"--limit must be at least 1, got {limit}")
    with cli_context(ctx).client() as client:
        found = client.leases(
            state="all" if every else state, tenant=tenant, gpu=gpu, node=node, limit=limit
        )
    show(output, found, leases_table(found))


@app.command("show")
def show_lease(
    ctx: typer.Context,
    lease_id: Annotated[str, typer.Argument(metavar="ID")],
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Show one lease and its slices."""
    with cli_context(ctx).client() as client:
        lease = client.lease(lease_id)
    show(output, lease, lease_detail(lease))


@app.command("renew")
def renew(
    ctx: typer.Context,
    lease_ids: Annotated[list[str], typer.Argument(metavar="ID...")],
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Heartbeat leases so they live another ttl."""
    renewed = []
    with cli_context(ctx).client() as client:
        for lease_id in lease_ids:
            lease = client.heartbeat_lease(lease_id)
            if lease.state in ("released", "preempted"):
                raise CommandFailed(
                    f"lease {lease.id} is {lease.state}: {lease.release_reason or 'ended'}"
                )
            renewed.append(lease)
    if output is OutputFormat.JSON:
        print_json(renewed)
        return
    for lease in renewed:
        typer.echo(f"renewed lease {lease.id} ({lease.state}) for {lease.ttl_s:g} s")


@app.command("release")
def release(
    ctx: typer.Context,
    lease_ids: Annotated[list[str], typer.Argument(metavar="ID...")],
    operator: Annotated[
        bool,
        typer.Option("--operator", help="Take someone else's lease away, as an operator."),
    ] = False,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Give leases back (a queued one is cancelled). Releasing twice is harmless."""
    released = []
    with cli_context(ctx).client() as client:
        give_back = client.release_lease_as_operator if operator else client.release_lease
        for lease_id in lease_ids:
            released.append(give_back(lease_id))
    if output is OutputFormat.JSON:
        print_json(released)
        return
    for lease in released:
        typer.echo(f"released lease {lease.id}")


@app.command("resize")
def resize(
    ctx: typer.Context,
    lease_id: Annotated[str, typer.Argument(metavar="ID")],
    compute: Annotated[
        str | None, typer.Option("--compute", "-c", help="New compute share of each GPU: 50%.")
    ] = None,
    memory: Annotated[
        str | None, typer.Option("--memory", "-m", help="New memory on each GPU: 40GiB.")
    ] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Resize a running remote lease; its program goes on (memory changes in place, a new
    compute share moves it to a fresh worker with the new limits)."""
    if compute is None and memory is None:
        raise BadInput("give --compute, --memory or both")
    compute_pct = None if compute is None else parse_compute_pct(compute)
    memory_text = None if memory is None else f"{parse_memory_mib(memory)}MiB"
    with cli_context(ctx).client() as client:
        lease = client.resize_lease(lease_id, compute_pct=compute_pct, memory=memory_text)
    show(output, lease, lease_detail(lease))
    if lease.state == "migrating":
        note(f"lease {lease.id} moves to a worker with the new limits; its program only pauses")


@app.command("migrate")
def migrate(
    ctx: typer.Context,
    lease_id: Annotated[str, typer.Argument(metavar="ID")],
    to: Annotated[
        str | None,
        typer.Option("--to", help="A GPU uuid or a node name (default: wherever has room)."),
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="Wait until the state has moved.")
    ] = True,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Move a running remote lease to another GPU or server while its program runs."""
    with cli_context(ctx).client() as client:
        lease = client.migrate_lease(lease_id, to=to)
        note(f"lease {lease.id} migrating to {', '.join(s.gpu_uuid for s in lease.slices)}")
        if wait:
            lease = await_moved(client, lease)
    show(output, lease, lease_detail(lease))


MOVE_TIMEOUT_S = 600.0


def await_moved(client: PoolClient, lease: LeaseOut) -> LeaseOut:
    """Poll until a migrating lease runs on its new workers (or ends)."""
    started = time.monotonic()
    while lease.state == "migrating":
        if time.monotonic() - started > MOVE_TIMEOUT_S:
            raise CommandFailed(f"lease {lease.id} still migrating after {MOVE_TIMEOUT_S:.0f} s")
        time.sleep(0.3)
        lease = client.lease(lease.id)
    if lease.state == "released":
        raise CommandFailed(f"lease {lease.id} ended while it moved: {lease.release_reason}")
    note(f"lease {lease.id} moved in {time.monotonic() - started:.1f} s")
    return lease


def show_queue(ctx: typer.Context, output: OutputOption = OutputFormat.TABLE) -> None:
    with cli_context(ctx).client() as client:
        entries = client.queue()
    show(output, entries, queue_table(entries))
