"""`gpupool nodes` and `gpupool node ...`: the GPU servers of the pool."""

from __future__ import annotations

from typing import Annotated

import typer

from gpupool.cli.context import cli_context
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


@app.command("remove")
def remove_node(ctx: typer.Context, name: NodeArgument) -> None:
    """Forget a node; its leases end (an agent that is still running registers it again)."""
    with cli_context(ctx).client() as client:
        client.remove_node(name)
    typer.echo(f"removed node {name}")
