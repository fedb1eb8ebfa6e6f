"""A real pool on loopback for end-to-end tests: `gpupool controller` and `gpupool agent --fake`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gpupool.cli.local import stop_process
from tests.conftest import AUTH
from tests.ports import free_port
from tests.timing import scaled

FAKE_SPEC = "2xH100-80GB"
ACTOR = "admin:bootstrap"
"""Who the e2e commands act as: the admin token every test controller installs."""
START_TIMEOUT_S = 60.0
"""On an idle machine; every deadline here is stretched by the suite's slowdown factor."""


def gpupool_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpupool.cli", *args]


@dataclass
class Pool:
    url: str
    workdir: Path
    controller: subprocess.Popen[bytes]
    agent: subprocess.Popen[bytes]

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run `gpupool --url URL ARGS` as a user would, in a shell of its own."""
        env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_URL"}
        return subprocess.run(
            gpupool_argv("--url", self.url, *args),
            capture_output=True,
            text=True,
            timeout=scaled(timeout),
            env=env,
        )

    def ok(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        done = self.cli(*args, timeout=timeout)
        assert done.returncode == 0, f"{args}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done

    def json(self, *args: str) -> Any:
        return json.loads(self.ok(*args, "-o", "json").stdout)

    def spawn(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            gpupool_argv("--url", self.url, *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def lease(self, lease_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.json("lease", "show", lease_id)
        return result

    def wait_for(self, what: str, check: Any, timeout_s: float = 20) -> Any:
        deadline = time.monotonic() + scaled(timeout_s)
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
            for log in sorted(self.workdir.glob("*.log"))
        )


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/api/v1/health", timeout=scaled(2)).status_code == 200
    except httpx.HTTPError:
        return False


def gpu_count(url: str) -> int:
    try:
        return len(httpx.get(url + "/api/v1/gpus", timeout=scaled(2), headers=AUTH).json())
    except (httpx.HTTPError, ValueError):
        return 0


def stop(proc: subprocess.Popen[bytes]) -> None:
    stop_process(proc)


def finish(proc: subprocess.Popen[str], timeout_s: float = 60) -> None:
    """Let a program with piped output end (terminated if it still runs), reading its pipes."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.communicate(timeout=scaled(timeout_s))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def start_pool(
    workdir: Path,
    fake_spec: str = FAKE_SPEC,
    *controller_args: str,
    agent_options: tuple[str, ...] = (),
) -> Pool:
    """`gpupool controller` and a fake-GPU agent on loopback, once the agent's GPUs are in;
    stop it with stop_pool, also when this fails half-way (the processes are in `started`).
    `agent_options` go to `gpupool agent` after the pool's own."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["controller", "--port", str(port), "--data-dir", str(workdir / "ctl")]
    with (workdir / "controller.log").open("wb") as log:
        controller = subprocess.Popen(
            gpupool_argv(*args, *controller_args), stdout=log, stderr=subprocess.STDOUT
        )
    pool = Pool(url, workdir, controller, controller)
    try:
        deadline = time.monotonic() + scaled(START_TIMEOUT_S)
        while not healthy(url):
            assert controller.poll() is None, (workdir / "controller.log").read_text()
            assert time.monotonic() < deadline, "controller did not start"
            time.sleep(0.1)
        agent_args = ["--url", url, "--fake", fake_spec, "--interval", "0.3"]
        agent_args += ["--data-dir", str(workdir / "agent"), *agent_options]
        with (workdir / "agent.log").open("wb") as log:
            pool.agent = subprocess.Popen(
                gpupool_argv("agent", *agent_args), stdout=log, stderr=subprocess.STDOUT
            )
        gpus = sum(int(item.split("x")[0]) for item in fake_spec.split(","))
        while gpu_count(url) < gpus:
            assert pool.agent.poll() is None, (workdir / "agent.log").read_text()
            assert time.monotonic() < deadline, "agent did not register its GPUs"
            time.sleep(0.1)
    except BaseException:
        stop_pool(pool)
        raise
    return pool


def stop_pool(pool: Pool) -> None:
    stop(pool.agent)
    stop(pool.controller)


@dataclass
class HaPool(Pool):
    """Several `gpupool controller --ha` sharing one PostgreSQL, and an agent that knows them
    all; `url` is their comma-separated list, so every CLI call and the agent fail over."""

    urls: list[str]
    controllers: dict[str, subprocess.Popen[bytes]]

    def status(self, url: str) -> dict[str, Any] | None:
        try:
            response = httpx.get(url + "/api/v1/ha", timeout=scaled(2), headers=AUTH)
        except httpx.HTTPError:
            return None
        return dict(response.json()) if response.status_code == 200 else None

    def leader(self, timeout_s: float = 30, not_: str | None = None) -> str:
        """The controller that leads by its own word and by every live controller's."""
        deadline = time.monotonic() + scaled(timeout_s)
        while time.monotonic() < deadline:
            alive = [u for u, p in self.controllers.items() if p.poll() is None]
            seen = [self.status(u) for u in alive]
            named = {s["leader"] for s in seen if s is not None}
            if len(named) == 1 and None not in seen:
                leader = named.pop()
                if (
                    leader
                    and leader != not_
                    and (self.status(leader) or {}).get("role") == "leader"
                ):
                    return str(leader)
            time.sleep(0.05)
        raise AssertionError(f"no agreed leader within {scaled(timeout_s):.0f} s\n{self.logs()}")

    def kill9(self, url: str) -> None:
        proc = self.controllers[url]
        proc.kill()
        proc.wait(timeout=scaled(10))


def start_ha_pool(
    workdir: Path, db_url: str, controllers: int = 3, *controller_args: str
) -> HaPool:
    """Start the controllers one after another, then the agent, and wait for its GPUs."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for _ in range(controllers):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        args = ["controller", "--ha", "--db", db_url, "--port", str(port)]
        args += ["--data-dir", str(workdir / f"ctl-{port}"), *controller_args]
        with (workdir / f"controller-{port}.log").open("wb") as log:
            procs[url] = subprocess.Popen(gpupool_argv(*args), stdout=log, stderr=subprocess.STDOUT)
    urls = list(procs)
    deadline = time.monotonic() + scaled(START_TIMEOUT_S)
    for url, proc in procs.items():
        while not healthy(url):
            assert proc.poll() is None, f"controller {url} exited"
            assert time.monotonic() < deadline, f"controller {url} did not start"
            time.sleep(0.1)
    agent_args = ["--url", ",".join(urls), "--fake", FAKE_SPEC, "--interval", "0.3"]
    agent_args += ["--data-dir", str(workdir / "agent")]
    with (workdir / "agent.log").open("wb") as log:
        agent = subprocess.Popen(gpupool_argv("agent", *agent_args), stdout=log, stderr=log)
    pool = HaPool(",".join(urls), workdir, procs[urls[0]], agent, urls, procs)
    while gpu_count(urls[0]) < 2:
        assert agent.poll() is None, (workdir / "agent.log").read_text()
        assert time.monotonic() < deadline, "agent did not register its GPUs"
        time.sleep(0.1)
    return pool


def stop_ha_pool(pool: HaPool) -> None:
    stop(pool.agent)
    for proc in pool.controllers.values():
        stop(proc)
