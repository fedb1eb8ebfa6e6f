"""A pool spread over hosts: controller, agents and a client each in a network namespace.

Built on `netns.Fabric`: the controller listens on its host's address, each agent runs the
fake backend with its own node name and announces its host's address (workers listen
there), and commands a user would type run in the client host. The test process watches
through the SDK over a forwarded Unix socket (it is on none of the hosts' networks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from netns import Fabric, Host

from gpupool.client.sdk import ApiError, ControllerUnreachable, PoolClient
from tests.timing import scaled

CTL_PORT = 8900
ACTOR = "netns-tester"
FAKE_SPEC = "1xH100-80GB"
AGENT_INTERVAL_S = 0.3
START_TIMEOUT_S = 90.0

T = TypeVar("T")


def gpupool_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpupool.cli", *args]


@dataclass
class NetPool:
    fabric: Fabric
    workdir: Path
    ctl: Host
    client: Host
    agents: dict[str, Host]
    controller_args: list[str] = field(default_factory=list)
    controller: subprocess.Popen[bytes] | None = None
    agent_procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _uds: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.ctl.address}:{CTL_PORT}"

    # ---- the controller --------------------------------------------------------------------

    def start_controller(self, *args: str) -> None:
        """Start (or start again, same data dir) the controller and wait until it answers."""
        if args:
            self.controller_args = list(args)
        argv = gpupool_argv(
            "controller", "--host", "0.0.0.0", "--port", str(CTL_PORT),
            "--data-dir", str(self.workdir / "ctl"), *self.controller_args,
        )  # fmt: skip
        self.controller = self.ctl.popen(argv, self.workdir / "controller.log")
        if self._uds is None:
            self._uds = self.fabric.forward(self.ctl, CTL_PORT)
        proc = self.controller
        self.wait_for("the controller to answer", lambda: proc.poll() is None and self._health())

    def kill9_controller(self) -> None:
        assert self.controller is not None
        self.controller.send_signal(signal.SIGKILL)
        self.controller.wait(timeout=scaled(10))

    def _health(self) -> bool:
        try:
            with self.api(timeout=scaled(2)) as api:
                api.health()
            return True
        except (ApiError, ControllerUnreachable):
            return False

    # ---- agents ----------------------------------------------------------------------------

    def start_agent(self, name: str, fake: str = FAKE_SPEC) -> None:
        host = self.agents[name]
        argv = gpupool_argv(
            "agent", "--url", self.url, "--node", name, "--fake", fake,
            "--interval", str(AGENT_INTERVAL_S), "--data-dir", str(self.workdir / f"agent-{name}"),
            "--address", host.address, "--api-host", host.address,
        )  # fmt: skip
        self.agent_procs[name] = host.popen(
            argv, self.workdir / f"agent-{name}.log", env=self.env()
        )

    def kill9_agent(self, name: str) -> None:
        proc = self.agent_procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=scaled(10))

    def wait_nodes_up(self, *names: str) -> None:
        def up() -> bool:
            nodes = {n.name: n for n in self.call(lambda api: api.nodes())}
            return all(name in nodes and nodes[name].state == "up" for name in names)

        self.wait_for(f"nodes {', '.join(names)} up", up)

    def worker_pids(self, name: str) -> list[int]:
        """The worker processes running in an agent's host."""
        out = []
        for pid in self.agents[name].pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"gpupool.worker" in cmdline:
                out.append(pid)
        return out

    # ---- users -----------------------------------------------------------------------------

    def cli(self, *args: str, host: Host | None = None, timeout: float = 120) -> Any:
        """Run `gpupool ARGS` in the client host (or `host`), as a user would."""
        return (host or self.client).run(
            gpupool_argv("--url", self.url, *args), timeout=scaled(timeout), env=self.env()
        )

    def spawn(self, *args: str, log: str, host: Host | None = None) -> subprocess.Popen[bytes]:
        return (host or self.client).popen(
            gpupool_argv("--url", self.url, *args), self.workdir / log, self.env()
        )

    def python(self, script: Path, *args: str, log: str, host: Host | None = None) -> Any:
        return (host or self.client).popen(
            [sys.executable, str(script), self.url, *args], self.workdir / log, self.env()
        )

    def env(self) -> dict[str, str]:
        """The environment of agents and users: the controller's admin token, once it writes
        one (`<data-dir>/admin.token`), as GPUPOOL_TOKEN."""
        env = dict(os.environ)
        token = self.workdir / "ctl" / "admin.token"
        if token.exists():
            env["GPUPOOL_TOKEN"] = token.read_text().strip()
        return env

    # ---- watching --------------------------------------------------------------------------

    def api(self, timeout: float = 10) -> PoolClient:
        """The SDK, reaching the controller through the forwarded Unix socket."""
        assert self._uds is not None, "start the controller first"
        return PoolClient(
            self.url,
            actor=ACTOR,
            timeout=scaled(timeout),
            transport=httpx.HTTPTransport(uds=str(self._uds)),
        )

    def call(self, query: Callable[[PoolClient], T]) -> T:
        with self.api() as api:
            return query(api)

    def wait_for(self, what: str, check: Callable[[], Any], timeout_s: float = 60) -> Any:
        deadline = time.monotonic() + scaled(timeout_s)
        while True:
            try:
                value = check()
            except (ApiError, ControllerUnreachable):
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.25)

    def logs(self, tail: int = 2500) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-tail:]}"
            for log in sorted(self.workdir.glob("*.log"))
        )


def build(workdir: Path, agents: tuple[str, ...] = ("gpu-a", "gpu-b")) -> Iterator[NetPool]:
    """Hosts `ctl`, one per agent, and `client`; nothing started yet. Cleans up on exit."""
    fabric = Fabric(workdir)
    try:
        ctl = fabric.add_host("ctl")
        hosts = {name: fabric.add_host(name) for name in agents}
        client = fabric.add_host("client")
        os.environ.pop("GPUPOOL_URL", None)
        yield NetPool(fabric, workdir, ctl, client, hosts)
    finally:
        fabric.close()
