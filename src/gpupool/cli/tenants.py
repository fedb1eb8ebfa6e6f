"""`gpupool tenant ...`: who may use how much of the pool, and their fair-share weight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import typer

from gpupool.cli.context import cli_context
from gpupool.cli.errors import BadInput
from gpupool.cli.output import OutputFormat, OutputOption, show, tenants_table
from gpupool.core.units import parse_memory_mib
from gpupool.protocol.v1.api import QuotaIn, TenantCreate, TenantOut, TenantUpdate

app = typer.Typer(no_args_is_help=True)

UNLIMITED = ("unlimited", "none", "-")

NameArgument = Annotated[str, typer.Argument(metavar="NAME")]
MaxGpus = Annotated[
    str | None, typer.Option("--max-gpus", help="Whole GPUs at once ('unlimited' clears).")
]
MaxMemory = Annotated[
    str | None, typer.Option("--max-memory", help="Memory over all leases, e.g. 80GiB.")
]
MaxCompute = Annotated[
    str | None,
    typer.Option("--max-compute", help="Compute over all leases in percent, e.g. 400 = 4 GPUs."),
]
MaxLeases = Annotated[str | None, typer.Option("--max-leases", help="Leases at once.")]
MaxPriority = Annotated[
    str | None, typer.Option("--max-priority", help="Highest priority it may ask for.")
]
Weight = Annotated[float | None, typer.Option("--weight", help="Fair-share weight (default 1).")]
Guaranteed = Annotated[
    float | None,
    typer.Option(
        "--guaranteed-gpus", help="GPUs' worth of leases that preemption never takes away."
    ),
]


def _with_guarantee(quota: QuotaIn, guaranteed: float | None) -> QuotaIn:
    if guaranteed is None:
        return quota
    if not 0 <= guaranteed <= 100_000:
        raise BadInput(f"--guaranteed-gpus must be 0..100000, got {guaranteed:g}")
    return quota.model_copy(update={"guaranteed_gpus": guaranteed})


@dataclass(frozen=True, slots=True)
class Limit:
    """One quota option as given: `given` False means "leave as it is"."""

    given: bool
    value: int | None = None


def parse_limit(option: str, text: str | None, *, percent: bool = False) -> Limit:
    if text is None:
        return Limit(given=False)
    cleaned = text.strip().lower()
    if cleaned in UNLIMITED:
        return Limit(given=True, value=None)
    if percent:
        cleaned = cleaned.removesuffix("%").strip()
    if not cleaned.isdigit():
        hint = " (or 'unlimited')"
        raise BadInput(f"{option} must be a whole number{hint}, got {text!r}")
    return Limit(given=True, value=int(cleaned))


def parse_memory_limit(text: str | None) -> Limit:
    if text is None:
        return Limit(given=False)
    if text.strip().lower() in UNLIMITED:
        return Limit(given=True, value=None)
    return Limit(given=True, value=parse_memory_mib(text))


@dataclass(frozen=True, slots=True)
class QuotaChange:
    max_gpus: Limit
    max_memory_mib: Limit
    max_compute_pct: Limit
    max_leases: Limit
    max_priority: Limit

    @classmethod
    def parse(
        cls,
        max_gpus: str | None,
        max_memory: str | None,
        max_compute: str | None,
        max_leases: str | None,
        max_priority: str | None,
    ) -> QuotaChange:
        change = cls(
            max_gpus=parse_limit("--max-gpus", max_gpus),
            max_memory_mib=parse_memory_limit(max_memory),
            max_compute_pct=parse_limit("--max-compute", max_compute, percent=True),
            max_leases=parse_limit("--max-leases", max_leases),
            max_priority=parse_limit("--max-priority", max_priority),
        )
        priority = change.max_priority.value
        if priority is not None and priority > 1000:
            raise BadInput(f"--max-priority must be 0..1000, got {priority}")
        return change

    def any_given(self) -> bool:
        return any(
            limit.given
            for limit in (
                self.max_gpus,
                self.max_memory_mib,
                self.max_compute_pct,
                self.max_leases,
                self.max_priority,
            )
        )

    def applied_to(self, current: TenantOut | None) -> QuotaIn:
        """The whole quota after this change: sent in full, so nothing else is lost."""

        def pick(limit: Limit, now: int | None) -> int | None:
            return limit.value if limit.given else now

        memory = pick(self.max_memory_mib, current.max_memory_mib if current else None)
        return QuotaIn(
            max_gpus=pick(self.max_gpus, current.max_gpus if current else None),
            max_memory=None if memory is None else f"{memory}MiB",
            max_compute_pct=pick(
                self.max_compute_pct, current.max_compute_pct if current else None
            ),
            max_leases=pick(self.max_leases, current.max_leases if current else None),
            max_priority=pick(self.max_priority, current.max_priority if current else None),
        )


def _check_weight(weight: float | None) -> None:
    if weight is not None and not 0 < weight <= 1000:
        raise BadInput(f"--weight must be more than 0 and at most 1000, got {weight:g}")


@app.command("ls")
def list_tenants(ctx: typer.Context, output: OutputOption = OutputFormat.TABLE) -> None:
    """List tenants with what they use and their quotas."""
    with cli_context(ctx).client() as client:
        found = client.tenants()
    show(output, found, tenants_table(found))


@app.command("show")
def show_tenant(
    ctx: typer.Context, name: NameArgument, output: OutputOption = OutputFormat.TABLE
) -> None:
    """Show one tenant."""
    with cli_context(ctx).client() as client:
        tenant = client.tenant(name)
    show(output, tenant, tenants_table([tenant]))


@app.command("create")
def create_tenant(
    ctx: typer.Context,
    name: NameArgument,
    max_gpus: MaxGpus = None,
    max_memory: MaxMemory = None,
    max_compute: MaxCompute = None,
    max_leases: MaxLeases = None,
    max_priority: MaxPriority = None,
    weight: Weight = None,
    guaranteed_gpus: Guaranteed = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Create a tenant; limits left out are unlimited."""
    _check_weight(weight)
    change = QuotaChange.parse(max_gpus, max_memory, max_compute, max_leases, max_priority)
    body = TenantCreate(
        name=name,
        weight=1.0 if weight is None else weight,
        quota=_with_guarantee(change.applied_to(None), guaranteed_gpus),
    )
    with cli_context(ctx).client() as client:
        tenant = client.create_tenant(body)
    show(output, tenant, tenants_table([tenant]))


@app.command("set")
def set_tenant(
    ctx: typer.Context,
    name: NameArgument,
    max_gpus: MaxGpus = None,
    max_memory: MaxMemory = None,
    max_compute: MaxCompute = None,
    max_leases: MaxLeases = None,
    max_priority: MaxPriority = None,
    weight: Weight = None,
    guaranteed_gpus: Guaranteed = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Change a tenant's limits or weight; 'unlimited' removes a limit, others stay."""
    _check_weight(weight)
    change = QuotaChange.parse(max_gpus, max_memory, max_compute, max_leases, max_priority)
    if weight is None and guaranteed_gpus is None and not change.any_given():
        raise BadInput("nothing to change: give --weight, --guaranteed-gpus or a --max-... option")
    with cli_context(ctx).client() as client:
        update = TenantUpdate()
        if weight is not None:
            update.weight = weight
        if change.any_given():
            update.quota = change.applied_to(client.tenant(name))
        if guaranteed_gpus is not None:
            update.quota = _with_guarantee(update.quota or QuotaIn(), guaranteed_gpus)
        tenant = client.update_tenant(name, update)
    show(output, tenant, tenants_table([tenant]))


@app.command("delete")
def delete_tenant(ctx: typer.Context, name: NameArgument) -> None:
    """Delete a tenant that holds nothing (no live or queued lease) and its tokens; the history
    of its leases stays readable (`gpupool lease ls --all --tenant NAME`, `gpupool events`)."""
    with cli_context(ctx).client() as client:
        client.delete_tenant(name)
    typer.echo(f"deleted tenant {name} (its lease history is kept)")
