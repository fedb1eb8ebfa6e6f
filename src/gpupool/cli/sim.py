"""`gpupool sim`: replay traces through the pool's own scheduler, without a controller."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from gpupool.cli.errors import BadInput
from gpupool.cli.output import OutputFormat, OutputOption, print_json, stdout_console
from gpupool.core.placement import DEFAULT_POLICY, POLICY_NAMES, policy_named
from gpupool.sim import generate, team
from gpupool.sim.fillup import run_fillup
from gpupool.sim.timeline import run_timeline
from gpupool.sim.trace import read_nodes, read_pods, write_nodes, write_pods

HELP = (
    "Replay a GPU-cluster trace through gpupool's scheduler, or size a pool for a team.\n\n"
    "gpupool sim fillup --nodes nodes.csv --pods pods.csv --policy default --seed 1 -o json\n\n"
    "gpupool sim --team 55"
)

app = typer.Typer(help=HELP, no_args_is_help=False, invoke_without_command=True)

NodesOption = Annotated[
    Path, typer.Option("--nodes", help="Nodes CSV: sn,cpu_milli,memory_mib,gpu,model.")
]
PodsOption = Annotated[
    Path,
    typer.Option(
        "--pods",
        help="Pods CSV: name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,qos,pod_phase,"
        "creation_time,deletion_time,scheduled_time].",
    ),
]
PolicyOption = Annotated[
    str,
    typer.Option(
        "--policy",
        help=f"Placement policy: default ({DEFAULT_POLICY}), {', '.join(POLICY_NAMES)}.",
    ),
]
SeedOption = Annotated[int, typer.Option("--seed", help="Seed of shuffling and sampling.")]


def _check_policy(name: str) -> None:
    try:
        policy_named(name)
    except Exception as exc:
        raise BadInput(str(exc)) from None


@app.callback()
def sim(
    ctx: typer.Context,
    team_size: Annotated[
        int | None,
        typer.Option(
            "--team",
            help="Size a pool for N engineers: fewest GPUs keeping the p95 slice wait < 60 s.",
        ),
    ] = None,
    days: Annotated[int, typer.Option("--days", help="Working days to simulate.")] = 5,
    idle_release: Annotated[
        float | None,
        typer.Option(
            "--idle-release",
            help="Elastic slices: a notebook's slice goes back to the pool this many seconds "
            "after each burst of GPU work (swapped to host memory until the next one).",
        ),
    ] = None,
    seed: SeedOption = 0,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    if team_size is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)
    if team_size < 1 or days < 1:
        raise BadInput("--team and --days must be at least 1")
    if idle_release is not None and idle_release <= 0:
        raise BadInput(f"--idle-release must be positive, got {idle_release:g}")
    result = team.report(team_size, days, seed, idle_release_s=idle_release)
    if output is OutputFormat.JSON:
        print_json(result)
        return
    _print_team(result)


@app.command("fillup")
def fillup(
    nodes: NodesOption,
    pods: PodsOption,
    policy: PolicyOption = "default",
    seed: SeedOption = 0,
    keep_order: Annotated[
        bool,
        typer.Option("--keep-order", help="Replay the pods exactly as given, once each."),
    ] = False,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Fill-up: pods arrive one by one and never leave, up to 130 % of capacity asked."""
    _check_policy(policy)
    result = run_fillup(read_nodes(nodes), read_pods(pods), policy, seed, keep_order)
    if output is OutputFormat.JSON:
        print_json(result)
        return
    table = Table(title=f"fill-up, policy {policy}, seed {seed}, {result['capacity_gpus']} GPUs")
    for column in ("arrived %", "allocated %", "fragmented idle %"):
        table.add_column(column, justify="right")
    for point in result["curve"]:
        if point["arrived_pct"] % 10 == 0:
            table.add_row(
                str(point["arrived_pct"]),
                f"{point['allocated_pct']:.1f}",
                f"{point['frag_pct']:.1f}",
            )
    stdout_console().print(table)


@app.command("timeline")
def timeline(
    nodes: NodesOption,
    pods: PodsOption,
    policy: PolicyOption = "default",
    seed: SeedOption = 0,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Timeline: pods arrive and leave at their trace times; waits, completions, use."""
    _check_policy(policy)
    result = run_timeline(read_nodes(nodes), read_pods(pods), policy, seed)
    if output is OutputFormat.JSON:
        print_json(result)
        return
    table = Table(title=f"timeline, policy {policy}, {result['capacity_gpus']} GPUs")
    table.add_column("")
    for column in ("mean", "p50", "p95", "p99", "max"):
        table.add_column(column, justify="right")
    for label, key in (("wait s", "wait_s"), ("completion s", "completion_s")):
        values = result[key]
        table.add_row(label, *(f"{values[c]:.1f}" for c in ("mean", "p50", "p95", "p99", "max")))
    stdout_console().print(table)
    stdout_console().print(
        f"{result['started']} of {result['pods']} pods started; mean GPU utilisation "
        f"{result['mean_utilisation_pct']:.1f} % over {result['makespan_s'] / 3600:.1f} h"
    )


@app.command("generate")
def generate_trace(
    out_dir: Annotated[Path, typer.Argument(help="Folder for nodes.csv and pods.csv.")],
    servers: Annotated[int, typer.Option("--servers", help="GPU servers.")] = 200,
    pods: Annotated[int, typer.Option("--pods", help="Pods.")] = 2000,
    mix: Annotated[
        str, typer.Option("--mix", help=f"Pod mix: {', '.join(generate.MIXES)}.")
    ] = "openb",
    hours: Annotated[
        float, typer.Option("--hours", help="Spread creations over this many hours (0: none).")
    ] = 0.0,
    seed: SeedOption = 0,
) -> None:
    """Write a synthetic trace shaped like public production GPU-cluster traces."""
    if servers < 1 or pods < 1 or hours < 0:
        raise BadInput("--servers and --pods must be at least 1, --hours not negative")
    if mix not in generate.MIXES:
        raise BadInput(f"unknown --mix {mix!r} (one of {', '.join(generate.MIXES)})")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_nodes(out_dir / "nodes.csv", generate.cluster(servers, seed))
    write_pods(out_dir / "pods.csv", generate.pods(pods, mix, seed + 1, hours * 3600))
    typer.echo(f"wrote {out_dir / 'nodes.csv'} and {out_dir / 'pods.csv'}")


@app.command("policies")
def list_policies() -> None:
    """The placement policies and what each prefers."""
    table = Table()
    table.add_column("policy")
    table.add_column("prefers")
    for name in POLICY_NAMES:
        label = f"{name} (default)" if name == DEFAULT_POLICY else name
        table.add_row(label, policy_named(name).summary)
    stdout_console().print(table)


def _print_team(result: dict[str, Any]) -> None:
    console = stdout_console()
    console.print(
        f"{result['engineers']} engineers, {result['days']} days: "
        f"[bold]{result['pooled_gpus']} pooled GPUs[/bold] keep the p95 wait for a slice at "
        f"{result['p95_slice_wait_s']:.0f} s (target < {result['target_p95_slice_wait_s']:.0f} s),"
        f" against {result['dedicated_gpus']} dedicated "
        f"({result['dedicated_per_pooled']}x); utilisation {result['pooled_utilisation_pct']} % "
        f"pooled vs {result['dedicated_utilisation_pct']} % dedicated"
    )
    table = Table(title="pool sizes tried")
    for column in ("GPUs", "p50 slice wait s", "p95 slice wait s", "p95 training wait s"):
        table.add_column(column, justify="right")
    for t in result["tried"]:
        table.add_row(
            str(t["gpus"]),
            f"{t['p50_slice_wait_s']:.0f}",
            f"{t['p95_slice_wait_s']:.0f}",
            f"{t['p95_training_wait_s']:.0f}",
        )
    console.print(table)
