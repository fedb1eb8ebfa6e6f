"""Probe: what moving 5 GiB of GPU memory to host memory costs on this machine, by method
(fresh pinned buffer, pageable buffer, pinned staging ring into pageable memory)."""

import time

import torch

GIB = 1 << 30
n = 5 * GIB
src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(7)
torch.cuda.synchronize()


def timed(label, fn):
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    print(f"{label}: {dt:.3f} s ({n / dt / 1e9:.1f} GB/s)", flush=True)
    return out


def pinned_fresh():
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    h.copy_(src, non_blocking=True)
    return h


def pageable_direct():
    h = torch.empty(n, dtype=torch.uint8)
    h.copy_(src)
    return h


def ring(chunk=64 << 20, depth=4):
    out = torch.empty(n, dtype=torch.uint8)
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
    events = [torch.cuda.Event() for _ in range(depth)]
    stream = torch.cuda.Stream()
    pending = []
    with torch.cuda.stream(stream):
        for i, off in enumerate(range(0, n, chunk)):
            k = i % depth
            size = min(chunk, n - off)
            if len(pending) == depth:
                (poff, psize, pk) = pending.pop(0)
                events[pk].synchronize()
                out[poff : poff + psize].copy_(bufs[pk][:psize])
            bufs[k][:size].copy_(src[off : off + size], non_blocking=True)
            events[k].record(stream)
            pending.append((off, size, k))
        for poff, psize, pk in pending:
            events[pk].synchronize()
            out[poff : poff + psize].copy_(bufs[pk][:psize])
    return out


for attempt in range(2):
    h = timed(f"pinned fresh #{attempt}", pinned_fresh)
    del h
timed("pinned reuse of cache", pinned_fresh)
h = timed("pageable direct", pageable_direct)
back = torch.empty_like(src)
timed("restore from pageable", lambda: back.copy_(h))
del h
h = timed("pinned ring into pageable", ring)
timed("restore from pageable (2)", lambda: back.copy_(h, non_blocking=True))
t = time.perf_counter()
x = torch.empty(n, dtype=torch.uint8)
x.fill_(1)
print(f"pageable first touch: {time.perf_counter() - t:.3f} s", flush=True)
t = time.perf_counter()
x.fill_(2)
print(f"pageable second touch: {time.perf_counter() - t:.3f} s", flush=True)
with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
    print(f.read().strip())
