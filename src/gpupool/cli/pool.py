"""`gpupool pool|up|controller|agent|demo`: look at the pool, and start its processes."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import psutil
import typer

from gpupool.cli import local
from gpupool.cli.context import cli_context
from gpupool.cli.errors import BadInput, CommandFailed
from gpupool.cli.local import (
    DEFAULT_FAKE_SPEC,
    agent_command,
    check_fake_spec,
    choose_fake_spec,
    controller_healthy,
    local_node_name,
    real_gpus_found,
    stop_process,
)
from gpupool.cli.output import (
    OutputFormat,
    OutputOption,
    note,
    pool_panel,
    show,
    simulated_banner,
    stderr_console,
)
from gpupool.cli.signals import exit_status_of, raise_interrupted, signals_to
from gpupool.client import config
from gpupool.client.sdk import (
    ApiError,
    ControllerUnreachable,
    PoolClient,
    resolve_token,
    resolve_url,
)
from gpupool.core.errors import quoted
from gpupool.startup import imports_without_gc

DEFAULT_MAX_PRIORITY = 0
"""ControllerSettings.default_max_priority's default (the CLI does not import the controller
until it runs one; tests/cli checks the two agree)."""
DEFAULT_PORT = 8900
DEFAULT_DATA_DIR = Path(".gpupool")

HostOption = Annotated[str, typer.Option("--host", help="Address to listen on.")]
PortOption = Annotated[int, typer.Option("--port", help="Port to listen on.")]
DataDirOption = Annotated[
    Path, typer.Option("--data-dir", help="Where the SQLite database and logs live.")
]
DbOption = Annotated[
    str | None,
    typer.Option("--db", help="Database URL, e.g. postgresql://...; default SQLite in --data-dir."),
]
AdminTokenFileOption = Annotated[
    Path | None,
    typer.Option(
        "--admin-token-file",
        help="Install the admin token in this file at start (else $GPUPOOL_ADMIN_TOKEN; "
        "else the first start writes a new one to <data-dir>/admin.token).",
    ),
]
TlsCertOption = Annotated[
    Path | None, typer.Option("--tls-cert", help="Serve HTTPS with this certificate (PEM).")
]
TlsKeyOption = Annotated[
    Path | None, typer.Option("--tls-key", help="The certificate's private key (PEM).")
]
ADMIN_TOKEN_ENV = "GPUPOOL_ADMIN_TOKEN"
FakeOption = Annotated[
    str | None,
    typer.Option("--fake", help="Simulate GPUs instead of using real ones, e.g. 4xH100-80GB."),
]


def show_pool(ctx: typer.Context, output: OutputOption = OutputFormat.TABLE) -> None:
    with cli_context(ctx).client() as client:
        summary = client.pool()
    show(output, summary, pool_panel(summary))


# ---- processes ----------------------------------------------------------------------------


def local_url(host: str, port: int, tls: bool = False) -> str:
    """Where a process on this machine reaches a controller listening on host:port."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def admin_token(path: Path | None) -> str | None:
    """The admin token to install at start: from --admin-token-file or $GPUPOOL_ADMIN_TOKEN."""
    from gpupool.protocol.v1.tokens import split

    if path is not None:
        try:
            text = path.read_text().strip()
        except OSError as exc:
            raise BadInput(f"cannot read --admin-token-file {path}: {exc.strerror}") from None
        where = f"--admin-token-file {path}"
    else:
        text = os.environ.get(ADMIN_TOKEN_ENV, "").strip()
        where = f"${ADMIN_TOKEN_ENV}"
        if not text:
            return None
    if split(text) is None:
        raise BadInput(f"{where} holds no valid token (make one with `gpupool token new`)")
    return text


def tls_files(cert: Path | None, key: Path | None) -> tuple[Path | None, Path | None]:
    if (cert is None) != (key is None):
        raise BadInput("--tls-cert and --tls-key go together")
    for option, path in (("--tls-cert", cert), ("--tls-key", key)):
        if path is not None and not path.is_file():
            raise BadInput(f"{option} {path}: no such file")
    return cert, key


def quiet_http_logs() -> None:
    """One INFO line per HTTP request (heartbeats, health polls) would bury the real news."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


class LocalAgent:
    """The agent `gpupool up` starts as a child, once the controller answers, with an agent
    token of its own (kept in its data dir, made with the admin token on the first start)."""

    def __init__(
        self,
        url: str,
        cmd: list[str],
        data_dir: Path,
        admin: str | None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.url = url
        self.cmd = cmd
        self.data_dir = data_dir
        self.admin = admin
        self.on_ready = on_ready
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._start_when_ready, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _start_when_ready(self) -> None:
        while not self._stopping.is_set():
            if controller_healthy(self.url):
                if not self._stopping.is_set():
                    env = dict(os.environ)
                    try:
                        env["GPUPOOL_TOKEN"] = self._agent_token()
                    except (ApiError, ControllerUnreachable, OSError) as exc:
                        stderr_console().print(f"[red]cannot start the local agent: {exc}[/red]")
                        return
                    self.proc = subprocess.Popen(self.cmd, env=env)
                    self._announce_when_registered()
                return
            self._stopping.wait(0.2)

    def _announce_when_registered(self) -> None:
        token = self.admin or self._admin_file_token()
        while not self._stopping.is_set():
            if self.proc is not None and self.proc.poll() is not None:
                return  # the agent says why in its own log lines
            if node_registered(self.url, token, local_node_name()):
                if self.on_ready is not None:
                    self.on_ready()
                return
            self._stopping.wait(0.2)

    def _admin_file_token(self) -> str:
        return (self.data_dir / "admin.token").read_text().strip()

    def _agent_token(self) -> str:
        from gpupool.protocol.v1.api import TokenCreate

        node = local_node_name()
        kept = self.data_dir / "agent" / "agent.token"
        if kept.exists():
            token = kept.read_text().strip()
            with PoolClient(self.url, token=token, timeout=5) as client:
                try:
                    me = client.whoami()
                    if me.role == "agent" and me.node == node:
                        return token
                except ApiError:
                    pass  # revoked, another database, or an unbound token: make a new one
        admin = self.admin or self._admin_file_token()
        with PoolClient(self.url, token=admin, timeout=5) as client:
            made = client.create_token(
                TokenCreate(name=f"agent-{node}"[:128], role="agent", node=node)
            )
        kept.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(made.token + "\n")
        return made.token

    def stop(self) -> None:
        """Stop the agent and, should any outlive it, its workers (the tree is taken before the
        agent is asked to stop, so workers it leaves behind are still found)."""
        self._stopping.set()
        self._thread.join(timeout=5)
        if self.proc is None:
            return
        try:
            tree = local.descendants(psutil.Process(self.proc.pid))
        except psutil.Error:
            tree = []
        stop_process(self.proc)
        local.stop_tree([p for p in tree if p.is_running()])


def node_registered(url: str, token: str | None, node: str) -> bool:
    """Whether `node` is up in the pool with its GPUs: the pool is ready to use."""
    try:
        with PoolClient(url, token=token, timeout=2) as client:
            return any(
                n.name == node and n.state == "up" and n.gpu_count > 0 for n in client.nodes()
            )
    except (ApiError, ControllerUnreachable):
        return False


ContextOption = Annotated[
    str | None,
    typer.Option(
        "--context",
        help="Name of the context recorded for this pool (default: local, or local-PORT "
        "for another --port).",
    ),
]
BackgroundOption = Annotated[
    bool,
    typer.Option(
        "--background",
        "-d",
        help="Detach: run the pool in the background (logs in <data-dir>/up.log) and return "
        "once it answers; stop it with `gpupool down`.",
    ),
]
UP_READY_TIMEOUT_S = 180.0


def default_context_name(port: int) -> str:
    return "local" if port == DEFAULT_PORT else f"local-{port}"


def up(
    host: HostOption = "127.0.0.1",
    port: PortOption = DEFAULT_PORT,
    data_dir: DataDirOption = DEFAULT_DATA_DIR,
    db: DbOption = None,
    fake: FakeOption = None,
    admin_token_file: AdminTokenFileOption = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    background: BackgroundOption = False,
    context_name: ContextOption = None,
) -> None:
    """Controller in the foreground, plus an agent for this machine's GPUs as a child."""
    name = context_name or default_context_name(port)
    try:
        config.check_name(name)
    except config.ConfigError as exc:
        raise BadInput(f"--context: {exc}") from None
    admin = admin_token(admin_token_file)
    cert, key = tls_files(tls_cert, tls_key)
    fake_spec, why = choose_fake_spec(fake)
    data_dir = data_dir.expanduser().absolute()
    # Nothing is made (data dir, database, token, process) before these two checks pass.
    local.refuse_second_pool(data_dir)
    local.check_port_free(host, port)
    url = local_url(host, port, tls=cert is not None)
    token_file = (
        admin_token_file.expanduser().absolute()
        if admin_token_file is not None
        else (None if admin is not None else data_dir / "admin.token")
    )
    context = config.Context(name=name, url=url, token_file=token_file, data_dir=data_dir)
    options = UpOptions(host, port, data_dir, db, fake_spec, admin_token_file, cert, key, name)
    if background:
        start_in_background(options, context, admin)
        return
    with imports_without_gc():
        from gpupool.controller.server import serve
        from gpupool.controller.settings import ControllerSettings

    console = stderr_console()
    if fake_spec is not None:
        console.print(simulated_banner(fake_spec, why))

    def ready() -> None:
        config.record(context)
        console.print(ready_text(context), soft_wrap=True)

    data_dir.mkdir(parents=True, exist_ok=True)
    local.write_pid_file(data_dir)
    agent = LocalAgent(
        url, agent_command(url, data_dir / "agent", fake_spec), data_dir, admin, on_ready=ready
    )
    console.print(
        f"gpupool controller on {url} (dashboard {url}/); Ctrl-C or `gpupool down` stops the pool",
        soft_wrap=True,
    )
    quiet_http_logs()
    # uvicorn stops on SIGTERM, then raises it again: with the default action the process
    # would die there, leaving its agent and workers; as an exception the cleanup below runs.
    with signals_to(raise_interrupted, (signal.SIGTERM, signal.SIGHUP)):
        try:
            agent.start()
            serve(
                ControllerSettings(
                    host=host,
                    port=port,
                    data_dir=data_dir,
                    db_url=db,
                    admin_token=admin,
                    tls_cert=cert,
                    tls_key=key,
                )
            )
        except KeyboardInterrupt as interrupt:
            status = exit_status_of(interrupt)
        else:
            status = 0
        finally:
            # A second Ctrl-C must not cut the cleanup short and leave processes behind.
            with signals_to(signal.SIG_IGN, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
                agent.stop()
                local.remove_pid_file(data_dir)
    console.print("gpupool pool stopped (controller, agent and its workers)")
    raise typer.Exit(status)


def ready_text(context: config.Context) -> str:
    token = (
        f"its admin token is in {context.token_file}"
        if context.token_file is not None
        else f"its admin token is the one in ${ADMIN_TOKEN_ENV}"
    )
    return (
        f"pool ready at {context.url}; context '{context.name}' is current, so gpupool "
        f"commands find it from any directory ({token})"
    )


class UpOptions:
    """What a background `gpupool up` is started again with, in its own session."""

    def __init__(
        self,
        host: str,
        port: int,
        data_dir: Path,
        db: str | None,
        fake_spec: str | None,
        admin_token_file: Path | None,
        cert: Path | None,
        key: Path | None,
        context_name: str,
    ) -> None:
        self.argv = [sys.executable, "-m", "gpupool.cli", "up", "--host", host]
        self.argv += ["--port", str(port), "--data-dir", str(data_dir)]
        self.argv += ["--context", context_name]
        if db is not None:
            self.argv += ["--db", db]
        if fake_spec is not None:
            self.argv += ["--fake", fake_spec]
        if admin_token_file is not None:
            self.argv += ["--admin-token-file", str(admin_token_file.expanduser().absolute())]
        if cert is not None and key is not None:
            self.argv += ["--tls-cert", str(cert.absolute()), "--tls-key", str(key.absolute())]
        self.data_dir = data_dir


def start_in_background(options: UpOptions, context: config.Context, admin: str | None) -> None:
    """Start `gpupool up` detached (its own session: the terminal's Ctrl-C and hang-up do not
    reach it), its output in the data dir, and return once its agent's GPUs are in the pool."""
    options.data_dir.mkdir(parents=True, exist_ok=True)
    log_path = options.data_dir / local.LOG_FILE
    with log_path.open("ab") as log:
        child = subprocess.Popen(
            options.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc = psutil.Process(child.pid)

    def answers() -> bool:
        token = admin or context.token()
        return token is not None and node_registered(context.url, token, local_node_name())

    if not local.wait_for(answers, UP_READY_TIMEOUT_S, alive=proc):
        if child.poll() is None:
            local.stop_up(proc)
        else:
            child.wait()
        tail = local.log_tail(log_path)
        raise CommandFailed(f"the pool did not start (log {log_path}): {tail or 'no output'}")
    note(f"gpupool pool running in the background at {context.url} (dashboard {context.url}/)")
    note(f"logs: {log_path}; stop it with `gpupool down`")
    note(ready_text(context))


def down(
    context_name: Annotated[
        str | None,
        typer.Option("--context", help="The pool of this context (default: the current one)."),
    ] = None,
) -> None:
    """Stop a pool `gpupool up` started on this machine: controller, agent and workers."""
    loaded = config.load()
    name = context_name or loaded.current
    if name is None:
        raise BadInput("no current context: give --context NAME (`gpupool context ls`)")
    context = loaded.contexts.get(name)
    if context is None:
        known = ", ".join(sorted(loaded.contexts)) or "none"
        raise BadInput(f"no context named {quoted(name)}; contexts: {known}")
    if context.data_dir is None:
        raise BadInput(
            f"context '{name}' ({context.url}) was not started by `gpupool up` on this "
            "machine: nothing here to stop"
        )
    proc = local.running_up(context.data_dir)
    if proc is None:
        note(f"the pool of context '{name}' is not running (nothing to stop)")
        return
    stopped = local.stop_up(proc)
    forced = "; what did not stop in time was killed" if stopped.killed else ""
    note(
        f"stopped the pool of context '{name}' ({context.url}): gpupool up (pid "
        f"{stopped.up_pid}) and {stopped.others} processes it started{forced}"
    )


def controller(
    host: HostOption = "127.0.0.1",
    port: PortOption = DEFAULT_PORT,
    data_dir: DataDirOption = DEFAULT_DATA_DIR,
    db: DbOption = None,
    lease_ttl: Annotated[
        float, typer.Option("--lease-ttl", help="Default seconds a lease lives without heartbeat.")
    ] = 30.0,
    node_timeout: Annotated[
        float,
        typer.Option("--node-timeout", help="Seconds without heartbeat before a node is down."),
    ] = 15.0,
    compute_ratio: Annotated[
        float, typer.Option("--compute-ratio", help="Compute oversubscription, 1 = none.")
    ] = 1.0,
    memory_ratio: Annotated[
        float,
        typer.Option(
            "--memory-ratio",
            help="Memory oversubscription, 1 = none; the part above a GPU's own memory goes to "
            "remote leases only (their sessions can be swapped out, direct ones cannot).",
        ),
    ] = 1.0,
    alert_webhook: Annotated[
        str | None,
        typer.Option("--alert-webhook", help="POST alerts here (Alertmanager webhook format)."),
    ] = None,
    policy: Annotated[
        str,
        typer.Option("--policy", help="Placement policy (gpupool sim policies lists them)."),
    ] = "default",
    fair_share: Annotated[
        bool, typer.Option("--fair-share/--fifo", help="Order equal priorities by fair share.")
    ] = True,
    max_queue_wait: Annotated[
        float | None,
        typer.Option("--max-queue-wait", help="Fail requests that waited this many seconds."),
    ] = None,
    preemption: Annotated[
        bool, typer.Option("--preemption/--no-preemption", help="Let priority preempt.")
    ] = True,
    preempt_grace: Annotated[
        float, typer.Option("--preempt-grace", help="Seconds a preempted holder has to stop.")
    ] = 30.0,
    default_max_priority: Annotated[
        int,
        typer.Option(
            "--default-max-priority",
            help="Highest priority (0..1000) a tenant token may ask for when its tenant has no "
            "--max-priority of its own; higher asks are refused (403). Admin tokens may ask "
            "any. 0 (the default): no tenant can outrank, and so preempt, another unless an "
            "operator allows it.",
        ),
    ] = DEFAULT_MAX_PRIORITY,
    physical_ready: Annotated[
        int | None,
        typer.Option(
            "--physical-ready",
            help="Dual pool: keep this many idle GPUs physical while whole-GPU requests come.",
        ),
    ] = None,
    node_lost_policy: Annotated[
        str,
        typer.Option(
            "--node-lost-policy",
            help="Leases of a node that stays down: keep (while holders heartbeat) or release.",
        ),
    ] = "keep",
    node_lost_grace: Annotated[
        float,
        typer.Option(
            "--node-lost-grace",
            help="Seconds a node may stay down before `release` ends its leases.",
        ),
    ] = 60.0,
    admin_token_file: AdminTokenFileOption = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    ha: Annotated[
        bool,
        typer.Option(
            "--ha",
            help="High availability: run beside other controllers of the same PostgreSQL "
            "--db; one leads, the others serve reads, forward writes and take over.",
        ),
    ] = False,
    advertise_url: Annotated[
        str | None,
        typer.Option(
            "--advertise-url",
            help="With --ha: the URL other controllers reach this one at "
            "(default http://HOST:PORT).",
        ),
    ] = None,
    max_body_mib: Annotated[
        int,
        typer.Option(
            "--max-body-mib",
            help="Refuse request bodies over this many MiB (413) before reading them.",
        ),
    ] = 4,
) -> None:
    if ha and not (db or "").startswith(("postgresql://", "postgres://")):
        raise BadInput("--ha needs a PostgreSQL shared by the controllers: --db postgresql://...")
    if advertise_url is not None and not advertise_url.startswith(("http://", "https://")):
        raise BadInput(f"--advertise-url must be an http:// or https:// URL, got {advertise_url!r}")
    if lease_ttl <= 0 or node_timeout <= 0:
        raise BadInput("--lease-ttl and --node-timeout must be more than 0")
    if alert_webhook is not None and not alert_webhook.startswith(("http://", "https://")):
        raise BadInput(f"--alert-webhook must be an http:// or https:// URL, got {alert_webhook!r}")
    if not 1.0 <= compute_ratio <= 100.0:
        raise BadInput(f"--compute-ratio must be 1..100, got {compute_ratio:g}")
    if not 1.0 <= memory_ratio <= 10.0:
        raise BadInput(f"--memory-ratio must be 1..10, got {memory_ratio:g}")
    from gpupool.core import PoolError
    from gpupool.core.placement import policy_named

    try:
        policy_named(policy)
    except PoolError as exc:
        raise BadInput(exc.message) from None
    if max_queue_wait is not None and max_queue_wait <= 0:
        raise BadInput(f"--max-queue-wait must be more than 0, got {max_queue_wait:g}")
    if preempt_grace < 0:
        raise BadInput(f"--preempt-grace must not be negative, got {preempt_grace:g}")
    if physical_ready is not None and physical_ready < 0:
        raise BadInput(f"--physical-ready must not be negative, got {physical_ready}")
    if not 0 <= default_max_priority <= 1000:
        raise BadInput(f"--default-max-priority must be 0..1000, got {default_max_priority}")
    if not 1 <= max_body_mib <= 1024:
        raise BadInput(f"--max-body-mib must be 1..1024, got {max_body_mib}")
    admin = admin_token(admin_token_file)
    cert, key = tls_files(tls_cert, tls_key)
    with imports_without_gc():
        from gpupool.controller.server import serve
        from gpupool.controller.settings import NODE_LOST_POLICIES, ControllerSettings

    if node_lost_policy not in NODE_LOST_POLICIES:
        raise BadInput(
            f"--node-lost-policy must be one of {', '.join(NODE_LOST_POLICIES)}, "
            f"got {node_lost_policy!r}"
        )
    if node_lost_grace < 0:
        raise BadInput(f"--node-lost-grace must not be negative, got {node_lost_grace:g}")

    serve(
        ControllerSettings(
            admin_token=admin,
            tls_cert=cert,
            tls_key=key,
            host=host,
            port=port,
            data_dir=data_dir,
            db_url=db,
            lease_ttl_s=lease_ttl,
            node_timeout_s=node_timeout,
            compute_ratio=compute_ratio,
            memory_ratio=memory_ratio,
            webhook_url=alert_webhook,
            placement_policy=policy,
            fair_share=fair_share,
            max_queue_wait_s=max_queue_wait,
            preemption=preemption,
            preempt_grace_s=preempt_grace,
            default_max_priority=default_max_priority,
            physical_ready=physical_ready,
            node_lost_policy=node_lost_policy,
            node_lost_grace_s=node_lost_grace,
            ha=ha,
            advertise_url=advertise_url,
            max_body_bytes=max_body_mib * 1024 * 1024,
        )
    )


def agent(
    ctx: typer.Context,
    url: Annotated[
        str | None, typer.Option("--url", help="Controller URL (default: gpupool --url).")
    ] = None,
    node: Annotated[
        str | None, typer.Option("--node", help="Node name (default: this host's name).")
    ] = None,
    fake: FakeOption = None,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between heartbeats.")
    ] = 2.0,
    data_dir: Annotated[
        Path, typer.Option("--data-dir", help="Where the agent keeps its state.")
    ] = DEFAULT_DATA_DIR / "agent",
    address: Annotated[
        str | None, typer.Option("--address", help="Address other hosts reach this node at.")
    ] = None,
    api_host: Annotated[
        str,
        typer.Option("--api-host", help="Where the agent's own API and /metrics listen."),
    ] = "127.0.0.1",
    api_port: Annotated[
        int, typer.Option("--api-port", help="Port of the agent's API (0: any free port).")
    ] = 0,
    banner: Annotated[bool, typer.Option("--banner/--no-banner", hidden=True)] = True,
    tls_cert: Annotated[
        Path | None,
        typer.Option("--tls-cert", help="Workers serve remote clients over TLS with this cert."),
    ] = None,
    tls_key: TlsKeyOption = None,
    device_plugin: Annotated[
        bool,
        typer.Option(
            "--device-plugin",
            help="Serve the kubelet device plugin (gpupool.io/vgpu, gpupool.io/gpu).",
        ),
    ] = False,
    kubelet_dir: Annotated[
        Path,
        typer.Option("--kubelet-dir", help="The kubelet's device-plugins directory."),
    ] = Path("/var/lib/kubelet/device-plugins"),
    vgpu_slots: Annotated[
        int,
        typer.Option("--vgpu-slots", help="gpupool.io/vgpu devices per virtual GPU (1..100)."),
    ] = 10,
    device_nodes: Annotated[
        bool,
        typer.Option(
            "--device-nodes/--no-device-nodes",
            help="The device plugin names each GPU's /dev/nvidia* nodes to the kubelet.",
        ),
    ] = True,
    cdi_devices: Annotated[
        str,
        typer.Option(
            "--cdi-devices",
            help="The device plugin names GPUs as CDI devices nvidia.com/gpu=<uuid|index> "
            "(the node's CDI spec's naming), or none.",
        ),
    ] = "none",
    insecure_no_pod_check: Annotated[
        bool,
        typer.Option(
            "--insecure-no-pod-check",
            help="INSECURE: let the device plugin give a claim without reading its node's "
            "pods from the API server (then a pod that got past the webhook can be given "
            "another pod's lease). By default it reads them with its pod's service account.",
        ),
    ] = False,
    mps_shm_dir: Annotated[
        Path | None,
        typer.Option(
            "--mps-shm-dir",
            help="Host directory mounted as /dev/shm of this agent (in a container): "
            "slices' containers share it with the MPS daemons.",
        ),
    ] = None,
    room_timeout: Annotated[
        float | None,
        typer.Option(
            "--room-timeout",
            help="Seconds a remote slice's allocation waits for memory under oversubscription "
            "before it fails (default 60).",
        ),
    ] = None,
    direct_watch: Annotated[
        str | None,
        typer.Option(
            "--direct-watch",
            help="The watch of direct slices' GPU processes: enforce (stop what breaks its "
            "lease), report (only say so) or off. Default: enforce; report with "
            "--device-plugin, whose pods' processes no `gpupool run` attaches.",
        ),
    ] = None,
    direct_socket: Annotated[
        Path | None,
        typer.Option(
            "--direct-socket",
            help="Where `gpupool run` attaches direct programs to the watch (default: "
            "direct.sock in --data-dir); tenants' users must be able to reach it.",
        ),
    ] = None,
    worker_user: Annotated[
        str,
        typer.Option(
            "--worker-user",
            help="Run remote slices' workers as this unprivileged user when the agent runs as "
            "root (created as a system user if missing); '' runs them as root.",
        ),
    ] = "gpupool-worker",
    ready_workers: Annotated[
        int | None,
        typer.Option(
            "--ready-workers",
            envvar="GPUPOOL_READY_WORKERS",
            help="Workers kept started ahead of their leases, per GPU that takes remote "
            "leases (0..8): a new remote lease takes one instead of waiting seconds for a "
            "worker to start; 0 starts every worker cold. Default: 1, and 0 where workers run "
            "under MPS (give it to have them there too).",
        ),
    ] = None,
) -> None:
    watch_modes = ("enforce", "report", "off")
    if direct_watch is not None and direct_watch not in watch_modes:
        raise BadInput(
            f"--direct-watch must be one of {', '.join(watch_modes)}, got {direct_watch!r}"
        )
    if room_timeout is not None and not 0 < room_timeout <= 3600:
        raise BadInput(f"--room-timeout must be in (0, 3600] seconds, got {room_timeout:g}")
    if interval <= 0:
        raise BadInput(f"--interval must be more than 0, got {interval:g}")
    if ready_workers is not None and not 0 <= ready_workers <= 8:
        raise BadInput(f"--ready-workers must be 0..8, got {ready_workers}")
    if not 1 <= vgpu_slots <= 100:
        raise BadInput(f"--vgpu-slots must be 1..100, got {vgpu_slots}")
    if cdi_devices not in ("none", "uuid", "index"):
        raise BadInput(f"--cdi-devices must be none, uuid or index, got {cdi_devices!r}")
    if device_plugin and not kubelet_dir.is_dir():
        raise BadInput(f"--kubelet-dir {kubelet_dir} is not a directory (is the kubelet here?)")
    if (
        device_plugin
        and not insecure_no_pod_check
        and not os.environ.get("KUBERNETES_SERVICE_HOST")
    ):
        raise BadInput(
            "--device-plugin reads its node's pods from the API server with its pod's service "
            "account, and this is no Kubernetes pod (no KUBERNETES_SERVICE_HOST); "
            "--insecure-no-pod-check goes without (a pod past the webhook may get another's lease)"
        )
    if not 0 <= api_port <= 65535:
        raise BadInput(f"--api-port must be 0..65535, got {api_port}")
    with imports_without_gc():
        from gpupool.agent.service import AgentSettings, run_agent
        from gpupool.agent.watch import WatchMode

    controller_url = resolve_url(url) if url else cli_context(ctx).url
    token = resolve_token(controller_url, cli_context(ctx).token)
    joining = bool(os.environ.get("GPUPOOL_JOIN_TOKEN", "").strip())
    if token is None and not joining:
        raise BadInput(
            "the agent needs an API token: make one for this node with "
            "`gpupool token create NODE --role agent --node NODE` and give it with --token or "
            "GPUPOOL_TOKEN (or give a join token in GPUPOOL_JOIN_TOKEN)"
        )
    worker_cert, worker_key = tls_files(tls_cert, tls_key)
    if worker_user and os.geteuid() == 0:
        from gpupool.agent.isolation import WorkerUserError, check_runs_worker
        from gpupool.agent.isolation import worker_user as resolve_worker_user

        try:
            resolved = resolve_worker_user(worker_user)  # made now, or refused with its reason
            if resolved is not None:
                check_runs_worker(resolved)
        except WorkerUserError as exc:
            raise BadInput(f"--worker-user: {exc}") from None
    try:
        settings = AgentSettings(
            controller_url=controller_url,
            token=token,
            tls_cert=worker_cert,
            tls_key=worker_key,
            node_name=node or socket.gethostname(),
            fake_spec=fake,
            heartbeat_interval_s=interval,
            data_dir=data_dir,
            address=address,
            api_host=api_host,
            api_port=api_port,
            device_plugin_dir=kubelet_dir if device_plugin else None,
            device_plugin_slots=vgpu_slots,
            device_plugin_nodes=device_nodes,
            device_plugin_cdi=None if cdi_devices == "none" else cdi_devices,
            device_plugin_pod_check=not insecure_no_pod_check,
            mps_shm_dir=mps_shm_dir,
            room_timeout_s=room_timeout,
            direct_watch=WatchMode(direct_watch) if direct_watch is not None else None,
            direct_socket=direct_socket,
            worker_user=worker_user if os.geteuid() == 0 else None,
            ready_workers=ready_workers,
        )
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if fake is None:
        if not real_gpus_found(settings.node_name):
            raise CommandFailed(
                f"no NVIDIA GPU found on this machine; use --fake {DEFAULT_FAKE_SPEC} "
                "to simulate GPUs"
            )
    else:
        check_fake_spec(fake)
        if banner:
            stderr_console().print(simulated_banner(fake, "--fake was given"))
    quiet_http_logs()
    run_agent(settings)


def demo(
    ctx: typer.Context,
    keep: Annotated[
        bool,
        typer.Option("--keep", help="Keep the pool running after the demo, until Ctrl-C."),
    ] = False,
    seconds: Annotated[
        float, typer.Option("--seconds", help="How long each training job runs.")
    ] = 4.0,
) -> None:
    from gpupool.cli.demo import run_demo

    if not 0.5 <= seconds <= 600:
        raise BadInput(f"--seconds must be 0.5..600, got {seconds:g}")
    raise typer.Exit(run_demo(keep=keep, job_seconds=seconds))
