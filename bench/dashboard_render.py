"""How fast the controller answers what the dashboard's overview needs, with 1,000 GPUs and
5,000 leases: the page itself (`GET /`) and its data (`GET /api/v1/dashboard/overview`),
plus the other pages' data and /metrics for comparison. The target is under 300 ms.

Starts a real controller process (SQLite), registers 125 simulated servers of 8 GPUs with
telemetry, creates 5,000 leases (most granted, some queued), then times sequential requests
on one keep-alive connection over loopback; that time is the server's plus a loopback round
trip. With --browser (and Chromium at /usr/bin/chromium) it also times the page's first full
paint of the overview in headless Chromium. Writes bench/results/dashboard_render.json.

    python bench/dashboard_render.py [--gpus 1000] [--leases 5000] [--repeat 30] [--browser]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _http import HttpConnection

RESULTS = Path(__file__).resolve().parent / "results" / "dashboard_render.json"
GPUS_PER_NODE = 8
TARGET_MS = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_controller(port: int, data_dir: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "gpupool.cli", "controller", "--port", str(port)]
    argv += ["--data-dir", data_dir, "--lease-ttl", "86400", "--node-timeout", "86400"]
    log = open(Path(data_dir) / "controller.log", "wb")  # noqa: SIM115 - lives with the process
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the controller exited; see its log")
        try:
            if httpx.get(url + "/api/v1/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the controller did not start")


def populate_nodes(url: str, gpus: int) -> None:
    rng = random.Random(1)
    with httpx.Client(base_url=url + "/api/v1", timeout=60) as c:
        for n in range(gpus // GPUS_PER_NODE):
            name = f"node-{n:04d}"
            inventory = [
                {"uuid": f"GPU-{name}-{i}", "index": i, "model": "H100-80GB (simulated)",
                 "memory_mib": 81920, "simulated": True}
                for i in range(GPUS_PER_NODE)
            ]  # fmt: skip
            c.post("/nodes", json={"name": name, "gpus": inventory}).raise_for_status()
            telemetry = [
                {"uuid": g["uuid"], "utilization_pct": rng.uniform(0, 100),
                 "memory_used_mib": rng.randint(0, 81920), "temperature_c": rng.uniform(30, 80),
                 "power_w": rng.uniform(60, 700)}
                for g in inventory
            ]  # fmt: skip
            host = {"cpu_pct": rng.uniform(0, 100), "load1": 3.0, "memory_used_mib": 100_000,
                    "memory_total_mib": 512_000, "net_sent_bytes": 10**9, "net_recv_bytes": 10**9,
                    "disk_used_mib": 10**5, "disk_total_mib": 10**6}  # fmt: skip
            c.post(f"/nodes/{name}/heartbeat", json={"telemetry": telemetry, "host": host})


async def create_leases(port: int, total: int, queued: int, clients: int = 16) -> dict[str, int]:
    """`total - queued` slices of 20 % (they fill the pool), then requests that must wait."""
    granted = total - queued
    bodies: list[dict[str, Any]] = [
        {"compute_pct": 20, "memory": "8GiB", "holder": f"user-{k % 97}@nb", "ttl_s": 86400}
        for k in range(granted)
    ]
    bodies += [
        {"compute_pct": 100, "memory": "40GiB", "holder": f"waiter-{k}", "ttl_s": 86400}
        for k in range(queued)
    ]
    states: dict[str, int] = {}
    position = 0

    async def worker() -> None:
        nonlocal position
        conn = HttpConnection("127.0.0.1", port)
        await conn.connect()
        try:
            while position < len(bodies):
                body = bodies[position]
                position += 1
                status, out = await conn.request("POST", "/api/v1/leases", body)
                if status != 201:
                    raise SystemExit(f"lease request failed: {status} {out}")
                states[out["state"]] = states.get(out["state"], 0) + 1
        finally:
            await conn.close()

    # Granted ones first (in order), so that the queued ones find the pool full.
    await asyncio.gather(*(worker() for _ in range(clients)))
    return states


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def time_get(port: int, path: str, repeat: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    times: list[float] = []
    size = 0
    for k in range(repeat + 2):
        started = time.perf_counter()
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        elapsed = (time.perf_counter() - started) * 1000
        if response.status != 200:
            raise SystemExit(f"GET {path}: HTTP {response.status}")
        if k >= 2:  # the first two warm caches and the connection
            times.append(elapsed)
        size = len(body)
    conn.close()
    return {
        "path": path,
        "requests": len(times),
        "p50_ms": round(statistics.median(times), 2),
        "p95_ms": round(percentile(times, 95), 2),
        "max_ms": round(max(times), 2),
        "bytes": size,
    }


def time_browser(url: str, gpus: int) -> dict[str, Any] | None:
    chromium = "/usr/bin/chromium"
    if not os.access(chromium, os.X_OK):
        return None
    from playwright.sync_api import sync_playwright

    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
    runs = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=args)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        for _ in range(3):
            started = time.perf_counter()
            page.goto(url + "/?fresh=" + str(time.time()))
            page.locator("[data-testid=gpu-tile]").nth(gpus - 1).wait_for(timeout=60_000)
            page.locator("#chart-util svg").wait_for(timeout=60_000)
            runs.append((time.perf_counter() - started) * 1000)
        browser.close()
    return {
        "what": "navigation to overview fully drawn (all GPU tiles)",
        "runs_ms": [round(r) for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--leases", type=int, default=5000)
    parser.add_argument("--queued", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--browser", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_controller(port, data_dir)
        try:
            wait_ready(url, proc)
            started = time.perf_counter()
            populate_nodes(url, args.gpus)
            states = asyncio.run(create_leases(port, args.leases, args.queued))
            setup_s = time.perf_counter() - started
            time.sleep(2.5)  # a few samples in the history, alerts evaluated
            pool = httpx.get(url + "/api/v1/pool").json()
            rows = [
                time_get(port, "/", args.repeat),
                time_get(port, "/api/v1/dashboard/overview", args.repeat),
                time_get(port, "/api/v1/dashboard/servers", args.repeat),
                time_get(port, "/api/v1/queue", max(5, args.repeat // 3)),
                time_get(port, "/api/v1/leases?limit=500", max(5, args.repeat // 3)),
                time_get(
                    port,
                    "/api/v1/history?keys=pool.utilization_pct,pool.compute_granted_pct,"
                    "pool.compute_used_pct,pool.queue_length&range_s=86400",
                    args.repeat,
                ),
                time_get(port, "/metrics", max(5, args.repeat // 3)),
            ]
            browser = time_browser(url, args.gpus) if args.browser else None
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    overview = rows[0]["p95_ms"] + rows[1]["p95_ms"]
    result = {
        "benchmark": "dashboard_render",
        "target": f"overview (page + its data) under {TARGET_MS:g} ms server-side",
        "gpus": args.gpus,
        "leases_created": args.leases,
        "lease_states": states,
        "pool": {k: pool[k] for k in ("gpus", "leases", "queued", "compute_granted_pct")},
        "setup_s": round(setup_s, 1),
        "overview_p95_ms": round(overview, 2),
        "meets_target": overview < TARGET_MS,
        "requests": rows,
        "browser": browser,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
