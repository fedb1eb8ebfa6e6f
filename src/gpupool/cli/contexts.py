"""`gpupool context [ls|use NAME]`: which pool the commands talk to, and switching it."""

from __future__ import annotations

import os
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from gpupool.cli.context import cli_context
from gpupool.cli.errors import BadInput
from gpupool.cli.output import OutputFormat, OutputOption, print_json, stdout_console
from gpupool.client import config
from gpupool.client.sdk import TOKEN_ENV, TOKEN_FILE_ENV, URL_ENV

app = typer.Typer(no_args_is_help=False, invoke_without_command=True)


def _named(source: object, name: str) -> bool:
    """A click ParameterSource by name (typer may vendor its own click)."""
    return getattr(source, "name", None) == name


def _url_source(ctx: typer.Context) -> str:
    """Where the URL the commands use comes from, in the order they look."""
    root = ctx.find_root()
    source = root.get_parameter_source("url")
    if _named(source, "COMMANDLINE"):
        return "--url"
    if _named(source, "ENVIRONMENT"):
        return f"${URL_ENV}"
    chosen = config.current()
    return f"context '{chosen.name}'" if chosen is not None else "the default"


def _token_source(ctx: typer.Context, url: str) -> str:
    root = ctx.find_root()
    source = root.get_parameter_source("token")
    if _named(source, "COMMANDLINE"):
        return "--token"
    if _named(source, "ENVIRONMENT"):
        return f"${TOKEN_ENV}"
    if os.environ.get(TOKEN_FILE_ENV):
        return f"${TOKEN_FILE_ENV}"
    found = config.context_for(url)
    if found is not None and found.token_file is not None:
        return f"{found.token_file} (context '{found.name}')"
    return "none from a context (~/.config/gpupool/token if it exists)"


@app.callback()
def show_current(ctx: typer.Context, output: OutputOption = OutputFormat.TABLE) -> None:
    """Show the current context and what the commands use: URL and token, and from where
    (precedence: --url/--token > $GPUPOOL_URL/$GPUPOOL_TOKEN > the current context)."""
    if ctx.invoked_subcommand is not None:
        return
    try:
        chosen = config.current()
    except config.ConfigError as exc:
        raise BadInput(str(exc)) from None
    url = cli_context(ctx).url
    if output is OutputFormat.JSON:
        print_json(
            {
                "current_context": chosen.name if chosen else None,
                "url": url,
                "url_from": _url_source(ctx),
                "token_from": _token_source(ctx, url),
                "config": str(config.config_path()),
            }
        )
        return
    if chosen is None:
        typer.echo(f"no current context ({config.config_path()}); `gpupool up` makes one")
    else:
        typer.echo(f"current context: {chosen.name}")
    typer.echo(f"url: {url} (from {_url_source(ctx)})")
    typer.echo(f"token: {_token_source(ctx, url)}")


@app.command("ls")
def list_contexts(output: OutputOption = OutputFormat.TABLE) -> None:
    """List the contexts; the current one is marked with *."""
    loaded = config.load()
    if output is OutputFormat.JSON:
        print_json(
            {
                "current_context": loaded.current,
                "contexts": [
                    {
                        "name": c.name,
                        "url": c.url,
                        "token_file": str(c.token_file) if c.token_file else None,
                        "data_dir": str(c.data_dir) if c.data_dir else None,
                    }
                    for c in sorted(loaded.contexts.values(), key=lambda c: c.name)
                ],
            }
        )
        return
    if not loaded.contexts:
        typer.echo(f"no contexts in {config.config_path()}; `gpupool up` makes one")
        return
    table = Table(title="contexts", title_justify="left")
    for column in ("", "NAME", "URL", "TOKEN FILE", "DATA DIR"):
        table.add_column(column)
    for name in sorted(loaded.contexts):
        c = loaded.contexts[name]
        table.add_row(
            "*" if name == loaded.current else "",
            escape(c.name),
            escape(c.url),
            escape(str(c.token_file)) if c.token_file else "-",
            escape(str(c.data_dir)) if c.data_dir else "-",
        )
    stdout_console().print(table)


@app.command("use")
def use_context(name: Annotated[str, typer.Argument(metavar="NAME")]) -> None:
    """Make NAME the current context: the commands talk to its pool from now on."""
    try:
        chosen = config.use(name)
    except config.ConfigError as exc:
        raise BadInput(str(exc)) from None
    typer.echo(f"current context: {chosen.name} ({chosen.url})")
