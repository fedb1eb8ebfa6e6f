"""`gpupool nodes` and `gpupool node ...`: the GPU servers of the pool."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from gpupool.cli.context import cli_context
from gpupool.cli.errors import CommandFailed
from gpupool.cli.output import OutputFormat, OutputOption, gpus_table, nodes_table, print_json, show

app = typer.Typer(no_args_is_help=True)

NodeArgument = Annotated[str, typer.Argument(metavar="NAME")]


def list_nodes(ctx: typer.Context, output: OutputOption = OutputFormat.TABLE) -> None:
    with cli_context(ctx).client() as client:
        found = client.nodes()
    show(output, found, nodes_table(found))


@app.command("show")
def show_node(
    ctx: typer.Context, name: NodeArgument, output: OutputOption = OutputFormat.TABLE
) -> None:
    """Show one node and its GPUs."""
    with cli_context(ctx).client() as client:
        node = client.node(name)
        gpus = client.gpus(node=name)
    if output is OutputFormat.JSON:
        print_json(
            {
                "node": node.model_dump(mode="json"),
                "gpus": [g.model_dump(mode="json") for g in gpus],
            }
        )
        return
    show(output, node, nodes_table([node]))
    show(output, gpus, gpus_table(gpus, title=f"GPUs of {name}"))


@app.command("drain")
def drain_node(
    ctx: typer.Context,
    name: NodeArgument,
    wait: Annotated[
        bool,
        typer.Option("--wait/--no-wait", help="Wait until no lease is left on the node."),
    ] = True,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Give up waiting after this many seconds.")
    ] = 3600.0,
) -> None:
    """Take a node out for maintenance: no new leases, remote leases migrate away now, direct
    leases are waited for. Then restart or upgrade its agent, and `gpupool node undrain`."""
    with cli_context(ctx).client() as client:
        moving = client.drain_node(name)
        typer.echo(f"draining node {name}: {len(moving)} remote lease(s) migrating away")
        if not wait:
            return
        started = time.monotonic()
        while True:
            # A moving lease already names its new GPUs: wait for its state to arrive too.
            left = client.leases(node=name) + [
                lease for lease in map(client.lease, moving) if lease.state == "migrating"
            ]
            if not left:
                break
            if time.monotonic() - started > timeout:
                raise CommandFailed(
                    f"node {name} still holds {len(left)} lease(s) after {timeout:g} s: "
                    + ", ".join(f"{lease.id} ({lease.state})" for lease in left[:5])
                )
            time.sleep(0.5)
    typer.echo(f"node {name} is empty after {time.monotonic() - started:.1f} s")


@app.command("undrain")
def undrain_node(ctx: typer.Context, name: NodeArgument) -> None:
    """Return a drained node to the pool."""
    with cli_context(ctx).client() as client:
        client.undrain_node(name)
    typer.echo(f"node {name} takes leases again")


@app.command("remove")
def remove_node(ctx: typer.Context, name: NodeArgument) -> None:
    """Forget a node; its leases end (an agent that is still running registers it again)."""
    with cli_context(ctx).client() as client:
        client.remove_node(name)
    typer.echo(f"removed node {name}")
