"""A ready worker: started before its lease, it serves nobody until its agent hands it one.

A worker's start is mostly torch's import and, on a GPU, the CUDA context: seconds that a new
remote lease would otherwise wait for. An agent keeps a few workers started ahead
(`gpupool.agent.ready`); each has imported torch, loaded the meta kernels that charge ops,
bound its listening socket, and waits for one `Handover` line on its stdin, a pipe only its
agent holds. Until then every connection is refused, whatever role and token it names: a
ready worker has no credentials to admit anyone with. The hand-over brings the lease, the
credentials of every role and the limits; the worker then sets the lease's MPS share into its
environment before its CUDA context exists (an MPS client's share is fixed when it connects),
builds the same `Worker` a cold start builds, and serves on the socket it already had.

Its stdin closed without a hand-over (its agent stopped it or died) ends it at once: a ready
worker never outlives the agent that would hand it over, and is never handed over twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import select
import socket
import ssl
import sys
import threading
from pathlib import Path

import torch

from gpupool.protocol.v1.dataplane import (
    HELLO_TIMEOUT_S,
    MAX_HANDOVER_BYTES,
    ErrorBody,
    ErrorKind,
    Handover,
    Kind,
    ProtocolError,
    recv_handshake,
    send_handshake,
    tune,
)
from gpupool.worker.admission import warm_up_now
from gpupool.worker.server import WorkerConfig, bind, pin_threads, run, tls_context

log = logging.getLogger("gpupool.worker.standby")

NOT_HANDED_OVER = "this worker serves no lease yet"


def run_standby(config: WorkerConfig) -> int:
    """Get ready, say so on the ready pipe, refuse connections until the hand-over, then serve
    the lease as `run` does. Returns (or exits) 0 when the agent closes stdin first."""
    assert config.standby and config.ready_fd is not None
    if config.cpus:
        pin_threads(config.cpus)
    prepare(config)
    bound = bind(config)
    line = {"event": "standby", "address": str(bound[1]), "device": config.device,
            "pid": os.getpid()}  # fmt: skip
    os.write(config.ready_fd, (json.dumps(line) + "\n").encode())
    handover = wait_for_handover(bound[0], tls_context(config))
    if handover is None:
        log.info("the agent closed the hand-over pipe: leaving unused")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    log.info("handed lease %s", handover.lease)
    return run(apply(config, handover), bound)


def prepare(config: WorkerConfig) -> None:
    """What every lease's worker needs and no lease decides: the meta kernels that charge ops
    (seconds of a cold start's first op), the CPU threads, and, where no MPS share is to be
    set, the CUDA context."""
    if config.threads:
        torch.set_num_threads(config.threads)
    warm_up_now()
    if config.context_ahead:
        device = torch.device(config.device)
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # the primary context and the caching allocator
        torch.cuda.synchronize(device)


def apply(config: WorkerConfig, handover: Handover) -> WorkerConfig:
    """The lease's worker configuration; the lease's MPS share goes into the environment now,
    before anything made a CUDA context that would fix another."""
    if handover.mps_env:
        if config.context_ahead:
            raise ProtocolError("this worker made its CUDA context already: no MPS share applies")
        os.environ.update(handover.mps_env)
    return dataclasses.replace(
        config,
        lease_id=handover.lease,
        token=handover.credentials.client,
        control_token=handover.credentials.control,
        peer_token=handover.credentials.peer,
        memory_limit_mib=handover.memory_limit_mib,
        host_memory_limit_mib=handover.host_memory_limit_mib,
        status_file=None if handover.status_file is None else Path(handover.status_file),
        idle_timeout_s=handover.idle_timeout_s,
        standby=False,
    )


def wait_for_handover(listener: socket.socket, tls: ssl.SSLContext | None) -> Handover | None:
    """Refuse every connection until the hand-over line comes on stdin; None if stdin closes
    first. A malformed line ends the worker: its agent is the only writer of that pipe."""
    stdin = sys.stdin.buffer
    while True:
        readable, _, _ = select.select([listener, stdin], [], [])
        if listener in readable:
            with contextlib.suppress(OSError):
                sock, peer = listener.accept()
                threading.Thread(
                    target=_refuse, args=(sock, peer, tls), name="gpupool-refuse", daemon=True
                ).start()
        if stdin in readable:
            line = stdin.readline(MAX_HANDOVER_BYTES)
            if not line:
                return None
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)  # nothing the worker starts inherits the agent's pipe
            os.close(devnull)
            if not line.endswith(b"\n"):
                raise ProtocolError("the hand-over line was cut off")
            return Handover.from_line(line)


def _refuse(sock: socket.socket, peer: object, tls: ssl.SSLContext | None) -> None:
    """Answer a HELLO with AUTH: no role is open before the hand-over."""
    try:
        tune(sock)
        sock.settimeout(HELLO_TIMEOUT_S)
        if tls is not None and sock.family != socket.AF_UNIX:
            sock = tls.wrap_socket(sock, server_side=True)
        with contextlib.suppress(ProtocolError):
            hello = recv_handshake(sock)
            for fd in hello.fds:
                os.close(fd)
        error = ErrorBody(ErrorKind.AUTH, f"refused: {NOT_HANDED_OVER}")
        send_handshake(sock, [Kind.ERROR, None, error.to_wire()])
        log.info("refused a connection from %s: %s", peer or "a local socket", NOT_HANDED_OVER)
    except (OSError, ssl.SSLError, ProtocolError) as exc:
        log.info("refused a connection from %s: %s", peer or "a local socket", exc)
    finally:
        with contextlib.suppress(OSError):
            sock.close()
