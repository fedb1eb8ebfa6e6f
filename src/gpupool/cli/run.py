"""`gpupool run -- CMD`: lease GPUs of this server, run CMD on them, give them back when it ends."""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer
from rich.markup import escape

from gpupool.cli.context import CliContext, cli_context
from gpupool.cli.errors import BadInput, CommandFailed
from gpupool.cli.leases import (
    HOLDER_MAX,
    CpuOption,
    HostMemoryOption,
    await_grant,
    build_request,
    granted_text,
)
from gpupool.cli.output import note
from gpupool.cli.signals import exit_status_of, signals_to, terminate_interrupts
from gpupool.client.sdk import (
    URL_ENV,
    ApiError,
    ControllerUnreachable,
    LeaseFailed,
    LeaseKeeper,
    PoolClient,
    resolve_token,
)
from gpupool.protocol.v1.api import GpuOut, LeaseCreate, LeaseOut
from gpupool.protocol.v1.attach import AttachRefused, attach

HELP = (
    "Run a command on GPUs of this server and give them back when it ends.\n\n"
    "Example: gpupool run --compute 30% --memory 8GiB -- python train.py\n\n"
    "The command sees its GPUs as CUDA_VISIBLE_DEVICES (their UUIDs, in lease order) and, "
    "for slices, the MPS limits CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and "
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; GPUPOOL_LEASE_ID and GPUPOOL_URL name its lease, "
    "GPUPOOL_SIMULATED=1 says the GPUs are simulated.\n\n"
    "The lease is heartbeated while the command runs and released when it exits, crashes or "
    "is interrupted. Exit status: the command's own (128+N when killed by signal N)."
)

RUN_TTL_S = 30.0
STOP_GRACE_S = 10.0
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
EXIT_LEASE_LOST = 1
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Variables a surrounding `gpupool run` may have set that must not leak into this one.
_OWN_VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY",
    "GPUPOOL_LEASE_ID",
    "GPUPOOL_SIMULATED",
    "GPUPOOL_LEASE",
    "GPUPOOL_WORKERS",
    "GPUPOOL_LEASE_TOKEN",
    "GPUPOOL_LAZY",
    "GPUPOOL_LAZY_TOKEN",
    "GPUPOOL_LAZY_LEASE_FILE",
)


def lease_env(lease: LeaseOut, gpus: Sequence[GpuOut], url: str) -> dict[str, str]:
    """The variables that point a CUDA program at its lease's GPUs and hold it to its limits."""
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(piece.gpu_uuid for piece in lease.slices),
        "GPUPOOL_LEASE_ID": lease.id,
        URL_ENV: url,
    }
    if any(gpu.simulated for gpu in gpus):
        env["GPUPOOL_SIMULATED"] = "1"
    slices = [piece for piece in lease.slices if not piece.whole]
    if not lease.physical and slices:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(slices[0].compute_pct)
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
            f"{index}={piece.memory_mib}M" for index, piece in enumerate(lease.slices)
        )
        # The agent runs one MPS control daemon per virtual GPU; its pipe directory is how
        # this program reaches that daemon, which enforces the limits above.
        pipe = next(
            (str(g.telemetry["mps_pipe_dir"]) for g in gpus if g.telemetry.get("mps_pipe_dir")),
            None,
        )
        if pipe is not None:
            env["CUDA_MPS_PIPE_DIRECTORY"] = pipe
            env["CUDA_MPS_LOG_DIRECTORY"] = str(Path(pipe).parent / "log")
    return env


def unenforced_warning(
    lease: LeaseOut, gpus: Sequence[GpuOut], env: Mapping[str, str]
) -> str | None:
    """Say so when a slice on a real GPU runs without its MPS daemon (limits not enforced).

    A daemon this user cannot reach is the same as none: CUDA then runs the program outside
    MPS, on the whole GPU (the daemon of a GPU whose remote workers run as the pool's worker
    user is that user's, and its pipes are that user's alone)."""
    if lease.physical or "GPUPOOL_SIMULATED" in env:
        return None
    names = ", ".join(g.uuid for g in gpus)
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe is not None:
        try:
            Path(pipe, "control").stat()
        except OSError as exc:
            return (
                f"warning: the MPS daemon of {names} cannot be reached from this user"
                f" ({exc.strerror}): CUDA runs this program outside MPS, its compute share"
                " is not enforced (the GPU's workers and daemon run as the pool's worker"
                " user; use --remote, or run this program as that user)"
            )
        return None
    return (
        f"warning: no MPS daemon runs for {names}: the compute share and memory limit "
        "of this slice are not enforced (is nvidia-cuda-mps-control installed on the agent?)"
    )


def attach_socket(gpus: Sequence[GpuOut]) -> Path | None:
    """The agent's socket where this process attaches to its lease's watch, if it has one."""
    for gpu in gpus:
        path = gpu.telemetry.get("direct_socket")
        if isinstance(path, str) and path:
            return Path(path)
    return None


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Keep the command's orphans (a daemonising child) as our descendants: the agent finds
    a process's lease through its ancestry, and a process re-parented to init has none (it
    would be stopped as one without a lease). Linux only; elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        return


def attach_to_watch(lease: LeaseOut, token: str | None, gpus: Sequence[GpuOut]) -> None:
    """Tell the agent that this process, and so the command it starts next, belongs to the
    lease: the agent stops GPU processes that belong to no lease. Before the command starts,
    so that the command is never on a GPU without its lease known."""
    path = attach_socket(gpus)
    if path is None:
        if not any(g.simulated for g in gpus):
            note(
                "[yellow]warning: the agent does not watch direct slices (an older agent): "
                "nothing on the server stops a program that raises its own limits[/yellow]"
            )
        return
    if not token:
        # A controller older than the watch: it gives the agent no direct leases either, so
        # the agent judges nothing. Refusing to run would protect no one.
        note(
            f"[yellow]warning: lease {lease.id} came without its token (a controller older "
            "than the watch of direct slices): the command is not attached to its lease; "
            "an agent told of the lease would stop it[/yellow]"
        )
        return
    try:
        attach(path, lease.id, token)
    except AttachRefused as exc:
        raise CommandFailed(f"the agent refused to attach lease {lease.id}: {exc}", 1) from None
    except OSError as exc:
        raise CommandFailed(
            f"cannot reach the agent's socket {path} ({exc.strerror or exc}): the agent would "
            "stop the command as one without a lease; run on the GPU's own server",
            1,
        ) from None
    become_subreaper()


def _local(path: Path | None) -> bool:
    try:
        return path is not None and path.is_socket()
    except OSError:
        return False


def child_env(base: Mapping[str, str], lease_vars: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in _OWN_VARIABLES}
    env.update(lease_vars)
    return env


def exit_status(returncode: int) -> int:
    """A shell's view of a child's end: its code, or 128+N when signal N killed it."""
    return 128 - returncode if returncode < 0 else returncode


def _terminal_sends_sigint_to_child() -> bool:
    """Ctrl-C in a terminal reaches the whole foreground group, the child included."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


class Supervisor:
    """Runs CMD, forwards our signals to it, and stops it when its lease is taken away."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], grace_s: float) -> None:
        self.cmd = list(cmd)
        self.env = dict(env)
        self.grace_s = grace_s
        self.lost_reason: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending: list[int] = []
        self._skip_sigint = _terminal_sends_sigint_to_child()

    def start(self) -> None:
        try:
            self._proc = subprocess.Popen(self.cmd, env=self.env)
        except FileNotFoundError:
            raise CommandFailed(f"cannot run {self.cmd[0]!r}: not found", EXIT_NOT_FOUND) from None
        except PermissionError:
            raise CommandFailed(
                f"cannot run {self.cmd[0]!r}: permission denied", EXIT_CANNOT_EXECUTE
            ) from None
        except OSError as exc:
            raise CommandFailed(
                f"cannot run {self.cmd[0]!r}: {exc.strerror or exc}", EXIT_CANNOT_EXECUTE
            ) from None
        for signum in self._pending:
            self._proc.send_signal(signum)

    def forward(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._skip_sigint:
            return
        proc = self._proc
        if proc is None:
            self._pending.append(signum)
        elif proc.poll() is None:
            proc.send_signal(signum)

    def wait(self) -> int:
        assert self._proc is not None
        return self._proc.wait()

    def lease_lost(self, _lease: LeaseOut | None, reason: str) -> None:
        """Called from the heartbeat thread: TERM now, KILL after the grace period."""
        self.lost_reason = reason
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        note(f"[red]lease taken away ({escape(reason)}): stopping the command[/red]")
        proc.terminate()
        deadline = time.monotonic() + self.grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()


class _Warner:
    """Says once that heartbeats fail, not every ttl/3 seconds."""

    def __init__(self, lease_id: str) -> None:
        self.lease_id = lease_id
        self._said = threading.Event()

    def __call__(self, exc: Exception) -> None:
        if not self._said.is_set():
            self._said.set()
            problem = escape(str(exc))
            note(f"[yellow]warning: cannot heartbeat lease {self.lease_id}: {problem}[/yellow]")


def _gpus_of(client: PoolClient, lease: LeaseOut) -> list[GpuOut]:
    seen: dict[str, GpuOut] = {}
    for piece in lease.slices:
        if piece.gpu_uuid not in seen:
            seen[piece.gpu_uuid] = client.gpu(piece.gpu_uuid)
    return list(seen.values())


def _release(client: PoolClient, lease: LeaseOut) -> None:
    try:
        client.release_lease(lease.id)
    except (ApiError, ControllerUnreachable) as exc:
        note(
            f"[yellow]warning: could not release lease {lease.id} ({escape(str(exc))}); "
            f"it expires within {lease.ttl_s:g} s[/yellow]"
        )


def _run_on_lease(
    context: CliContext,
    client: PoolClient,
    lease: LeaseOut,
    token: str | None,
    cmd: Sequence[str],
    grace_s: float,
) -> int:
    here = socket.gethostname()
    elsewhere = sorted({piece.node for piece in lease.slices if piece.node != here})
    if elsewhere:
        note(
            f"[yellow]warning: lease {lease.id} is on {', '.join(elsewhere)}, not on {here}; "
            "direct access only works on the GPU's own server[/yellow]"
        )
    gpus = _gpus_of(client, lease)
    env = child_env(os.environ, lease_env(lease, gpus, context.url))
    warning = unenforced_warning(lease, gpus, env)
    if warning is not None:
        note(f"[yellow]{escape(warning)}[/yellow]")
    if not elsewhere or _local(attach_socket(gpus)):
        # A node named otherwise than this host may still be this host (agent --node).
        attach_to_watch(lease, token, gpus)
    note(
        escape(granted_text(lease))
        + (" [yellow](SIMULATED)[/yellow]" if "GPUPOOL_SIMULATED" in env else "")
    )
    return _supervise(context, lease, cmd, env, grace_s)


def _supervise(
    context: CliContext,
    lease: LeaseOut,
    cmd: Sequence[str],
    env: Mapping[str, str],
    grace_s: float,
) -> int:
    """Run CMD while heartbeating its lease; stop it when the lease is taken away."""
    supervisor = Supervisor(cmd, env, grace_s)
    keeper = LeaseKeeper.for_lease(
        context.url,
        lease,
        actor=context.actor,
        token=context.token,
        on_end=supervisor.lease_lost,
        on_error=_Warner(lease.id),
    )
    with signals_to(supervisor.forward, _FORWARDED):
        try:
            supervisor.start()
            keeper.start()
            returncode = supervisor.wait()
        finally:
            keeper.stop()
    if supervisor.lost_reason is not None:
        raise CommandFailed(
            f"lease {lease.id} was taken away while the command ran ({supervisor.lost_reason}); "
            f"the command was stopped (its status {exit_status(returncode)})",
            EXIT_LEASE_LOST,
        )
    return exit_status(returncode)


def run(
    ctx: typer.Context,
    cmd: Annotated[
        list[str] | None,
        typer.Argument(metavar="CMD [ARGS]", help="The command to run, after --."),
    ] = None,
    gpus: Annotated[int, typer.Option("--gpus", "-n", help="How many GPUs (slices).")] = 1,
    compute: Annotated[
        str | None, typer.Option("--compute", "-c", help="Compute share of each GPU, e.g. 30%.")
    ] = None,
    memory: Annotated[
        str | None, typer.Option("--memory", "-m", help="Memory on each GPU, e.g. 8GiB.")
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
    wait: Annotated[
        bool,
        typer.Option("--wait/--no-wait", help="Queue until GPUs are free, or fail at once."),
    ] = True,
    node: Annotated[
        str | None, typer.Option("--node", help="GPU server to use (default: this one).")
    ] = None,
    gpu_model: Annotated[
        str | None, typer.Option("--gpu-model", help="Allowed models, e.g. H100,A100.")
    ] = None,
    ttl: Annotated[
        float, typer.Option("--ttl", help="Seconds the lease survives without heartbeats.")
    ] = RUN_TTL_S,
    grace: Annotated[
        float,
        typer.Option("--grace", help="Seconds between TERM and KILL when the lease is lost."),
    ] = STOP_GRACE_S,
    cpu: CpuOption = None,
    host_memory: HostMemoryOption = None,
    remote: Annotated[
        bool,
        typer.Option(
            "--remote",
            help="GPUs of any server, through workers: the command's PyTorch sees them as cuda.",
        ),
    ] = False,
    idle_timeout: Annotated[
        float | None,
        typer.Option(
            "--idle-timeout",
            help="Remote: after this many seconds without GPU work the slice goes back to the "
            "pool (tensors to host memory); the next GPU op takes one again.",
        ),
    ] = None,
    lazy: Annotated[
        bool,
        typer.Option(
            "--lazy",
            help="Remote: start the command without a GPU; its first GPU op asks for the lease "
            "(waiting in the queue, shown on stderr), so CPU work before it holds nothing.",
        ),
    ] = False,
) -> None:
    if not cmd:
        raise BadInput(
            "give the command to run after --, e.g. gpupool run -c 25% -- python train.py"
        )
    if grace < 0:
        raise BadInput(f"--grace must not be negative, got {grace:g}")
    if remote and (cpu is not None or host_memory is not None):
        raise BadInput("--cpu and --host-memory are for direct runs: a remote program runs here")
    if remote and physical:
        raise BadInput("physical GPUs are always direct: drop --remote or --physical")
    if lazy and not remote:
        raise BadInput(
            "--lazy takes the lease at the program's first GPU op, through workers: it needs "
            "--remote"
        )
    if gpus > 1 and not physical and not remote:
        # One MPS daemon per GPU, and a process reaches only one daemon: a program spread over
        # several slices could not be held to its limits on all of them.
        raise BadInput(
            "a direct run on several GPU slices cannot be held to its limits by MPS: "
            "use --physical for several whole GPUs, or one slice per process"
        )
    context = cli_context(ctx)
    host = socket.gethostname()
    request = build_request(
        gpus=gpus,
        compute=compute,
        memory=memory,
        physical=physical,
        priority=priority,
        tenant=tenant,
        # A direct program must run beside its GPU; a remote one prefers it but takes any.
        node=node if remote else (node or host),
        gpu_models=gpu_model,
        holder=_holder(f"{context.actor}@{host} pid {os.getpid()}: {shlex.join(cmd)}"),
        ttl_s=ttl,
        wait=wait,
        access="remote" if remote else "direct",
        cpu=cpu,
        host_memory=host_memory,
        idle_timeout_s=idle_timeout,
    )
    if lazy:
        raise typer.Exit(_run_lazy(context, request, cmd, grace))
    # SIGTERM between the grant and the command's start (the agent's attach, the workers'
    # start) cancels like Ctrl-C: the lease is released, not left for its ttl.
    with context.client() as client, terminate_interrupts():
        lease = client.create_lease(request)
        token = lease.token
        try:
            lease = await_grant(client, lease)
            if remote:
                lease = await_workers(client, lease)
                code = _run_remote(context, lease, token or "", cmd, grace)
            else:
                code = _run_on_lease(context, client, lease, token, cmd, grace)
        except KeyboardInterrupt as interrupt:
            code = exit_status_of(interrupt)
        finally:
            _release(client, lease)
    raise typer.Exit(code)


WORKER_START_TIMEOUT_S = 180.0


def await_workers(client: PoolClient, lease: LeaseOut) -> LeaseOut:
    """Wait until the agents run a worker for every slice of a granted remote lease."""
    try:
        return client.wait_for_workers(lease.id, timeout=WORKER_START_TIMEOUT_S)
    except LeaseFailed as exc:
        raise CommandFailed(exc.reason, 1) from None


def remote_env(lease: LeaseOut, token: str, url: str) -> dict[str, str]:
    """What makes an unchanged PyTorch program use the lease's workers as its cuda devices."""
    return {
        "GPUPOOL_LEASE": lease.id,
        "GPUPOOL_LEASE_ID": lease.id,
        "GPUPOOL_WORKERS": ",".join(piece.endpoint or "" for piece in lease.slices),
        "GPUPOOL_LEASE_TOKEN": token,
        **_site_env(url),
    }


def lazy_env(
    request: LeaseCreate, api_token: str | None, url: str, lease_file: Path
) -> dict[str, str]:
    """What makes an unchanged PyTorch program ask for `request` at its first GPU op."""
    env = {
        "GPUPOOL_LAZY": request.model_dump_json(exclude_unset=True),
        "GPUPOOL_LAZY_LEASE_FILE": str(lease_file),
        **_site_env(url),
    }
    if api_token:
        env["GPUPOOL_LAZY_TOKEN"] = api_token
    return env


def _site_env(url: str) -> dict[str, str]:
    """gpupool.torch's sitecustomize on the path: it attaches the program when torch loads."""
    spec = importlib.util.find_spec("gpupool.torch")
    if spec is None or not spec.submodule_search_locations:
        raise CommandFailed("gpupool.torch is not installed here: pip install 'gpupool[torch]'", 1)
    site = str(Path(next(iter(spec.submodule_search_locations))) / "site")
    python_path = os.environ.get("PYTHONPATH")
    return {
        URL_ENV: url,
        # The program's cuda devices are the lease's workers; a GPU of this host, if it has
        # one, is not part of the lease.
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": site + (os.pathsep + python_path if python_path else ""),
    }


def _run_lazy(context: CliContext, request: LeaseCreate, cmd: Sequence[str], grace_s: float) -> int:
    """Run CMD with no lease; the program takes it at its first GPU op and heartbeats it.

    The program writes its lease's id to a file of ours: should it die without giving the
    lease back, we do (its ttl would, later)."""
    with tempfile.TemporaryDirectory(prefix="gpupool-lazy-") as scratch:
        lease_file = Path(scratch) / "lease"
        api_token = resolve_token(context.url, context.token)
        env = child_env(os.environ, lazy_env(request, api_token, context.url, lease_file))
        note("no GPU held yet: the lease is taken at the program's first GPU op (lazy)")
        supervisor = Supervisor(cmd, env, grace_s)
        with signals_to(supervisor.forward, _FORWARDED):
            supervisor.start()
            returncode = supervisor.wait()
        lease_id = lease_file.read_text().strip() if lease_file.exists() else ""
    if lease_id:
        with context.client() as client:
            try:
                client.release_lease(lease_id)
            except (ApiError, ControllerUnreachable) as exc:
                problem = escape(str(exc))
                note(f"[yellow]warning: could not release lease {lease_id}: {problem}[/yellow]")
    return exit_status(returncode)


def _run_remote(
    context: CliContext, lease: LeaseOut, token: str, cmd: Sequence[str], grace_s: float
) -> int:
    env = child_env(os.environ, remote_env(lease, token, context.url))
    where = ", ".join(f"{p.node}:{p.gpu_index} via {p.endpoint}" for p in lease.slices)
    note(escape(f"{granted_text(lease)} (remote: {where})"))
    return _supervise(context, lease, cmd, env, grace_s)


def _holder(words: str) -> str:
    """The lease's holder as `gpupool run` names it: who, where, and the command, cut to the
    controller's limit (a long `python -c` program is still a fine name, only its start)."""
    if len(words) <= HOLDER_MAX:
        return words
    return words[: HOLDER_MAX - 1] + "…"
