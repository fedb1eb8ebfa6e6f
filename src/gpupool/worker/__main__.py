"""`python -m gpupool.worker --lease ID --device cuda:0 --listen tcp://127.0.0.1:0`, or
`--standby` for a ready worker that takes its lease from its agent later."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import BinaryIO

from gpupool.startup import imports_without_gc, tune_gc

with imports_without_gc():  # torch's import: a third of a second less CPU at every lease start
    from gpupool.protocol.v1.dataplane import (
        TOKEN_ENV,
        ProtocolError,
        WorkerCredentials,
        parse_address,
    )
    from gpupool.worker.handoff import PATHS
    from gpupool.worker.room import ROOM_TIMEOUT_S
    from gpupool.worker.server import SPIN_US, WorkerConfig, run
    from gpupool.worker.transfer import PEER_WAIT_S


def parse_args(argv: list[str]) -> WorkerConfig:
    parser = argparse.ArgumentParser(prog="python -m gpupool.worker", description=__doc__)
    parser.add_argument("--lease", default=None, help="the lease this worker serves")
    parser.add_argument(
        "--standby",
        action="store_true",
        help="a ready worker: import torch and listen now, refuse every connection, and take "
        "the lease, its credentials and its limits from one hand-over line on stdin (how an "
        "agent keeps workers ready before their leases)",
    )
    parser.add_argument(
        "--context-ahead",
        action="store_true",
        help="with --standby on a GPU without MPS: make the CUDA context before the hand-over",
    )
    parser.add_argument(
        "--credentials-stdin",
        action="store_true",
        help="read the worker's credentials (client, control and peer secrets) as one JSON "
        "line from stdin before anything else: how an agent starts it",
    )
    parser.add_argument(
        "--peer-wait-s",
        type=float,
        default=PEER_WAIT_S,
        help="a copy to another device of the lease waits this long for the agent to name "
        "that device's worker before it fails (a worker sends only to workers it was named)",
    )
    parser.add_argument(
        "--ready-fd",
        type=int,
        default=None,
        help="write the ready line to this inherited descriptor and close it (default: stdout)",
    )
    parser.add_argument("--device", default="cpu", help="cuda:N or cpu")
    parser.add_argument("--memory-limit-mib", type=int, default=None)
    parser.add_argument(
        "--host-memory-limit-mib",
        type=int,
        default=None,
        help="a CUDA worker's host-memory allowance: host tensors and the worker's staging, "
        "transfer and swap buffers for the lease (default: the device memory limit)",
    )
    parser.add_argument(
        "--listen", default="tcp://127.0.0.1:0", help="tcp://HOST:PORT or unix:PATH"
    )
    parser.add_argument(
        "--status-file", type=Path, default=None, help="JSON activity for the agent"
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for a CPU worker")
    parser.add_argument(
        "--cpus",
        default=None,
        help="run on these host CPUs only, as taskset lists them (0-3,8): a worker and its "
        "client on cores of their own keep the stream's pace steady",
    )
    parser.add_argument(
        "--spin-us",
        type=int,
        default=SPIN_US,
        help="after each batch, poll this long for the next frame before sleeping (0: never)",
    )
    parser.add_argument("--tls-cert", type=Path, default=None, help="serve TCP clients over TLS")
    parser.add_argument("--tls-key", type=Path, default=None, help="the certificate's key")
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=None,
        help="after this long without ops, ask the client to swap its tensors to host memory",
    )
    parser.add_argument(
        "--restore-from",
        default=None,
        help="take over the client's state from this worker of the same lease (migration)",
    )
    parser.add_argument(
        "--managed",
        action="store_true",
        help="after a swap-out, restore only when the agent says the slice is granted again",
    )
    parser.add_argument(
        "--handoff-paths",
        default=",".join(PATHS),
        help="as a successor, take the state by these ways, in this order of preference "
        "(cuda_ipc, shm: same host only; stream: any host)",
    )
    parser.add_argument(
        "--room-timeout-s",
        type=float,
        default=ROOM_TIMEOUT_S,
        help="an allocation the GPU lacks memory for waits this long for other sessions to be "
        "swapped out (memory oversubscription; managed workers only)",
    )
    parser.add_argument(
        "--simulated-gpu",
        type=Path,
        default=None,
        help="the ledger file of a simulated GPU's physical memory (fake backend): the CPU "
        "worker's allocations must fit it together with the other workers of that GPU",
    )
    args = parser.parse_args(argv)
    paths = tuple(p.strip() for p in args.handoff_paths.split(",") if p.strip())
    if not paths or not set(paths) <= set(PATHS):
        parser.error(f"--handoff-paths takes some of {','.join(PATHS)}")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.standby:
        _check_standby(parser, args)
        credentials = WorkerCredentials("")  # admits nobody: the hand-over brings them
    elif args.lease is None:
        parser.error("--lease is required (or --standby, for a ready worker)")
    elif args.context_ahead:
        parser.error("--context-ahead is for a ready worker (--standby)")
    elif args.credentials_stdin:
        try:
            credentials = read_credentials(sys.stdin.buffer)
        except ProtocolError as exc:
            parser.error(f"--credentials-stdin: {exc}")
    else:
        # By hand: the client role only (no agent, no peers); the variable stays readable in
        # /proc/PID/environ to the worker's user, which is why an agent never uses it.
        client = os.environ.pop(TOKEN_ENV, "")
        if not client:
            parser.error(f"--credentials-stdin or ${TOKEN_ENV} is required")
        credentials = WorkerCredentials(client)
    if not 0 <= args.peer_wait_s <= 600:
        parser.error("--peer-wait-s must be 0..600")
    if args.ready_fd is not None and args.ready_fd < 3:
        parser.error("--ready-fd must be an inherited descriptor of its own (3 or more)")
    if args.memory_limit_mib is not None and args.memory_limit_mib <= 0:
        parser.error("--memory-limit-mib must be positive")
    if args.host_memory_limit_mib is not None and args.host_memory_limit_mib <= 0:
        parser.error("--host-memory-limit-mib must be positive")
    if args.host_memory_limit_mib is not None and args.device == "cpu":
        parser.error(
            "--host-memory-limit-mib is for a CUDA worker (a CPU worker's memory is "
            "its --memory-limit-mib)"
        )
    if args.room_timeout_s <= 0:
        parser.error("--room-timeout-s must be positive")
    if args.simulated_gpu is not None and args.device != "cpu":
        parser.error("--simulated-gpu is for a CPU worker (a real GPU has real memory)")
    if args.idle_timeout_s is not None and args.idle_timeout_s <= 0:
        parser.error("--idle-timeout-s must be positive")
    cpus: frozenset[int] | None = None
    if args.cpus is not None:
        try:
            cpus = parse_cpu_list(args.cpus)
        except ValueError as exc:
            parser.error(f"--cpus: {exc}")
        allowed = os.sched_getaffinity(0)
        if not cpus <= allowed:
            outside = ",".join(str(c) for c in sorted(cpus - allowed))
            parser.error(f"--cpus: CPU {outside} is not available to this process")
    if args.restore_from is not None:
        try:
            parse_address(args.restore_from)
        except ValueError as exc:
            parser.error(f"--restore-from: {exc}")
    return WorkerConfig(
        lease_id=args.lease or "",
        token=credentials.client,
        control_token=credentials.control,
        peer_token=credentials.peer,
        ready_fd=args.ready_fd,
        peer_wait_s=args.peer_wait_s,
        device=args.device,
        memory_limit_mib=args.memory_limit_mib,
        host_memory_limit_mib=args.host_memory_limit_mib,
        listen=args.listen,
        status_file=args.status_file,
        threads=args.threads,
        spin_us=max(0, args.spin_us),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        idle_timeout_s=args.idle_timeout_s,
        restore_from=args.restore_from,
        managed=args.managed,
        handoff_paths=paths,
        room_timeout_s=args.room_timeout_s,
        simulated_gpu=args.simulated_gpu,
        cpus=cpus,
        standby=args.standby,
        context_ahead=args.context_ahead,
    )


def _check_standby(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A ready worker takes everything of its lease from the hand-over: none of it in argv."""
    given = [
        flag
        for flag, value in (
            ("--lease", args.lease),
            ("--credentials-stdin", args.credentials_stdin or None),
            ("--memory-limit-mib", args.memory_limit_mib),
            ("--host-memory-limit-mib", args.host_memory_limit_mib),
            ("--status-file", args.status_file),
            ("--idle-timeout-s", args.idle_timeout_s),
            ("--restore-from", args.restore_from),
        )
        if value is not None
    ]
    if given:
        parser.error(f"--standby takes its lease from the hand-over: drop {', '.join(given)}")
    if args.ready_fd is None:
        parser.error("--standby needs --ready-fd (its agent reads its standby and ready lines)")
    if args.context_ahead and not args.device.startswith("cuda"):
        parser.error("--context-ahead is for a CUDA worker")
    if args.context_ahead and os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        parser.error(
            "--context-ahead under MPS would fix the context's share before the lease names it"
        )


MAX_CREDENTIALS_BYTES = 64 * 1024


def read_credentials(stream: BinaryIO) -> WorkerCredentials:
    """The one line of credentials the agent writes on stdin; stdin is /dev/null after it, so
    nothing the worker starts inherits the pipe."""
    line = stream.readline(MAX_CREDENTIALS_BYTES)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if not line.endswith(b"\n"):
        raise ProtocolError("no credentials line on stdin")
    return WorkerCredentials.from_line(line)


def parse_cpu_list(text: str) -> frozenset[int]:
    """`0-3,8` → {0, 1, 2, 3, 8} (taskset's and cpuset's list format)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise ValueError(f"{part!r} is not a CPU number or range (0-3,8)") from None
        if first < 0 or last < first:
            raise ValueError(f"{part!r} is not a CPU number or range (0-3,8)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    config = parse_args(sys.argv[1:] if argv is None else argv)
    tune_gc()  # a step's decoded records and tensors die young (gpupool/startup.py)
    if config.standby:
        from gpupool.worker.standby import run_standby

        return run_standby(config)
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
