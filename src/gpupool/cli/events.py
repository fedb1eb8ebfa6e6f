"""`gpupool events`: the pool's audit trail, once or followed live."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from gpupool.cli.context import cli_context
from gpupool.cli.errors import BadInput
from gpupool.cli.output import (
    OutputFormat,
    OutputOption,
    event_line,
    events_table,
    show,
    stdout_console,
)
from gpupool.client.sdk import ControllerUnreachable, PoolClient
from gpupool.protocol.v1.api import EventOut

FOLLOW_INTERVAL_S = 1.0


def list_events(
    ctx: typer.Context,
    since: Annotated[
        int | None, typer.Option("--since", help="Only events after this event id.")
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", "-n", help="At most this many.")] = None,
    kind: Annotated[
        str | None, typer.Option("--kind", help="Only this kind; * matches anything, e.g. lease.*")
    ] = None,
    subject: Annotated[
        str | None, typer.Option("--subject", help="Only about this lease, GPU or node.")
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new events until Ctrl-C.")
    ] = False,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    if limit is not None and limit < 1:
        raise BadInput(f"--limit must be at least 1, got {limit}")
    if since is not None and since < 0:
        raise BadInput(f"--since must be an event id (0 or more), got {since}")
    with cli_context(ctx).client() as client:
        found = client.events(since_id=since, limit=limit, kind=kind, subject=subject)
        if not follow:
            show(output, found, events_table(found))
            return
        _follow(client, found, since, kind, subject, output)


def _print_lines(events: list[EventOut], output: OutputFormat) -> None:
    if output is OutputFormat.JSON:
        for event in events:
            typer.echo(event.model_dump_json())
    else:
        console = stdout_console()
        for event in events:
            console.print(event_line(event))


def _follow(
    client: PoolClient,
    first: list[EventOut],
    since: int | None,
    kind: str | None,
    subject: str | None,
    output: OutputFormat,
) -> None:
    """Print events as they come; JSON output is one object per line while following."""
    _print_lines(first, output)
    last = max((e.id for e in first), default=since or 0)
    try:
        while True:
            time.sleep(FOLLOW_INTERVAL_S)
            try:
                fresh = client.events(since_id=last, kind=kind, subject=subject)
            except ControllerUnreachable:
                continue
            fresh = [e for e in fresh if e.id > last]
            _print_lines(fresh, output)
            last = max((e.id for e in fresh), default=last)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
