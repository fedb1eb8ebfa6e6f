"""`gpupool gpus` and `gpupool gpu ...`: see GPUs, move them between pools, take them out."""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Annotated, Literal

import typer

from gpupool.cli.context import cli_context
from gpupool.cli.errors import EXIT_BAD_INPUT, CommandFailed
from gpupool.cli.output import (
    OutputFormat,
    OutputOption,
    gpu_detail,
    gpus_table,
    print_json,
    show,
    stderr_console,
)
from gpupool.client.sdk import ApiError, PoolClient
from gpupool.core.errors import quoted
from gpupool.protocol.v1.api import GpuOut, LeaseOut

app = typer.Typer(no_args_is_help=True)


class PoolMode(StrEnum):
    VIRTUAL = "virtual"
    PHYSICAL = "physical"


class ModeFilter(StrEnum):
    VIRTUAL = "virtual"
    PHYSICAL = "physical"
    DRAINING = "draining"
    ISOLATED = "isolated"


GpuArgument = Annotated[
    str,
    typer.Argument(metavar="GPU", help="UUID, a unique prefix of it, or NODE:INDEX."),
]


def find_gpu(client: PoolClient, ref: str) -> GpuOut:
    """The GPU a user means: its full UUID, a unique UUID prefix, or `node:index`."""
    try:
        return client.gpu(ref)
    except ApiError as exc:
        if exc.status != 404:
            raise
    every = client.gpus()
    node, _, index = ref.rpartition(":")
    matches = [
        g for g in every if node and index.isdigit() and (g.node, g.index) == (node, int(index))
    ]
    if not matches:
        matches = [g for g in every if g.uuid.lower().startswith(ref.lower())]
    if not matches:
        raise CommandFailed(
            f"no GPU {quoted(ref)} in the pool (see `gpupool gpus`)", EXIT_BAD_INPUT
        )
    if len(matches) > 1:
        names = ", ".join(g.uuid for g in matches[:4])
        raise CommandFailed(f"{quoted(ref)} matches {len(matches)} GPUs: {names}", EXIT_BAD_INPUT)
    return matches[0]


def _report(output: OutputFormat, gpu: GpuOut, done: str) -> None:
    if output is OutputFormat.JSON:
        print_json(gpu)
        return
    if gpu.mode == "draining":
        target = (
            f", then it becomes {gpu.target_mode}"
            if gpu.target_mode
            else f"; it stays drained until `gpupool gpu mode {gpu.uuid} virtual|physical`"
        )
        typer.echo(
            f"GPU {gpu.uuid} is draining: no new leases; {len(gpu.leases)} lease(s) to end{target}"
        )
    else:
        typer.echo(f"GPU {gpu.uuid} {done}: now {gpu.mode}")


def list_gpus(
    ctx: typer.Context,
    node: Annotated[str | None, typer.Option("--node", help="Only GPUs of this node.")] = None,
    mode: Annotated[
        ModeFilter | None, typer.Option("--mode", help="Only GPUs in this mode.")
    ] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    with cli_context(ctx).client() as client:
        found = client.gpus(node=node, mode=None if mode is None else mode.value)
    show(output, found, gpus_table(found))


@app.command("show")
def show_gpu(
    ctx: typer.Context, ref: GpuArgument, output: OutputOption = OutputFormat.TABLE
) -> None:
    """Show one GPU: mode, grants, leases and telemetry."""
    with cli_context(ctx).client() as client:
        gpu = find_gpu(client, ref)
    show(output, gpu, gpu_detail(gpu))


@app.command("mode")
def set_mode(
    ctx: typer.Context,
    ref: GpuArgument,
    mode: Annotated[PoolMode, typer.Argument(help="virtual (sliced, shared) or physical (whole).")],
    wait: Annotated[
        bool,
        typer.Option(
            "--wait", help="While it drains, show the leases it waits for; end when done."
        ),
    ] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", help="With --wait: give up after this many seconds.")
    ] = 3600.0,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Move a GPU to the virtual or the physical pool; a busy GPU drains first."""
    target: Literal["virtual", "physical"] = "virtual" if mode is PoolMode.VIRTUAL else "physical"
    with cli_context(ctx).client() as client:
        gpu = client.set_gpu_mode(find_gpu(client, ref).uuid, target)
        if wait and gpu.mode == "draining":
            gpu = wait_for_drain(client, gpu, target, timeout)
    _report(output, gpu, "switched")


DRAIN_POLL_S = 1.0


def wait_for_drain(client: PoolClient, gpu: GpuOut, target: str, timeout_s: float) -> GpuOut:
    """Show a draining GPU's remaining leases until it reaches `target` (or the time is up)."""
    from rich.live import Live

    started = time.monotonic()
    with Live(console=stderr_console(), transient=True, refresh_per_second=4) as live:
        while gpu.mode == "draining":
            waited = time.monotonic() - started
            if waited > timeout_s:
                raise CommandFailed(
                    f"GPU {gpu.uuid} still drains after {timeout_s:g} s: "
                    f"{len(gpu.leases)} lease(s) hold it ({', '.join(gpu.leases)})",
                    1,
                )
            live.update(
                f"[yellow]draining[/yellow] {gpu.uuid} to {target}: waiting for "
                f"{len(gpu.leases)} lease(s) {', '.join(gpu.leases)} ({waited:.0f}s)"
            )
            time.sleep(DRAIN_POLL_S)
            gpu = client.gpu(gpu.uuid)
    return gpu


@app.command("drain")
def drain(ctx: typer.Context, ref: GpuArgument, output: OutputOption = OutputFormat.TABLE) -> None:
    """Take no new leases on a GPU; the running ones finish. `gpu mode` brings it back."""
    with cli_context(ctx).client() as client:
        gpu = client.drain_gpu(find_gpu(client, ref).uuid)
    _report(output, gpu, "drained")


@app.command("isolate")
def isolate(
    ctx: typer.Context,
    ref: GpuArgument,
    reason: Annotated[str, typer.Option("--reason", "-r", help="Why, shown to everyone.")] = (
        "isolated by an operator"
    ),
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Take a faulty GPU out of service at once."""
    with cli_context(ctx).client() as client:
        gpu = client.isolate_gpu(find_gpu(client, ref).uuid, reason)
        held = client.leases(gpu=gpu.uuid)
    if output is OutputFormat.JSON:
        print_json(gpu)
        return
    typer.echo(f"GPU {gpu.uuid} isolated: it takes no new leases. {isolation_effect(held)}")


def isolation_effect(leases: list[LeaseOut]) -> str:
    """What isolating a GPU does to the leases on it: remote ones move away while their
    programs run; direct ones run on the GPU itself and keep running there until released."""
    moving = [lease.id for lease in leases if lease.access == "remote"]
    staying = [lease.id for lease in leases if lease.access != "remote"]
    if not moving and not staying:
        return "No lease was on it."
    said = []
    if moving:
        said.append(f"{len(moving)} remote lease(s) move to other GPUs while they run")
    if staying:
        said.append(
            f"{len(staying)} direct lease(s) keep running on it until released "
            f"({', '.join(staying[:5])}{', ...' if len(staying) > 5 else ''}; "
            "`gpupool lease release --operator ID` ends one)"
        )
    return "; ".join(said) + "."


@app.command("clear")
def clear(ctx: typer.Context, ref: GpuArgument, output: OutputOption = OutputFormat.TABLE) -> None:
    """Put an isolated GPU back in service, in the mode it had."""
    with cli_context(ctx).client() as client:
        gpu = client.clear_gpu(find_gpu(client, ref).uuid)
    _report(output, gpu, "back in service")
