"""`gpupool demo`: a throw-away pool on loopback, and two training jobs sharing one GPU."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpupool.cli.local import (
    agent_command,
    choose_fake_spec,
    local_node_name,
    stop_process,
    wait_until_healthy,
)
from gpupool.cli.output import (
    duration,
    gpus_table,
    leases_table,
    placement_text,
    seconds_since,
    simulated_banner,
    stdout_console,
)
from gpupool.client.sdk import ApiError, ControllerUnreachable, PoolClient
from gpupool.protocol.v1.api import GpuOut, LeaseOut, TokenCreate, TokenCreated
from gpupool.protocol.v1.tokens import new_token

DEMO_FAKE_SPEC = "1xH100-80GB"
START_TIMEOUT_S = 60.0
JOB_SLACK_S = 120.0
POLL_S = 0.5
_LEASE_LINE = re.compile(r"lease (\S+) granted")
_RESULT_LINE = re.compile(r"first_loss=([0-9.eE+-]+) final_loss=([0-9.eE+-]+)")


class DemoFailed(Exception):
    """A step of the demo went wrong; the message says which, the logs say why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def workload_command(seconds: float) -> list[str]:
    """examples/train_mlp.py of a source checkout, else the copy shipped in the package."""
    example = Path(__file__).resolve().parents[3] / "examples" / "train_mlp.py"
    if example.is_file():
        head = [sys.executable, str(example)]
    else:
        head = [sys.executable, "-m", "gpupool.cli.demo_workload"]
    return [*head, "--seconds", f"{seconds:g}"]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Job:
    """One `gpupool run` of the training workload, its output collected as it comes."""

    label: str
    compute: str
    memory: str
    proc: subprocess.Popen[str] | None = None
    lines: list[str] = field(default_factory=list)
    lease_id: str | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    reader: threading.Thread | None = None

    def start(self, url: str, seconds: float, console: Console, token: str) -> None:
        cmd = [
            sys.executable, "-m", "gpupool.cli", "--url", url, "run",
            "--compute", self.compute, "--memory", self.memory, "--",
            *workload_command(seconds),
        ]  # fmt: skip
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, "GPUPOOL_TOKEN": token},
        )
        assert self.proc.stdout is not None
        self.reader = threading.Thread(
            target=self._read, args=(self.proc.stdout, console), daemon=True
        )
        self.reader.start()

    def _read(self, stream: IO[str], console: Console) -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            self.lines.append(line)
            found = _LEASE_LINE.search(line)
            if found and self.lease_id is None:
                self.lease_id = found.group(1)
            prefix = Text(f"{self.label:>4} ", style="bold cyan")
            console.print(prefix + Text(line), soft_wrap=True)
        self.ended_at = time.monotonic()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def losses(self) -> tuple[float, float] | None:
        for line in reversed(self.lines):
            found = _RESULT_LINE.search(line)
            if found:
                return float(found.group(1)), float(found.group(2))
        return None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        if self.reader is not None:
            self.reader.join(timeout=5)


class Pool:
    """The demo's controller and agent, as child processes logging into the work dir."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        # The demo plays the operator: it hands the controller its admin token, then gives the
        # agent and the jobs tokens of their own roles, as a real deployment would.
        self.admin = new_token()[2]
        self.job_token = ""
        self.agent_token: TokenCreated | None = None
        self.node = local_node_name()

    def _spawn(
        self, name: str, cmd: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = self.workdir / f"{name}.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                cmd, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        self.procs.append((name, proc, log))
        return proc

    def _failed(self, message: str, name: str) -> DemoFailed:
        log = self.workdir / f"{name}.log"
        return DemoFailed(f"{message}; last lines of {log}:\n{_tail(log)}")

    def start_controller(self) -> None:
        cmd = [
            sys.executable, "-m", "gpupool.cli", "controller", "--host", "127.0.0.1",
            "--port", str(self.port), "--data-dir", str(self.workdir / "controller"),
        ]  # fmt: skip
        proc = self._spawn("controller", cmd, {"GPUPOOL_ADMIN_TOKEN": self.admin})
        if not wait_until_healthy(self.url, START_TIMEOUT_S, proc):
            raise self._failed(f"the controller did not come up on {self.url}", "controller")
        with self.client() as client:
            # An agent token acts for one node: the one the demo's agent registers.
            self.agent_token = client.create_token(
                TokenCreate(name="demo-agent", role="agent", node=self.node)
            )
            self.job_token = client.create_token(
                TokenCreate(name="demo-jobs", role="tenant", tenant="default")
            ).token

    def client(self) -> PoolClient:
        return PoolClient(self.url, token=self.admin)

    def start_agent(self, fake_spec: str | None) -> list[GpuOut]:
        proc = self._spawn(
            "agent",
            agent_command(
                self.url, self.workdir / "agent", fake_spec, node=self.node, interval_s=0.5
            ),
            {"GPUPOOL_TOKEN": self.agent_token.token if self.agent_token else ""},
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        with self.client() as client:
            while time.monotonic() < deadline:
                gpus = [g for g in client.gpus() if g.mode == "virtual" and g.healthy]
                if gpus:
                    return gpus
                if proc.poll() is not None:
                    raise self._failed(f"the agent exited with status {proc.returncode}", "agent")
                time.sleep(POLL_S)
        raise self._failed("no GPU was registered by the agent", "agent")

    def stop(self) -> None:
        for _name, proc, _log in reversed(self.procs):
            stop_process(proc)


@dataclass
class Watch:
    """What the pool looked like at its busiest moment while the jobs ran."""

    peak_leases: int = -1
    gpus: list[GpuOut] = field(default_factory=list)
    leases: list[LeaseOut] = field(default_factory=list)

    def shared_gpu(self) -> str | None:
        for gpu in self.gpus:
            if len(gpu.leases) >= 2:
                return gpu.uuid
        return None

    def view(self) -> Group:
        return Group(
            gpus_table(self.gpus, title="GPUs while both jobs ran"),
            leases_table(self.leases, title="their leases"),
        )


def _watch(client: PoolClient, jobs: list[Job], console: Console, deadline: float) -> Watch:
    watch = Watch()

    def sample() -> Group | None:
        try:
            gpus, leases = client.gpus(), client.leases()
        except (ApiError, ControllerUnreachable):
            return None
        granted = sum(1 for lease in leases if lease.state != "queued")
        if granted > watch.peak_leases:
            watch.peak_leases, watch.gpus, watch.leases = granted, gpus, leases
        return Group(gpus_table(gpus, title="GPUs now"), leases_table(leases, title="leases now"))

    with _maybe_live(console) as live:
        while any(job.running() for job in jobs):
            if time.monotonic() > deadline:
                raise DemoFailed("the jobs did not finish in time")
            view = sample()
            if live is not None and view is not None:
                live.update(view)
            time.sleep(POLL_S)
    return watch


@contextmanager
def _maybe_live(console: Console) -> Iterator[Live | None]:
    if not console.is_terminal:
        yield None
        return
    with Live(console=console, transient=True, refresh_per_second=4) as live:
        yield live


def _final_lease(client: PoolClient, lease_id: str) -> LeaseOut:
    """Released leases settle within a moment of `gpupool run` exiting."""
    lease = client.lease(lease_id)
    deadline = time.monotonic() + 5
    while lease.state != "released" and time.monotonic() < deadline:
        time.sleep(0.2)
        lease = client.lease(lease_id)
    return lease


def _summary(client: PoolClient, jobs: list[Job]) -> tuple[Table, list[str]]:
    table = Table(title="demo summary", title_justify="left")
    for column in ("JOB", "LEASE", "ON", "WAITED", "HELD", "LOSS", "EXIT", "LEASE STATE"):
        table.add_column(column)
    problems: list[str] = []
    for job in jobs:
        code = job.proc.returncode if job.proc is not None else None
        losses = job.losses()
        loss_text = f"{losses[0]:.4f} -> {losses[1]:.4f}" if losses else "-"
        if code != 0:
            problems.append(f"the {job.label} job exited with status {code}")
        if job.lease_id is None:
            problems.append(f"the {job.label} job never got a lease")
            table.add_row(job.label, "-", "-", "-", "-", loss_text, str(code), "-")
            continue
        lease = _final_lease(client, job.lease_id)
        if lease.state != "released":
            problems.append(
                f"lease {lease.id} of the {job.label} job is {lease.state}, not released"
            )
        table.add_row(
            job.label,
            lease.id,
            placement_text(lease),
            duration(seconds_since(lease.created_at, lease.granted_at)),
            duration(seconds_since(lease.granted_at, lease.released_at)),
            loss_text,
            str(code),
            lease.state + (f" ({lease.release_reason})" if lease.release_reason else ""),
        )
    return table, problems


def _demo(console: Console, workdir: Path, keep: bool, job_seconds: float) -> None:
    # One simulated GPU, so that the two jobs must share it.
    fake_spec, why = choose_fake_spec(None, default=DEMO_FAKE_SPEC)
    if fake_spec is not None:
        console.print(simulated_banner(fake_spec, why))
    pool = Pool(workdir)
    try:
        console.print(f"starting a controller on {pool.url} (data in {workdir})")
        pool.start_controller()
        console.print("starting an agent for this machine")
        gpus = pool.start_agent(fake_spec)
        console.print(gpus_table(gpus, title="GPUs registered"))
        jobs = [Job("30%", "30%", "8GiB"), Job("70%", "70%", "8GiB")]
        console.print(
            "running examples/train_mlp.py twice at once through `gpupool run`: "
            "--compute 30% --memory 8GiB and --compute 70% --memory 8GiB"
        )
        for job in jobs:
            job.start(pool.url, job_seconds, console, pool.job_token)
        try:
            with pool.client() as client:
                watch = _watch(client, jobs, console, time.monotonic() + job_seconds + JOB_SLACK_S)
                for job in jobs:
                    job.stop()
                console.print(watch.view())
                table, problems = _summary(client, jobs)
        finally:
            for job in jobs:
                job.stop()
        console.print(table)
        shared = watch.shared_gpu()
        if shared is not None:
            console.print(f"both leases were on GPU {shared} at the same time")
        else:
            console.print("[yellow]note: the two leases did not share one GPU this time[/yellow]")
        if problems:
            raise DemoFailed("; ".join(problems))
        console.print(
            "[bold green]demo passed[/bold green]: both jobs trained, both leases were released"
        )
        if keep:
            console.print(
                f"the pool stays up: try `export GPUPOOL_URL={pool.url} "
                f"GPUPOOL_TOKEN={pool.admin}`, then `gpupool gpus` or "
                "`gpupool run -c 50% -- nvidia-smi`; Ctrl-C stops it"
            )
            with suppress(KeyboardInterrupt):
                while all(proc.poll() is None for _n, proc, _l in pool.procs):
                    time.sleep(1)
    finally:
        pool.stop()


def run_demo(keep: bool = False, job_seconds: float = 4.0) -> int:
    """Run the demo; 0 when every check passed."""
    console = stdout_console()
    workdir = Path(tempfile.mkdtemp(prefix="gpupool-demo-"))
    ok = False
    try:
        _demo(console, workdir, keep, job_seconds)
        ok = True
    except DemoFailed as exc:
        console.print(f"[bold red]demo failed[/bold red]: {exc}", soft_wrap=True)
    except KeyboardInterrupt:
        console.print("[yellow]demo interrupted[/yellow]")
    finally:
        if ok and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            console.print(f"logs and data kept in {workdir}")
    return 0 if ok else 1
