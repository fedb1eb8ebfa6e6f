"""Device-to-host reads through the pool against the link's own speed, on CPU workers.

For each transport (tcp: loopback TCP without shared memory; shm: the worker's Unix socket
with the shared read arena) a client child attaches to a fresh CPU worker and times
`.cpu()` of remote tensors of 64 MiB and 1 MiB (best of several), a 64 MiB put for
comparison, and the `.item()` round trip (which must not get worse). The link's own speed
is measured in the same run with the same buffers: a plain TCP socket on loopback sending
64 MiB from a buffer into a preallocated one (what a read at the link's speed would do),
and for shm one memcpy of 64 MiB (the arena's bound).

    PYTHONPATH=src python bench/d2h_bandwidth.py --out bench/results/d2h_bandwidth.json
    python bench/d2h_bandwidth.py --worker-device cuda:0     # a CUDA worker (GPU host)

The client runs without a GPU (CUDA_VISIBLE_DEVICES=""), whatever the worker's device.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-d2h"
LEASE = "bench-d2h"
MiB = 1 << 20


def tcp_link(nbytes: int, repeats: int = 5) -> float:
    """GB/s of one socket on loopback, sender's buffer into the receiver's preallocated one."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    payload = memoryview(bytearray(os.urandom(MiB)) * (nbytes // MiB))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            for _ in range(repeats):
                conn.recv(1)
                conn.sendall(payload)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    dest = memoryview(bytearray(nbytes))
    dest[:] = payload  # pages touched, as a reused output's are
    best = float("inf")
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(repeats):
            start = time.perf_counter()
            conn.sendall(b"g")
            got = 0
            while got < nbytes:
                got += conn.recv_into(dest[got:])
            best = min(best, time.perf_counter() - start)
    thread.join()
    listener.close()
    return nbytes / best / 1e9


def memcpy_link(nbytes: int) -> float:
    import torch

    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(address: str, worker_pid: int) -> dict[str, Any]:
    import torch

    import gpupool.torch

    torch.set_num_threads(1)
    gpupool.torch.attach(workers=[address], token=TOKEN, lease=LEASE)
    out: dict[str, Any] = {}
    x = torch.zeros((), device="cuda")
    for _ in range(50):
        x.add_(1).item()
    reads = 1000
    start = time.perf_counter()
    for _ in range(reads):
        x.add_(1).item()
    out["item_us"] = (time.perf_counter() - start) / reads * 1e6
    for mib, repeats in ((64, 5), (1, 50)):
        host = torch.randn(mib * MiB // 4)
        dev = host.to("cuda")
        torch.cuda.synchronize()
        times = []
        client_cpu, worker_cpu = time.process_time(), cpu_s(worker_pid)
        for _ in range(repeats):
            start = time.perf_counter()
            back = dev.cpu()
            times.append(time.perf_counter() - start)
        # CPU per GB read, each side: what a loaded host's speed is bound by.
        gb = repeats * mib * MiB / 1e9
        out[f"d2h_{mib}mib_client_cpu_s_per_gb"] = (time.process_time() - client_cpu) / gb
        out[f"d2h_{mib}mib_worker_cpu_s_per_gb"] = (cpu_s(worker_pid) - worker_cpu) / gb
        assert torch.equal(back, host), "the bytes came back different"
        out[f"d2h_{mib}mib_gb_s"] = mib * MiB / min(times) / 1e9
        out[f"d2h_{mib}mib_median_ms"] = statistics.median(times) * 1e3
        del back
    host = torch.randn(64 * MiB // 4)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dev = host.to("cuda")
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    out["h2d_64mib_gb_s"] = 64 * MiB / min(times) / 1e9
    return out


def run_transport(name: str, listen: str, device: str) -> dict[str, Any]:
    from gpupool.protocol.v1.dataplane import WorkerCredentials, start_worker_process

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        credentials = WorkerCredentials.generate(TOKEN, "bench-d2h-peer")
        proc, ready = start_worker_process(
            LEASE, credentials, device=device, listen=listen.format(tmp=tmp),
            threads=1 if device == "cpu" else None, env=env, log_file=Path(tmp) / "worker.log",
        )  # fmt: skip
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--child", str(ready.address), str(ready.pid)],
                capture_output=True, text=True, timeout=600, cwd=ROOT,
                env={**env, "CUDA_VISIBLE_DEVICES": ""},
            )  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(30)
    if done.returncode:
        return {"error": done.stderr[-3000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--label", default="")
    parser.add_argument("--worker-device", default="cpu", help="cpu, or cuda:0 on a GPU host")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return 0
    result: dict[str, Any] = {
        "machine": f"{args.worker_device} workers ({platform.machine()}, {os.cpu_count()} cores)",
        "tcp_link_64mib_gb_s": tcp_link(64 * MiB),
        "memcpy_64mib_gb_s": memcpy_link(64 * MiB),
    }
    for name, listen in (("tcp", "tcp://127.0.0.1:0"), ("shm", "unix://{tmp}/w.sock")):
        row = result[name] = run_transport(name, listen, args.worker_device)
        link = result["tcp_link_64mib_gb_s"] if name == "tcp" else result["memcpy_64mib_gb_s"]
        if "d2h_64mib_gb_s" in row:
            row["d2h_64mib_of_link"] = row["d2h_64mib_gb_s"] / link
    print(json.dumps(result, indent=1))
    if args.out:
        runs = json.loads(args.out.read_text()) if args.out.exists() else {}
        runs[args.label or "run"] = result
        args.out.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
