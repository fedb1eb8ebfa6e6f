"""Lease traffic for fault injection: `python fault_load.py URL OUT.json SECONDS THREADS`.

Each thread asks for small slices (some are granted, some queue), heartbeats what it holds
or waits for, and releases each lease after a moment, for SECONDS. A controller that does
not answer is retried, as a real client would. At the end it writes, per request, what the
controller answered: the lease id and state, or that no answer came (the request may or
may not have been recorded), and which leases it released. The test compares that with the
controller's view after the fault: nothing answered may be missing, nothing may be there
twice, nothing released may come back.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from typing import Any

from gpupool.client.sdk import ApiError, ControllerUnreachable, PoolClient
from gpupool.protocol.v1.api import LeaseCreate

HOLD_MAX = 3
TTL_S = 60.0


def worker(url: str, index: int, until: float, out: list[dict[str, Any]]) -> None:
    rng = random.Random(index)
    held: dict[str, float] = {}  # lease id -> when to release it
    with PoolClient(url, actor=f"load-{index}", timeout=5) as client:
        number = 0
        while time.monotonic() < until:
            if len(held) < HOLD_MAX:
                number += 1
                tag = f"load-{index}-{number}"
                body = LeaseCreate(
                    compute_pct=rng.choice([10, 20, 30]), memory="1GiB", holder=tag, ttl_s=TTL_S
                )
                try:
                    lease = client.create_lease(body)
                except ControllerUnreachable:
                    out.append({"tag": tag, "id": None, "answer": "unreachable"})
                    time.sleep(0.2)
                except ApiError as exc:
                    out.append({"tag": tag, "id": None, "answer": f"error {exc.status}"})
                else:
                    out.append({"tag": tag, "id": lease.id, "answer": lease.state})
                    held[lease.id] = time.monotonic() + rng.uniform(0.5, 3.0)
            for lease_id, due in list(held.items()):
                try:
                    if time.monotonic() >= due:
                        client.release_lease(lease_id)
                        out.append({"tag": None, "id": lease_id, "answer": "released"})
                        del held[lease_id]
                    else:
                        client.heartbeat_lease(lease_id)
                except ControllerUnreachable:
                    time.sleep(0.1)
                except ApiError as exc:
                    out.append({"tag": None, "id": lease_id, "answer": f"error {exc.status}"})
                    del held[lease_id]
            time.sleep(0.05)
        # What is still held stays held: the test checks it survived the fault.
        for lease_id in held:
            out.append({"tag": None, "id": lease_id, "answer": "still held"})


def main() -> None:
    url, path, seconds, threads = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    until = time.monotonic() + seconds
    results: list[list[dict[str, Any]]] = [[] for _ in range(threads)]
    pool = [
        threading.Thread(target=worker, args=(url, i, until, results[i])) for i in range(threads)
    ]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    with open(path, "w") as out:
        json.dump([record for rows in results for record in rows], out)


if __name__ == "__main__":
    main()
