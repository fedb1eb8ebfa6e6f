"""Takeover time of high availability: three `gpupool controller --ha` on one PostgreSQL, a
fake-GPU agent and a client creating and releasing leases through all of them; the leader
is killed with SIGKILL, round after round, and restarted as a standby.

Per round: `takeover_s`, from the kill to the first survivor that answers as leader of a
new epoch; `client_gap_s`, the longest time the client went without a completed write
around the kill (what a user sees: the SDK retries by itself, no call fails). At the end the
database is checked: every lease the client was told about exists, none twice.

    .venv/bin/python bench/ha_takeover.py [--rounds 5]  → bench/results/ha_takeover.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psycopg

from gpupool.client.sdk import PoolClient
from gpupool.protocol.v1.api import LeaseCreate
from gpupool.protocol.v1.tokens import new_token

# The controllers this benchmark starts install this admin token, and every client sends it.
os.environ.setdefault("GPUPOOL_ADMIN_TOKEN", new_token()[2])
os.environ.setdefault("GPUPOOL_TOKEN", os.environ["GPUPOOL_ADMIN_TOKEN"])
AUTH = {"Authorization": f"Bearer {os.environ['GPUPOOL_TOKEN']}"}

RESULTS = Path(__file__).parent / "results" / "ha_takeover.json"
PG_ADMIN = os.environ.get("GPUPOOL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
GP = [sys.executable, "-m", "gpupool.cli"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ha_status(url: str) -> dict[str, Any] | None:
    try:
        response = httpx.get(url + "/api/v1/ha", timeout=1, headers=AUTH)
    except httpx.HTTPError:
        return None
    return dict(response.json()) if response.status_code == 200 else None


class Cluster:
    def __init__(self, db: str, work: Path, size: int) -> None:
        self.db = db
        self.work = work
        self.ports = [free_port() for _ in range(size)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for port in self.ports:
            self.start(port)
        for url in self.urls:
            self.wait_healthy(url)

    def start(self, port: int) -> None:
        url = f"http://127.0.0.1:{port}"
        log = open(self.work / f"controller-{port}.log", "ab")  # noqa: SIM115 - with the process
        args = ["controller", "--ha", "--db", self.db, "--port", str(port)]
        args += ["--data-dir", str(self.work / f"ctl-{port}")]
        self.procs[url] = subprocess.Popen([*GP, *args], stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, url: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ha_status(url) is not None:
                return
            time.sleep(0.1)
        raise RuntimeError(f"controller {url} did not start")

    def leader(self) -> tuple[str, int]:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for url in self.urls:
                status = ha_status(url)
                if status is not None and status["role"] == "leader":
                    return url, int(status["epoch"])
            time.sleep(0.05)
        raise RuntimeError("no leader")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


class Client:
    """Creates, heartbeats and releases leases in a loop through every controller."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done_at: list[float] = []
        self.made: list[str] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        with PoolClient(self.url, actor="bench") as sdk:
            while not self.stop.is_set():
                try:
                    lease = sdk.create_lease(LeaseCreate(compute_pct=5, memory="1GiB"))
                    self.made.append(lease.id)
                    self.done_at.append(time.monotonic())
                    sdk.heartbeat_lease(lease.id)
                    sdk.release_lease(lease.id)
                    self.done_at.append(time.monotonic())
                except Exception as exc:  # the benchmark counts them
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.1)

    def gap_around(self, moment: float) -> float:
        before = max((t for t in self.done_at if t <= moment), default=moment)
        after = min((t for t in self.done_at if t > moment), default=float("nan"))
        return after - before


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    name = f"gpupool_ha_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    db = PG_ADMIN.rsplit("/", 1)[0] + "/" + name
    work = Path(tempfile.mkdtemp(prefix="gpupool-ha-bench-"))
    cluster: Cluster | None = None
    agent: subprocess.Popen[bytes] | None = None
    rounds: list[dict[str, float]] = []
    try:
        cluster = Cluster(db, work, 3)
        leader, _ = cluster.leader()
        all_urls = ",".join(cluster.urls)
        agent_log = open(work / "agent.log", "ab")  # noqa: SIM115 - with the process
        agent = subprocess.Popen(
            [*GP, "agent", "--url", all_urls, "--fake", "2xH100-80GB", "--interval", "0.5",
             "--data-dir", str(work / "agent")],
            stdout=agent_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        while len(httpx.get(leader + "/api/v1/gpus", timeout=5, headers=AUTH).json()) < 2:
            time.sleep(0.1)
        client = Client(all_urls)
        client.thread.start()
        for _ in range(args.rounds):
            time.sleep(3)
            leader, epoch = cluster.leader()
            killed_at = time.monotonic()
            cluster.procs[leader].kill()
            cluster.procs[leader].wait()
            while True:
                found = [
                    s
                    for u in cluster.urls
                    if u != leader
                    and (s := ha_status(u)) is not None
                    and s["role"] == "leader"
                    and s["epoch"] > epoch
                ]
                if found:
                    break
                time.sleep(0.02)
            takeover_s = time.monotonic() - killed_at
            time.sleep(2)
            rounds.append(
                {
                    "takeover_s": round(takeover_s, 3),
                    "client_gap_s": round(client.gap_around(killed_at), 3),
                }
            )
            print(rounds[-1], flush=True)
            cluster.start(int(leader.rsplit(":", 1)[1]))
            cluster.wait_healthy(leader)
        client.stop.set()
        client.thread.join(timeout=60)
        with psycopg.connect(db) as conn:
            ids = {i for (i,) in conn.execute("SELECT id FROM leases")}
            twice = conn.execute(
                "SELECT count(*) FROM (SELECT request_id FROM leases GROUP BY request_id "
                "HAVING count(*) > 1) d"
            ).fetchone()
        nodes = httpx.get(cluster.urls[0] + "/api/v1/nodes", timeout=5, headers=AUTH).json()
        node_up = nodes[0]["state"]
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=10)
        if cluster is not None:
            cluster.stop()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    takeovers = [r["takeover_s"] for r in rounds]
    gaps = [r["client_gap_s"] for r in rounds]
    result = {
        "controllers": 3,
        "rounds": rounds,
        "takeover_p50_s": round(statistics.median(takeovers), 3),
        "takeover_max_s": max(takeovers),
        "client_gap_p50_s": round(statistics.median(gaps), 3),
        "client_gap_max_s": max(gaps),
        "client_leases_made": len(client.made),
        "client_errors": len(client.errors),
        "leases_lost": len(set(client.made) - ids),
        "leases_made_twice": int(twice[0]) if twice else -1,
        "node_state_after": node_up,
        "ha_tick_s": 0.5,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "machine": f"{platform.machine()}, CPython {platform.python_version()}",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
