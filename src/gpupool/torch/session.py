"""The client's side of an elastic slice: answering swap and move notices, resuming, following.

A worker never changes the client's state behind its back: it sends a NOTICE, and the client
answers in its own op stream (see `gpupool.worker.elastic`). All of it runs with the stream's
lock held, so no batch goes out between the answer and its reply:

- "swap": when nothing waits to be sent, the client sends SWAP; from then on the stream is
  `swapped`, and the next batch is preceded by a RESUME that waits for a GPU.
- "move": the client sends RESUME now; the worker hands the state to its successor and names
  it; the client reconnects there with the lease's token. Records already queued go to the
  new worker, so the program sees a pause and nothing else.

The stream reads the notices (`gpupool.torch.stream.on_notice`); this module, above it as a
move opens a new stream connection, answers them: importing it sets `stream.settle`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gpupool.protocol.v1.dataplane import (
    DataPlaneError,
    Kind,
    Rec,
    pack_records,
    parse_address,
)
from gpupool.torch import stream as stream_module
from gpupool.torch.stream import DeviceStream, open_stream

log = logging.getLogger("gpupool.torch.session")


def settle(stream: DeviceStream, idle: bool) -> None:
    """Answer a pending notice, and resume a swapped stream before it sends ops (lock held).

    `idle`: called by the background flusher with nothing queued, the one moment a swap is
    what the program wants; a busy program's notice is dropped and the worker asks again."""
    state = stream.elastic
    event, state.event = state.event, None
    if event == "move":
        resume(stream)
        return
    if event == "swap" and not state.swapped:
        if idle and not stream.records:
            answer = _request(stream, Rec.SWAP)
            if isinstance(answer, dict):
                state.last_swap_s = float(answer.get("seconds", 0.0))
                state.last_bytes = int(answer.get("bytes", 0))
            state.swapped = True
            state.swaps += 1
        return
    if state.swapped and not idle and stream.records:
        resume(stream)


def resume(stream: DeviceStream) -> None:
    """RESUME: wait until the state is on a GPU again, here or on the successor worker."""
    state = stream.elastic
    started = time.perf_counter()
    answer = _request(stream, Rec.RESUME)
    state.swapped = False
    state.resumes += 1
    target = answer.get("to") if isinstance(answer, dict) else None
    if isinstance(target, str):
        follow(stream, target)
        state.moves += 1
        state.last_bytes = int(answer.get("bytes", 0))
        path = answer.get("path")
        state.last_path = path if isinstance(path, str) else None
    state.last_pause_s = time.perf_counter() - started
    state.paused_s += state.last_pause_s
    log.info("%s resumed after %.3f s", stream.device, time.perf_counter() - started)


def follow(stream: DeviceStream, address: str) -> None:
    """Reconnect the stream to the worker that holds its state now."""
    fresh = open_stream(
        stream.index, parse_address(address), stream.lease, stream.token, stream.shm_mib
    )
    old_conn = stream.conn
    stream.adopt_connection(fresh)
    old_conn.close()


def _request(stream: DeviceStream, kind: Rec) -> Any:
    """A request sent ahead of whatever is queued (queued records need its outcome first)."""
    req = next(stream._requests)
    try:
        stream.conn.send_body(pack_records([Kind.BATCH], [[kind, req]]))
    except DataPlaneError as exc:
        stream._lost(exc)
    stream.round_trips += 1
    return stream._receive_result(req)


stream_module.settle = settle
