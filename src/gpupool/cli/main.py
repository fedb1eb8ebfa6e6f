"""The `gpupool` command: wires the resource commands and turns failures into exit codes."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from gpupool import __version__
from gpupool.cli import contexts, events, gpus, k8s, leases, nodes, pool, run, sim, tenants, tokens
from gpupool.cli.context import CliContext, default_actor
from gpupool.cli.errors import BadInput, describe
from gpupool.client.config import ConfigError
from gpupool.client.sdk import TOKEN_ENV, URL_ENV, resolve_url

DEBUG_ENV = "GPUPOOL_DEBUG"


def print_error(message: str) -> None:
    """One line on stderr: scripts grep it, people read it; never a traceback."""
    typer.secho("error: ", fg=typer.colors.RED, bold=True, err=True, nl=False)
    typer.echo(" ".join(message.split()), err=True)


def _is_framework_signal(exc: BaseException) -> bool:
    """Exit, Abort and usage errors belong to typer/click, which print and exit themselves."""
    module = type(exc).__module__
    return module.startswith(("typer", "click"))


class PoolGroup(TyperGroup):
    """The root group: every command runs inside it, so its `invoke` sees every failure."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            if _is_framework_signal(exc) or isinstance(exc, BrokenPipeError):
                raise
            known = describe(exc)
            if known is None:
                if os.environ.get(DEBUG_ENV):
                    raise
                message = f"unexpected {type(exc).__name__}: {exc} (set {DEBUG_ENV}=1 for details)"
                code = 1
            else:
                message, code = known
            print_error(message)
            raise typer.Exit(code) from None


app = typer.Typer(
    cls=PoolGroup,
    name="gpupool",
    help="Pool every GPU of a cluster: slices or whole GPUs on demand, from any server.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpupool {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    ctx: typer.Context,
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            envvar=URL_ENV,
            help="Controller URL (default: the current context's, `gpupool context`, else "
            "http://127.0.0.1:8900); several controllers of one pool comma-separated, tried "
            "in turn.",
            show_default=False,
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar=TOKEN_ENV,
            help="API token (gpp_...); default: the current context's token file (`gpupool "
            "context`), else ~/.config/gpupool/token.",
            show_default=False,
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    try:
        chosen = resolve_url(url)
    except ConfigError as exc:
        raise BadInput(str(exc)) from None
    except ValueError as exc:
        raise BadInput(f"--url / {URL_ENV}: {exc}") from None
    if token is not None:
        token = token.strip()
        if not token:
            raise BadInput("--token is empty")
        # Commands this one starts (gpupool run's program, agents) act with the same token.
        os.environ[TOKEN_ENV] = token
    ctx.obj = CliContext(url=chosen, actor=default_actor(), token=token)


app.add_typer(leases.app, name="lease", help="Ask for GPU slices or whole GPUs and give them back.")
app.command("queue", help="Show the requests waiting for GPUs, in grant order.")(leases.show_queue)
app.command("nodes", help="List the GPU servers of the pool.")(nodes.list_nodes)
app.add_typer(nodes.app, name="node", help="Look at or remove one GPU server.")
app.command("gpus", help="List the GPUs of the pool.")(gpus.list_gpus)
app.add_typer(gpus.app, name="gpu", help="Look at one GPU, switch its mode, drain or isolate it.")
app.add_typer(tenants.app, name="tenant", help="Tenants, their quotas and fair-share weights.")
app.add_typer(tokens.app, name="token", help="API tokens: admin, viewer, agent and tenant.")
app.command("whoami", help="Who the CLI acts as, with its token.")(tokens.whoami)
app.command("events", help="What happened in the pool, newest last.")(events.list_events)
app.command("pool", help="The pool at a glance: capacity, grants, queue.")(pool.show_pool)
app.command(
    "run",
    help=run.HELP,
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)(run.run)
app.command(
    "up",
    help="Start a pool on this machine: the controller and a local agent; it becomes the "
    "current context, so every command finds it (`gpupool down` stops it).",
)(pool.up)
app.command("down", help="Stop a pool `gpupool up` started: controller, agent, workers.")(pool.down)
app.add_typer(
    contexts.app,
    name="context",
    help="Which pool the commands talk to: show (no argument), ls, use NAME.",
)
app.command("controller", help="Run the controller in the foreground.")(pool.controller)
app.command("agent", help="Run the agent of this GPU server in the foreground.")(pool.agent)
app.command("demo", help="Start a throw-away pool and run two jobs sharing one GPU.")(pool.demo)
app.add_typer(sim.app, name="sim", help="Replay GPU-cluster traces through the scheduler.")
app.add_typer(k8s.app, name="k8s", help="Kubernetes: the scheduler extender and admission webhook.")


def main() -> None:
    app()
