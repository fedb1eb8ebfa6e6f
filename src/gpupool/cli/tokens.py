"""`gpupool token ...` and `gpupool whoami`: API tokens, and who the CLI acts as."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

import typer
from rich.table import Table

from gpupool.cli.context import cli_context
from gpupool.cli.errors import BadInput
from gpupool.cli.output import OutputFormat, OutputOption, note, print_json, show, stdout_console
from gpupool.protocol.v1.api import MAX_JOINS, NODE_NAME, Role, TokenCreate, TokenOut
from gpupool.protocol.v1.tokens import new_token

app = typer.Typer(no_args_is_help=True)

ROLES: tuple[Role, ...] = ("admin", "viewer", "agent", "tenant", "join", "scheduler")
_NODE = re.compile(NODE_NAME)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration_s(text: str) -> float:
    """`90`, `30m`, `12h`, `30d`, `2w` as seconds."""
    match = _DURATION.match(text.lower())
    if match is None or float(match.group(1)) <= 0:
        raise BadInput(f"--expires must be a duration such as 12h, 30d or 2w, got {text!r}")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _when(moment: datetime | None) -> str:
    return "-" if moment is None else moment.strftime("%Y-%m-%d %H:%M UTC")


def _scope(token: TokenOut) -> str:
    """Whom a token acts for: its tenant, its node, or the joins a join token has left."""
    if token.tenant:
        return f"tenant {token.tenant}"
    if token.node:
        return f"node {token.node}"
    if token.role == "join":
        return f"{token.joins_left or 0} join(s) left"
    if token.role == "agent":
        return "no node: refused"
    return "-"


def tokens_table(tokens: list[TokenOut]) -> Table:
    table = Table(title="API tokens (secrets are never shown again)", title_justify="left")
    for column in ("ID", "NAME", "ROLE", "SCOPE", "CREATED", "BY", "EXPIRES", "REVOKED"):
        table.add_column(column)
    for t in tokens:
        table.add_row(
            t.id,
            t.name,
            t.role,
            _scope(t),
            _when(t.created_at),
            t.created_by,
            _when(t.expires_at),
            _when(t.revoked_at),
        )
    return table


@app.command("create")
def create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(metavar="NAME", help="Who or what will use it.")],
    role: Annotated[
        str,
        typer.Option(
            "--role",
            help="admin, viewer (reads all), tenant, agent (one node's agent: needs --node), "
            "join (trades itself for agent tokens of new nodes: --max-nodes) or scheduler "
            "(the Kubernetes extender).",
        ),
    ] = "tenant",
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="The tenant a tenant token acts for.")
    ] = None,
    node: Annotated[
        str | None,
        typer.Option("--node", help="The one node an agent token acts for (its --node name)."),
    ] = None,
    max_nodes: Annotated[
        int | None,
        typer.Option("--max-nodes", help="How many new nodes a join token may join (default 1)."),
    ] = None,
    expires: Annotated[
        str | None, typer.Option("--expires", help="Lifetime, e.g. 12h, 30d (default: none).")
    ] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Make a token; its secret is printed once, on stdout, and only its hash is kept."""
    if role not in ROLES:
        raise BadInput(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
    if role == "tenant" and tenant is None:
        raise BadInput("a tenant token needs --tenant NAME")
    if role != "tenant" and tenant is not None:
        raise BadInput(f"a {role} token acts for no one tenant: leave out --tenant")
    if role == "agent" and node is None:
        raise BadInput(
            "an agent token acts for one node: give --node NAME (or make a join token, "
            "--role join --max-nodes N, for agents that join by themselves)"
        )
    if role != "agent" and node is not None:
        raise BadInput(f"only an agent token names a node: leave out --node for a {role} token")
    if node is not None and (len(node) > 128 or not _NODE.match(node)):
        raise BadInput(f"--node must be 1-128 letters, digits, '.', '_' or '-', got {node!r}")
    if role != "join" and max_nodes is not None:
        raise BadInput(f"only a join token has --max-nodes, not a {role} token")
    if max_nodes is not None and not 1 <= max_nodes <= MAX_JOINS:
        raise BadInput(f"--max-nodes must be 1..{MAX_JOINS}, got {max_nodes}")
    lifetime = parse_duration_s(expires) if expires is not None else None
    request = TokenCreate(
        name=name,
        role=role,
        tenant=tenant,
        node=node,
        max_nodes=max_nodes,
        expires_in_s=lifetime,
    )
    with cli_context(ctx).client() as client:
        made = client.create_token(request)
    if output is OutputFormat.JSON:
        print_json(made)
        return
    if made.tenant:
        scope = f" for tenant {made.tenant}"
    elif made.node:
        scope = f" for node {made.node}"
    elif made.joins_left is not None:
        scope = f" for at most {made.joins_left} new node(s)"
    else:
        scope = ""
    note(f"{made.role} token {made.id} ({made.name}){scope}; keep it secret, it is shown once:")
    typer.echo(made.token)


@app.command("ls")
def list_tokens(
    ctx: typer.Context,
    include_revoked: Annotated[bool, typer.Option("--all", help="Revoked tokens too.")] = False,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """List the tokens (admin only)."""
    with cli_context(ctx).client() as client:
        tokens = client.tokens(include_revoked)
    show(output, tokens, tokens_table(tokens))


@app.command("revoke")
def revoke(
    ctx: typer.Context, token_id: Annotated[str, typer.Argument(metavar="ID")]
) -> None:
    """Revoke a token at once (other controllers of an HA pool within seconds)."""
    with cli_context(ctx).client() as client:
        gone = client.revoke_token(token_id)
    note(f"revoked {gone.role} token {gone.id} ({gone.name})")


@app.command("new")
def new() -> None:
    """Print a fresh random token without asking any controller: for GPUPOOL_ADMIN_TOKEN, which
    a controller installs as an admin token when it starts (a Kubernetes secret, say)."""
    typer.echo(new_token()[2])


def whoami(ctx: typer.Context, output: OutputOption = OutputFormat.TABLE) -> None:
    with cli_context(ctx).client() as client:
        me = client.whoami()
    if output is OutputFormat.JSON:
        print_json(me)
        return
    scope = f", tenant {me.tenant}" if me.tenant else (f", node {me.node}" if me.node else "")
    stdout_console().print(
        f"{me.name} ({me.role}{scope}), token {me.token_id}; events say {me.actor}"
    )
