"""How fast TCP on loopback moves a large buffer with 1, 2, 4 and 8 connections at once.

The question behind it: a single TCP stream on loopback is bound by one core's copies on each
side; puts that spread their chunks over several connections (as NCCL and iperf -P do) may
move a large tensor faster than one stream can. Each receiver writes into a buffer of the full
size (as a put lands in a tensor-sized staging buffer), so cold-memory writes are counted.

    python bench/gpu/socket_lanes_probe.py [--mib 512]
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time


def run(lanes: int, nbytes: int, source: memoryview, dest: memoryview) -> float:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    share = nbytes // lanes
    done = threading.Barrier(lanes * 2 + 1)

    def receive(conn: socket.socket, start: int) -> None:
        view = dest[start : start + share]
        got = 0
        while got < share:
            got += conn.recv_into(view[got:])
        done.wait()

    def send(start: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ready.wait()
            conn.sendall(source[start : start + share])
            done.wait()

    ready = threading.Event()
    senders = [threading.Thread(target=send, args=(i * share,)) for i in range(lanes)]
    for thread in senders:
        thread.start()
    receivers = []
    conns = []
    for i in range(lanes):
        conn, _ = listener.accept()
        conns.append(conn)
        receivers.append(threading.Thread(target=receive, args=(conn, i * share)))
    for thread in receivers:
        thread.start()
    start = time.perf_counter()
    ready.set()
    done.wait()
    elapsed = time.perf_counter() - start
    for thread in senders + receivers:
        thread.join()
    for conn in conns:
        conn.close()
    listener.close()
    return nbytes / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=512)
    args = parser.parse_args()
    nbytes = args.mib << 20
    source = memoryview(bytearray(nbytes))
    source[:] = bytes(range(256)) * (nbytes // 256)
    dest = memoryview(bytearray(nbytes))
    results = {}
    for lanes in (1, 2, 4, 8):
        results[lanes] = max(run(lanes, nbytes, source, dest) for _ in range(3))
        print(f"{lanes} lanes: {results[lanes]:.2f} GB/s", flush=True)
    print(json.dumps({"mib": args.mib, "gb_s_by_lanes": results}))


if __name__ == "__main__":
    main()
