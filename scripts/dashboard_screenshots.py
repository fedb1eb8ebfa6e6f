"""Photograph the dashboard for docs/: a simulated pool (three fake-GPU servers, tenants,
leases, a queue, a faulty GPU) in headless Chromium.

The charts of the overview get a day of synthetic pool history (written to the controller's
history file before it starts) so that they have a shape; everything else is live.

    .venv/bin/python scripts/dashboard_screenshots.py [--out docs] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from gpupool.agent.backends import FakeBackend
from gpupool.agent.service import Agent, AgentSettings
from gpupool.controller.services.history import History, save
from gpupool.protocol.v1.tokens import new_token

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SERVERS = {"gpu-a100-01": "8xA100-80GB", "gpu-h100-01": "8xH100-80GB", "gpu-h100-02": "4xH100-80GB"}
ADMIN = new_token()[2]
ACTOR = {"Authorization": f"Bearer {ADMIN}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def seed_history(path: Path, gpus: int = 20) -> None:
    """A plausible working day: busy office hours, a quiet night, a queue at the morning peak."""
    history = History()
    rng = random.Random(7)
    now = time.time()
    capacity = gpus * 100
    memory_cap = gpus * 81920
    for k in range(24 * 60, 2, -1):
        t = now - k * 60
        hour = time.localtime(t).tm_hour + time.localtime(t).tm_min / 60
        day = max(0.0, math.sin((hour - 7) / 14 * math.pi)) if 7 <= hour <= 21 else 0.0
        granted = capacity * (0.25 + 0.6 * day) + rng.uniform(-40, 40)
        used = granted * (0.55 + 0.2 * rng.random())
        queue = max(0, round(14 * (day - 0.8) * 5 + rng.uniform(-1, 1))) if day > 0.8 else 0
        history.add(
            t,
            {
                "pool.utilization_pct": used / gpus,
                "pool.compute_capacity_pct": capacity,
                "pool.compute_granted_pct": granted,
                "pool.compute_used_pct": used,
                "pool.memory_capacity_mib": memory_cap,
                "pool.memory_granted_mib": memory_cap * granted / capacity * 0.9,
                "pool.memory_used_mib": memory_cap * used / capacity * 0.8,
                "pool.queue_length": queue,
                "pool.queue_wait_s": queue * 45.0,
                "pool.leases_holding": granted / 35,
                "pool.nodes_up": 3,
                "pool.fragmentation": 0.2 + 0.3 * day,
            },
        )
    save(history, path)


class Agents:
    """The three servers' agents, in this process so the script can move their utilisation."""

    def __init__(self, url: str, data_dir: Path) -> None:
        self.url = url
        self.backends = {
            name: FakeBackend.from_spec(spec, node_name=name) for name, spec in SERVERS.items()
        }
        self.agents = [
            Agent(
                AgentSettings(
                    controller_url=url,
                    data_dir=data_dir / name,
                    node_name=name,
                    fake_spec=spec,
                    heartbeat_interval_s=1.0,
                    token=ADMIN,
                ),
                backend=self.backends[name],
            )
            for name, spec in SERVERS.items()
        ]
        self.stop = asyncio.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        tasks = [asyncio.create_task(a.run(self.stop)) for a in self.agents]
        tasks.append(asyncio.create_task(self._drive()))
        await self.stop.wait()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _drive(self) -> None:
        """Make the simulated GPUs look used in proportion to what is granted on them."""
        rng = random.Random(3)
        async with httpx.AsyncClient(
            base_url=self.url + "/api/v1", timeout=5, headers=ACTOR
        ) as client:
            while not self.stop.is_set():
                try:
                    gpus = (await client.get("/gpus")).json()
                except httpx.HTTPError:
                    gpus = []
                for g in gpus:
                    backend = self.backends.get(g["node"])
                    if backend is None or g["mode"] == "isolated":
                        continue
                    granted = g["compute_granted_pct"] / 100
                    util = min(100.0, max(0.0, granted * rng.uniform(55, 98)))
                    backend.set_utilization(g["index"], round(util, 1))
                    memory = int(
                        min(g["memory_mib"], g["memory_granted_mib"] * rng.uniform(0.6, 0.9))
                    )
                    backend.set_memory_used(g["index"], memory)
                await asyncio.sleep(1.0)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=20)


def populate(url: str) -> None:
    with httpx.Client(base_url=url + "/api/v1", timeout=10, headers=ACTOR) as c:
        for name, quota in (
            ("vision", {"max_compute_pct": 600, "max_memory": "480GiB"}),
            ("nlp", {"max_gpus": 4, "max_leases": 12}),
            ("research", {"max_compute_pct": 300, "max_priority": 10}),
        ):
            c.post("/tenants", json={"name": name, "quota": quota}).raise_for_status()
        gpus = {(g["node"], g["index"]): g["uuid"] for g in c.get("/gpus").json()}
        for index in (4, 5, 6, 7):
            c.post(f"/gpus/{gpus[('gpu-h100-01', index)]}/mode", json={"mode": "physical"})
        slices = [
            ("vision", 50, "40GiB", "alice@notebook-3"),
            ("vision", 25, "20GiB", "alice@notebook-4"),
            ("vision", 100, "80GiB", "train-detr-v2"),
            ("vision", 30, "24GiB", "ci-runner-7"),
            ("research", 40, "30GiB", "bob@jupyter"),
            ("research", 20, "16GiB", "carol@jupyter"),
            ("research", 60, "40GiB", "sweep-lr-0.003"),
            ("default", 10, "8GiB", "dave@laptop"),
            ("nlp", 70, "60GiB", "llama-finetune"),
            ("nlp", 35, "24GiB", "eval-harness"),
        ] * 2
        for tenant, pct, memory, holder in slices:
            c.post(
                "/leases",
                json={
                    "tenant": tenant,
                    "compute_pct": pct,
                    "memory": memory,
                    "holder": holder,
                    "ttl_s": 3600,
                    "access": "remote" if "@" in holder else "direct",
                },
            ).raise_for_status()
        c.post(
            "/leases",
            json={
                "tenant": "nlp",
                "physical": True,
                "gpus": 2,
                "holder": "pretrain-7b",
                "ttl_s": 3600,
            },
        ).raise_for_status()
        c.post(
            "/leases",
            json={
                "tenant": "nlp",
                "physical": True,
                "gpus": 4,
                "holder": "pretrain-13b",
                "ttl_s": 3600,
            },
        ).raise_for_status()
        for holder in ("sweep-wd-1e-4", "sweep-wd-3e-4"):
            c.post(
                "/leases",
                json={
                    "tenant": "research",
                    "compute_pct": 100,
                    "memory": "60GiB",
                    "holder": holder,
                    "ttl_s": 3600,
                },
            ).raise_for_status()
        c.post(f"/gpus/{gpus[('gpu-a100-01', 7)]}/drain").raise_for_status()
        agent_url = c.get("/nodes/gpu-h100-02").json()["agent_url"]
        httpx.post(f"{agent_url}/agent/v1/faults", json={"index": 3, "kind": "xid", "value": 48})


def shoot(url: str, out: Path) -> list[Path]:
    from playwright.sync_api import sync_playwright

    shots: list[Path] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 900}, device_scale_factor=1)
        page.goto(f"{url}/")
        page.wait_for_selector("#signin:not([hidden])")
        page.wait_for_timeout(300)
        path = out / "dashboard-signin.png"
        page.screenshot(path=str(path))
        shots.append(path)
        maria = httpx.post(
            f"{url}/api/v1/tokens", json={"name": "maria", "role": "admin"}, headers=ACTOR
        ).json()["token"]
        page.fill("[data-testid=signin-token]", maria)
        page.click("#signin-ok")
        page.wait_for_selector("#signin", state="hidden")

        def snap(
            name: str, hash_: str, ready: str, full: bool = True, click: str | None = None
        ) -> None:
            page.goto(f"{url}/#{hash_}")
            page.wait_for_selector(ready)
            if click:
                page.click(click)
            page.wait_for_timeout(1500)
            path = out / f"dashboard-{name}.png"
            page.screenshot(path=str(path), full_page=full)
            shots.append(path)

        snap("overview", "/", "[data-testid=gpu-tile]", click="[data-range='86400']")
        snap("servers", "/servers", "[data-testid=server]")
        gpus = httpx.get(url + "/api/v1/gpus", headers=ACTOR).json()
        busiest = max(gpus, key=lambda g: (len(g["leases"]), g["uuid"]))["uuid"]
        snap("gpu", f"/gpus/{busiest}", "[data-testid=holder-row]", click="[data-range='900']")
        snap("leases", "/leases", "[data-testid=lease-row]")
        snap("queue", "/queue", "[data-testid=queue-row]")
        snap("tenants", "/tenants", "[data-testid=tenant-row]")
        snap("events", "/events", "[data-testid=event-row]", full=False)
        snap("alerts", "/alerts", "[data-testid=alert]")
        page.goto(f"{url}/#/gpus/{busiest}")
        page.wait_for_selector("[data-testid=holder-row]")
        page.click("[data-action=mode-physical]")
        page.wait_for_selector("#dialog[open]")
        page.wait_for_timeout(300)
        path = out / "dashboard-confirm.png"
        page.screenshot(path=str(path))
        shots.append(path)
        browser.close()
    return shots


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--keep", action="store_true", help="keep the pool running afterwards")
    parser.add_argument("--warmup", type=float, default=45.0, help="seconds of live samples first")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpupool-shots-"))
    seed_history(work / "ctl" / "history.json")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (work / "controller.log").open("wb")
    argv = [sys.executable, "-m", "gpupool.cli", "controller", "--port", str(port)]
    argv += ["--data-dir", str(work / "ctl"), "--lease-ttl", "3600"]
    controller = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "GPUPOOL_ADMIN_TOKEN": ADMIN},
    )
    agents = Agents(url, work / "agents")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/api/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or controller.poll() is not None:
                raise SystemExit(f"controller did not start; see {work / 'controller.log'}")
            time.sleep(0.2)
        agents.start()
        while len(httpx.get(url + "/api/v1/gpus", headers=ACTOR).json()) < 20:
            time.sleep(0.2)
        populate(url)
        time.sleep(args.warmup)
        for path in shoot(url, args.out):
            print(path)
        if args.keep:
            print(f"dashboard at {url}/ ; Ctrl-C stops")
            while True:
                time.sleep(3600)
    finally:
        agents.close()
        controller.terminate()
        controller.wait(timeout=15)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
