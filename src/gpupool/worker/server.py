"""The worker process: one device, one authenticated client at a time, ops run in order."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import platform
import select
import socket
import ssl
import stat
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpupool.protocol.v1.dataplane import (
    DIST_VERSION,
    FLAGS_VERSION,
    HELLO_TIMEOUT_S,
    MAX_FRAME_BYTES,
    MAX_LANES,
    STREAMS_VERSION,
    VERSION,
    WORKER_EXIT_DEVICE_BROKEN,
    Address,
    Connection,
    ConnectionClosed,
    DataPlaneError,
    ErrorBody,
    ErrorKind,
    Kind,
    ProtocolError,
    RemoteError,
    Role,
    SharedArena,
    WorkerCredentials,
    bound_address,
    connect,
    listen,
    parse_address,
    recv_handshake,
    role_handshake,
    send_handshake,
    server_tls_context,
    tune,
)
from gpupool.protocol.v1.simgpu import SimulatedGpuMemory
from gpupool.worker.activity import Activity, StatusFile
from gpupool.worker.admission import warm_up, warmed
from gpupool.worker.collectives import Collectives
from gpupool.worker.elastic import TICK_S, Elasticity, HandedOff, adopt
from gpupool.worker.executor import Executor, first_line
from gpupool.worker.handoff import PATHS, Offer, host_key, visible_gpus
from gpupool.worker.lanes import Lanes
from gpupool.worker.memory import MiB, memory_limit_for
from gpupool.worker.room import ROOM_TIMEOUT_S, Room
from gpupool.worker.swap import ClientState
from gpupool.worker.transfer import PEER_WAIT_S, PeerLinks

log = logging.getLogger("gpupool.worker")

ROLES = (Role.CLIENT, Role.CONTROL, Role.SUCCESSOR, Role.PEER, Role.LANE)

SPIN_US = 0
"""After a batch, the worker may poll its socket this long before it sleeps in recv
(`--spin-us`): a worker that does not sleep needs no scheduler wakeup when the next batch
comes. Off by default: it helps only with a core to spare, and hurts on a busy host."""


BUSY_WAIT_S = 2.0
ACCEPT_TICK_S = 0.5
"""How soon the accept loop notices stop() when no signal interrupted it."""
ADOPT_ATTEMPTS = 5
ADOPT_RETRY_S = 0.5
HANDOFF_REPLY_GRACE_S = 5.0
"""How long stop() lets a handoff in flight finish its reply to the client (the agent waits
10 s before it kills a worker)."""


@dataclass(frozen=True)
class WorkerConfig:
    lease_id: str
    token: str
    """The lease's client token: it opens the client role only."""
    control_token: str = ""
    """The agent's secret for this worker (role control); empty: no agent may connect."""
    peer_token: str = ""
    """The lease's worker secret (roles peer and successor); empty: no other worker may."""
    ready_fd: int | None = None
    """Where the ready line goes (an agent's pipe), else stdout."""
    peer_wait_s: float = PEER_WAIT_S
    """How long a SEND to an address the agent has not named waits for it to be named."""
    device: str = "cpu"
    memory_limit_mib: int | None = None
    host_memory_limit_mib: int | None = None
    """A CUDA worker's host-memory allowance (host tensors, staging, transfers, swap); by
    default its device limit. A CPU worker's host memory is its device memory."""
    process_cap: bool = True
    """Cap a CPU worker's process at its limit plus a margin (RLIMIT_DATA, `ProcessCap`)."""
    listen: str = "tcp://127.0.0.1:0"
    status_file: Path | None = None
    threads: int | None = None
    max_frame_bytes: int = MAX_FRAME_BYTES
    read_arena_mib: int = 256
    """Shared memory the worker offers for reads to a client on the same host (Unix sockets)."""
    put_lanes: int = int(os.environ.get("GPUPOOL_PUT_LANES", "4"))
    """Connections a TCP client may open beside its own for its large puts' bytes (0: none;
    `gpupool.worker.lanes`)."""
    spin_us: int = SPIN_US
    tls_cert: Path | None = None
    tls_key: Path | None = None
    """With both, TCP clients must speak TLS: the worker listens on tls://host:port."""
    idle_timeout_s: float | None = None
    """Without ops this long, the worker asks its client to swap out (None: never)."""
    restore_from: str | None = None
    """A worker of the same lease whose client state this one takes over before serving."""
    managed: bool = False
    """An agent runs this worker: after a swap-out, restore only once the agent says so."""
    handoff_paths: tuple[str, ...] = PATHS
    """How this worker, as a successor, accepts a client's state (`gpupool.worker.handoff`)."""
    room_timeout_s: float = ROOM_TIMEOUT_S
    """How long an allocation the GPU lacks memory for waits for others to give way."""
    simulated_gpu: Path | None = None
    """The ledger of the simulated GPU's physical memory (fake backend, CPU worker)."""
    cpus: frozenset[int] | None = None
    """Host CPUs the worker runs on (all its threads: set before any starts), or all."""
    standby: bool = False
    """A ready worker, started before its lease (gpupool.worker.standby): the lease, its
    credentials and its limits come with the agent's hand-over."""
    context_ahead: bool = False
    """A ready CUDA worker makes its CUDA context before the hand-over: only where no MPS share
    is to be set (an MPS client's share is fixed when its context connects)."""

    @property
    def credentials(self) -> WorkerCredentials:
        return WorkerCredentials(self.token, self.control_token, self.peer_token)


def check_mps_reachable(env: Mapping[str, str]) -> None:
    """Refuse to start where the lease's MPS daemon is named but cannot be reached.

    A CUDA client that cannot reach the pipe directory it is given does not fail: it runs
    outside MPS, on the whole GPU, with no compute share (seen with a pipe directory under a
    directory the worker user could not pass). A worker must not hold a context its lease's
    share does not bound, so it checks the daemon's control socket before CUDA starts."""
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    if not pipe:
        return
    control = os.path.join(pipe, "control")
    try:
        mode = os.stat(control).st_mode
    except OSError as exc:
        raise RuntimeError(
            f"the lease's MPS daemon is not reachable at {control} ({exc.strerror}): a worker"
            " does not run outside its compute share"
        ) from None
    if not stat.S_ISSOCK(mode):
        raise RuntimeError(f"{control} is not the MPS daemon's socket")


def tls_context(config: WorkerConfig) -> ssl.SSLContext | None:
    """The server side of TLS for TCP clients, when the worker has a certificate."""
    if config.tls_cert is not None and config.tls_key is not None:
        return server_tls_context(config.tls_cert, config.tls_key)
    return None


def bind(config: WorkerConfig) -> tuple[socket.socket, Address]:
    """The worker's listening socket and the address clients reach it at (tls:// with TLS)."""
    requested = parse_address(config.listen)
    if config.tls_cert is not None and config.tls_key is not None:
        if not requested.is_unix:
            requested = Address("tls", host=requested.host, port=requested.port)
    elif requested.is_tls:
        raise DataPlaneError(f"{requested} needs a certificate and key (--tls-cert, --tls-key)")
    sock = listen(requested)
    return sock, bound_address(sock, requested)


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", 0)
            check_mps_reachable(os.environ)
            torch.cuda.set_device(self.device)
        elif self.device.type != "cpu":
            raise ValueError(f"a worker runs on cuda:N or cpu, not {config.device}")
        if config.threads:
            torch.set_num_threads(config.threads)
        self.activity = Activity(lease_id=config.lease_id, pid=os.getpid())
        self._status = StatusFile(config.status_file, self.activity) if config.status_file else None
        # Only an agent's worker asks for room: the agent carries the request to the controller.
        self.room = (
            Room(self.activity, config.room_timeout_s, self._status.write)
            if config.managed and self._status is not None
            else None
        )
        simulated = SimulatedGpuMemory(config.simulated_gpu) if config.simulated_gpu else None
        self._simulated_gpu = simulated
        # A CPU worker's process is capped at its limit and a margin (what no count foresees,
        # an op's intermediates, fails in the host allocator instead of taking the host's memory).
        self.memory = memory_limit_for(
            self.device,
            config.memory_limit_mib,
            self.room,
            simulated,
            host_limit_mib=config.host_memory_limit_mib,
            process_cap=config.process_cap,
        )
        self.activity.memory_limit_bytes = self.memory.limit_bytes
        self.executor = Executor(config.lease_id, self.device, self.memory, self.activity)
        self.executor.peers = PeerLinks(config.lease_id, config.peer_token, config.peer_wait_s)
        self.executor.collectives = Collectives(
            config.lease_id, self.device, self.memory, config.peer_token
        )
        self.executor.collectives.check_peer = self.executor.peers.check_named
        self.elastic = Elasticity(
            self.executor, self.memory, config.idle_timeout_s, config.managed, self.room
        )
        self._restored = threading.Event()
        self._restore_error: str | None = None
        if config.restore_from is None:
            self._restored.set()
        self._session_lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._tls: ssl.SSLContext | None = None
        self._active: Connection | None = None
        self._client_left = False
        """Set from the end of a client's stream until the worker is free again: the reset
        after it (a CUDA synchronize waits for every kernel the client queued) runs for
        nobody."""
        self._lanes: Lanes | None = None
        """The current client session's lanes, which lane connections join."""
        self._threads: list[threading.Thread] = []
        self.address: Address | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, bound: tuple[socket.socket, Address] | None = None) -> Address:
        """Listen (or take over `bound`, the socket a ready worker listened on before its
        hand-over) and start the background parts; serve_forever() then serves."""
        self._tls = tls_context(self.config)
        self._listener, self.address = bound or bind(self.config)
        # accept() wakes up now and then: SIGTERM may be delivered to any thread (CUDA's
        # own among them), and then nothing interrupts a main thread blocked in accept().
        self._listener.settimeout(ACCEPT_TICK_S)
        if self.executor.collectives is not None:
            self.executor.collectives.own_address = str(self.address)
        if self._status:
            self._status.start()
        if self.memory.counts_storages:
            warm_up()  # the meta kernels that charge ops before they run
        if self.config.restore_from is not None:
            threading.Thread(target=self._adopt, name="gpupool-adopt", daemon=True).start()
        return self.address

    def _adopt(self) -> None:
        """Take the client's state over from the predecessor worker, then let the client in.

        A transfer cut off halfway leaves the predecessor with the state (it frees it only once
        this worker confirms), so a broken connection is tried again; a predecessor that is gone
        or refuses is final."""
        assert self.config.restore_from is not None and self.address is not None
        source = parse_address(self.config.restore_from)
        try:
            for attempt in range(1, ADOPT_ATTEMPTS + 1):
                try:
                    sock = connect(source)
                except OSError as exc:
                    raise DataPlaneError(f"the predecessor is not reachable: {exc}") from exc
                try:
                    state = self._adopt_over(sock)
                    break
                except ConnectionClosed as exc:
                    if attempt == ADOPT_ATTEMPTS:
                        raise
                    log.warning("taking over lease %s from %s broke off (%s); trying again",
                                self.config.lease_id, source, exc)  # fmt: skip
                    self._stopping.wait(ADOPT_RETRY_S)
            self.activity.adopted = True
            log.info(
                "took over lease %s from %s: %.1f MiB",
                self.config.lease_id, source, state.nbytes / MiB,
            )  # fmt: skip
        except Exception as exc:  # never let a client in on a state that did not arrive
            self._restore_error = f"could not take over from {source}: {exc}"
            log.error("%s", self._restore_error)
        finally:
            self._restored.set()

    def _adopt_over(self, sock: socket.socket) -> ClientState:
        assert self.address is not None
        with contextlib.closing(sock):
            try:
                role_handshake(sock, self.config.lease_id, self.config.peer_token, Role.SUCCESSOR)
            except RemoteError as exc:
                raise DataPlaneError(f"the predecessor refused: {exc.body.message}") from None
            conn = Connection(sock, self.config.max_frame_bytes)
            cuda = self.device.type == "cuda"
            offer = Offer(
                address=str(self.address),
                host=host_key(),
                device_type=self.device.type,
                gpus=tuple(visible_gpus()) if cuda else (),
                paths=tuple(p for p in self.config.handoff_paths if cuda or p != "cuda_ipc"),
            )
            with _device_stream(self.device), self._session_lock:
                return adopt(conn, offer, self.executor)

    def serve_forever(self) -> None:
        assert self._listener is not None, "start() first"
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    break
                raise
            thread = threading.Thread(
                target=self._handle, args=(sock, peer), name="gpupool-client", daemon=True
            )
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def join(self, timeout_s: float = 5.0) -> None:
        """Wait for the connection threads to finish (after stop())."""
        for thread in self._threads:
            thread.join(timeout_s)

    def stop(self) -> None:
        self.elastic.finish_handoff(HANDOFF_REPLY_GRACE_S)
        self._stopping.set()
        self.elastic.stop()
        if self.room is not None:
            self.room.stop()
        if self._simulated_gpu is not None:  # what this process held is free again
            with contextlib.suppress(OSError):
                self._simulated_gpu.record(str(os.getpid()), 0)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self._listener.close()
        if self._active is not None:
            self._active.close()
        if self.address is not None and self.address.is_unix:
            with contextlib.suppress(OSError):
                os.unlink(self.address.path)
        if self._status:
            self._status.stop()

    # ---- one connection ------------------------------------------------------------------

    def _handle(self, sock: socket.socket, peer: Any) -> None:
        tune(sock)
        if self._tls is not None and sock.family != socket.AF_UNIX:
            try:
                sock.settimeout(HELLO_TIMEOUT_S)
                sock = self._tls.wrap_socket(sock, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                log.info("refused a connection from %s: TLS handshake failed: %s", peer, exc)
                with contextlib.suppress(OSError):
                    sock.close()
                return
        try:
            fds, role, hello = self._authenticate(sock)
        except (DataPlaneError, OSError) as exc:
            log.info("refused a connection from %s: %s", peer or "a local socket", exc)
            with contextlib.suppress(OSError):
                sock.close()
            return
        if role == Role.LANE:
            for fd in fds:
                os.close(fd)
            self._serve_lane(sock, hello)
            return
        if role != Role.CLIENT:
            for fd in fds:
                os.close(fd)
            self._serve_side(sock, role)
            return
        # A successor worker restores before its client may send anything.
        self._restored.wait()
        refusal = self.elastic.refusal() or (
            ErrorBody(ErrorKind.PROTOCOL, self._restore_error) if self._restore_error else None
        )
        if refusal is not None:
            for fd in fds:
                os.close(fd)
            self._refuse(sock, refusal)
            return
        # A client that reconnects right after its connection ended may arrive before that
        # connection's thread has let go; a second client at the same time is refused.
        if not self._session_lock.acquire(timeout=BUSY_WAIT_S):
            if self._client_gone():
                busy = ErrorBody(
                    ErrorKind.BUSY,
                    "this worker is finishing the last call of a client that has left",
                    client_gone=True,
                )
            else:
                busy = ErrorBody(ErrorKind.BUSY, "this worker already serves a client")
            self._refuse(sock, busy)
            for fd in fds:
                os.close(fd)
            return
        link = _Link(Connection(sock, self.config.max_frame_bytes))
        broken: str | None = None
        try:
            problem = self._serve(link, fds, str(peer or "unix"))
        finally:
            # Free the worker before the client sees its connection close, so that it can
            # connect again at once.
            self._active = self._lanes = None
            self._client_left = True
            try:
                self.elastic.client_left()
                broken = self._reset_after_client()
            finally:
                self.activity.client_connected, self.activity.client_peer = False, None
                self._client_left = False
                self._session_lock.release()
        if problem is not None:
            with contextlib.suppress(DataPlaneError, OSError):
                link.conn.send([Kind.ERROR, None, problem.to_wire()])
        with contextlib.suppress(Exception):
            link.close()
        if broken is not None:
            # As a local program's after a device-side assert or an illegal address: the CUDA
            # context is gone for good. The worker ends, so its slice goes back to the pool
            # and the agent reports the lease's worker lost, rather than refusing or failing
            # every later client.
            log.error("lease %s: the device is unusable after the client's error (%s); the "
                      "worker ends", self.config.lease_id, broken)  # fmt: skip
            self.stop()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(WORKER_EXIT_DEVICE_BROKEN)

    def _client_gone(self) -> bool:
        """Whether the client being served has closed its end, seen without reading from its
        socket (the serving thread owns that), or its stream has ended and the worker is
        resetting: the worker is busy only with work it still does for nobody."""
        active = self._active
        if self._client_left:
            return True
        if active is None:  # a client's stream is being set up
            return False
        hung_up = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
        try:
            poller = select.poll()
            poller.register(active.sock.fileno(), hung_up)
            return any(events & hung_up for _, events in poller.poll(0))
        except (OSError, ValueError):  # closed meanwhile: the worker is about to be free
            return False

    def _reset_after_client(self) -> str | None:
        """Forget the client's state; on a CUDA worker, first check the context still works
        (a sticky error fails every call after it). Returns that error, if any."""
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.executor.reset()
        except Exception as exc:
            return first_line(exc)
        return None

    def _authenticate(self, sock: socket.socket) -> tuple[list[int], str, dict[str, Any]]:
        sock.settimeout(HELLO_TIMEOUT_S)
        try:
            hello = recv_handshake(sock)
        except ProtocolError as exc:
            self._refuse(sock, ErrorBody(ErrorKind.PROTOCOL, str(exc)))
            raise
        head = hello.head
        body = head[1] if len(head) > 1 else None
        problem: ErrorBody | None = None
        if head[0] != Kind.HELLO or not isinstance(body, dict):
            problem = ErrorBody(ErrorKind.PROTOCOL, "the first frame must be HELLO")
        elif body.get("v") != VERSION:
            problem = ErrorBody(
                ErrorKind.PROTOCOL, f"data-plane version {body.get('v')!r}, worker speaks {VERSION}"
            )
        elif body.get("role", Role.CLIENT) not in ROLES:
            problem = ErrorBody(ErrorKind.PROTOCOL, f"unknown role {body.get('role')!r:.64}")
        elif body.get("lease") != self.config.lease_id or not self.config.credentials.admits(
            str(body.get("role", Role.CLIENT)), body.get("token")
        ):
            # One answer for a wrong lease, a wrong token and a token of another role: the
            # client's token opens the client role only, and says nothing about the others.
            problem = ErrorBody(ErrorKind.AUTH, "refused: no valid token for this lease and role")
        if problem is not None:
            for fd in hello.fds:
                os.close(fd)
            self._refuse(sock, problem)
            raise ProtocolError(problem.message)
        sock.settimeout(None)
        assert isinstance(body, dict)
        role = str(body.get("role", Role.CLIENT))
        if body.get("shm") and hello.fds and role == Role.CLIENT:
            kept = 2 if body.get("pinned") else 1
            for fd in hello.fds[kept:]:
                os.close(fd)  # one arena and one pinned region per client; more would leak
            return hello.fds[:kept], role, body  # the client's memfd arena (and pinned region)
        for fd in hello.fds:
            os.close(fd)
        return [], role, body

    def _serve_lane(self, sock: socket.socket, hello: dict[str, Any]) -> None:
        """One of the client's lanes: its key must be the current session's."""
        lanes = self._lanes
        conn = Connection(sock, self.config.max_frame_bytes)
        index = hello.get("lane")
        if (
            lanes is None
            or not lanes.admits(hello.get("key"), index)
            or not lanes.join(int(index), conn)  # type: ignore[arg-type]
        ):
            self._refuse(sock, ErrorBody(ErrorKind.AUTH, "refused: not a lane of this session"))
            return
        try:
            send_handshake(sock, [Kind.WELCOME, {"v": VERSION, "lease": self.config.lease_id}])
            sock.settimeout(None)
            lanes.serve(int(index))  # type: ignore[arg-type]
        except (DataPlaneError, OSError) as exc:
            log.info("lane connection ended: %s", exc)
        finally:
            conn.close()

    def _serve_side(self, sock: socket.socket, role: str) -> None:
        """The agent's control requests, a successor taking the client's state over, or another
        worker of the lease sending tensors (copies between the lease's devices)."""
        conn = Connection(sock, self.config.max_frame_bytes)
        try:
            send_handshake(sock, [Kind.WELCOME, {"v": VERSION, "lease": self.config.lease_id}])
            sock.settimeout(HELLO_TIMEOUT_S)
            if role == Role.SUCCESSOR:
                self.elastic.serve_successor(conn, self._session_lock)
                return
            if role == Role.PEER:
                sock.settimeout(None)  # open for the whole session, idle between copies
                collectives = self.executor.collectives
                self.executor.arrivals.serve_peer(
                    conn, None if collectives is None else collectives.hosted.serve
                )
                return
            head = conn.recv().head()
            if head[0] != Kind.CONTROL or len(head) != 3 or not isinstance(head[2], dict):
                raise ProtocolError("expected [CONTROL, req, {op: ...}]")
            conn.send([Kind.RESULT, head[1], self._control(head[2])])
        except ProtocolError as exc:
            with contextlib.suppress(DataPlaneError, OSError):
                conn.send([Kind.ERROR, None, ErrorBody(ErrorKind.PROTOCOL, str(exc)).to_wire()])
        except (DataPlaneError, OSError) as exc:
            log.info("side connection (%s) ended: %s", role, exc)
        finally:
            conn.close()

    def _control(self, body: dict[str, Any]) -> dict[str, Any]:
        """An agent's request: `peers` names the lease's workers (the only addresses a SEND
        may reach); the others are the elastic session's (resume, limits, swap, room)."""
        if body.get("op") == "peers":
            peers = self.executor.peers
            if peers is None:
                raise ProtocolError("this worker does not send to other workers")
            return {"peers": peers.name(body.get("endpoints"))}
        return self.elastic.control(body)

    def _refuse(self, sock: socket.socket, error: ErrorBody) -> None:
        with contextlib.suppress(OSError, DataPlaneError):
            send_handshake(sock, [Kind.ERROR, None, error.to_wire()])
        with contextlib.suppress(OSError):
            sock.close()

    def _serve(self, link: _Link, fds: list[int], peer: str) -> ErrorBody | None:
        """Run the client's stream until it leaves; a protocol error ends it with that error."""
        sock = link.conn.sock
        if fds and sock.family == socket.AF_UNIX:
            try:
                link.client_arena = SharedArena.adopt(fds[0])
            except (OSError, ValueError) as exc:
                for fd in fds:
                    os.close(fd)
                return ErrorBody(ErrorKind.PROTOCOL, f"the shared memory sent is not usable: {exc}")
            link.worker_arena = SharedArena.create(self.config.read_arena_mib * MiB)
            if self.device.type == "cuda":
                link.pin(self.device)
            if len(fds) > 1:
                link.pinned_region = _adopt_pinned_region(fds[1])
        else:
            for fd in fds:
                os.close(fd)
        if sock.family != socket.AF_UNIX and self.config.put_lanes > 0:
            link.lanes = self._lanes = Lanes(min(self.config.put_lanes, MAX_LANES))
        self._active = link.conn
        self.activity.client_connected, self.activity.client_peer = True, peer
        self.elastic.client_started()
        try:
            send_handshake(
                sock,
                [Kind.WELCOME, self._welcome(link)],
                [link.worker_arena.fd] if link.worker_arena else [],
            )
            warmed()  # a cold worker's first ops never run beside its meta warm-up
            with _device_stream(self.device):
                torch.set_grad_enabled(False)
                self._loop(link)
        except (ConnectionClosed, OSError, HandedOff):
            pass
        except ProtocolError as exc:
            log.warning("closing the client connection: %s", exc)
            return ErrorBody(ErrorKind.PROTOCOL, str(exc))
        except Exception as exc:
            # Whatever a hostile stream makes the worker do (a value of the wrong type reaching
            # torch, an allocation that fails) ends this connection with an error, and only it.
            log.warning("closing the client connection after %s: %s", type(exc).__name__, exc)
            return ErrorBody(
                ErrorKind.PROTOCOL,
                f"the worker could not run the stream: {type(exc).__name__}: {exc}",
            )
        return None

    def _loop(self, link: _Link) -> None:
        executor = self.executor
        conn = link.conn
        spin_s = self.config.spin_us / 1e6
        elastic = self.elastic
        while True:
            if spin_s:
                conn.wait(spin_s)
            if not conn.readable(TICK_S):
                elastic.quiet(link)
                continue
            elastic.busy()
            if elastic.wanted:  # a successor waits: tell a busy client too, between batches
                elastic.quiet(link)
            frame = conn.recv()
            if frame.tail_len:
                raise ProtocolError("a BATCH frame carries no tail")
            executor.run_frame(frame.body, link)

    def _welcome(self, link: _Link) -> dict[str, Any]:
        facts: dict[str, Any] = {
            "v": VERSION,
            "lease": self.config.lease_id,
            "torch": torch.__version__,
            "device_type": self.device.type,
            "memory_limit_bytes": self.memory.limit_bytes,
            "max_frame_bytes": self.config.max_frame_bytes,
            "shm": link.worker_arena is not None,
            "pinned": link.pinned_region is not None,
            "lanes": link.lanes.offer() if link.lanes is not None else None,
            "peer_copy": True,
            "flags": FLAGS_VERSION,
            "streams": STREAMS_VERSION,
            "dist": DIST_VERSION,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            facts |= {
                "device_name": props.name,
                "total_memory_bytes": props.total_memory,
                "capability": [props.major, props.minor],
                "multi_processor_count": props.multi_processor_count,
                "bf16": torch.cuda.is_bf16_supported(),
            }
        else:
            import psutil

            facts |= {
                "device_name": f"CPU ({platform.machine()}, gpupool worker)",
                "total_memory_bytes": int(psutil.virtual_memory().total),
                "capability": [0, 0],
                "multi_processor_count": os.cpu_count() or 1,
                "bf16": True,
            }
        return facts


class _Link:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.client_arena: SharedArena | None = None
        self.worker_arena: SharedArena | None = None
        self.pinned_region: SharedArena | None = None
        self.lanes: Lanes | None = None
        """The session's extra connections for large puts (TCP clients)."""
        self.pinned = False
        self._device: torch.device | None = None

    def reply(self, head: list[Any], tail: memoryview | None = None) -> None:
        self.conn.send(head, tail)

    def read_put(self, handle: int, dest: memoryview, lanes: bool = False) -> None:
        if lanes:
            self._lanes().read_put(handle, dest, len(dest))
            return
        filled = 0
        while filled < len(dest):
            size = self._next_put(handle, filled, len(dest))
            self.conn.read_tail_into(dest[filled : filled + size])
            filled += size

    def skip_put(self, handle: int, nbytes: int, lanes: bool = False) -> None:
        if lanes:
            self._lanes().read_put(handle, None, nbytes)
            return
        skipped = 0
        while skipped < nbytes:
            size = self._next_put(handle, skipped, nbytes)
            self.conn.skip_tail()
            skipped += size

    def _lanes(self) -> Lanes:
        if self.lanes is None:
            raise ProtocolError("a put over lanes, but this session has none")
        return self.lanes

    def _next_put(self, handle: int, offset: int, total: int) -> int:
        """The next PUT frame of tensor `handle`, checked to carry bytes from `offset` on."""
        frame = self.conn.recv()
        head = frame.head()
        if head[0] != Kind.PUT or len(head) != 3 or head[1] != handle or head[2] != offset:
            raise ProtocolError(f"expected PUT of tensor {handle} at byte {offset}")
        if frame.tail_len == 0 or offset + frame.tail_len > total:
            raise ProtocolError("PUT frame tail does not fit the announced size")
        return frame.tail_len

    def pin(self, device: torch.device) -> None:
        """Register both arenas with CUDA, so host↔device copies are DMA from shared memory."""
        arenas = [a for a in (self.client_arena, self.worker_arena) if a is not None]
        try:
            for arena in arenas:
                torch.cuda.check_error(
                    torch.cuda.cudart().cudaHostRegister(_address(arena), arena.size, 0)
                )
        except Exception as exc:  # pageable copies still work, only slower
            log.warning("could not pin the shared arenas: %s", exc)
            return
        self.pinned, self._device = True, device

    def close(self) -> None:
        self.conn.close()
        if self.lanes is not None:
            self.lanes.close()
        if self.pinned:
            torch.cuda.synchronize(self._device)  # no copy may still read the arenas
            for arena in (self.client_arena, self.worker_arena):
                if arena is not None:
                    with contextlib.suppress(Exception):
                        torch.cuda.cudart().cudaHostUnregister(_address(arena))
        for arena in (self.client_arena, self.worker_arena, self.pinned_region):
            if arena is not None:
                arena.close()


def _adopt_pinned_region(fd: int) -> SharedArena | None:
    """The client's shared pinned region, if it is a memfd sealed against shrinking: a region
    that could shrink would fault this worker in the middle of a copy. None: puts from pinned
    memory come copied, as from any other host memory."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if not seals & fcntl.F_SEAL_SHRINK or not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a memfd sealed against shrinking")
        return SharedArena.adopt(fd)
    except (OSError, ValueError) as exc:
        log.info("not using the client's pinned region: %s", exc)
        os.close(fd)
        return None


def _address(arena: SharedArena) -> int:
    return int(torch.frombuffer(arena.map, dtype=torch.uint8, count=1).data_ptr())


@contextlib.contextmanager
def _device_stream(device: torch.device) -> Iterator[None]:
    """The client's ops run on the worker's own CUDA stream, never the default stream."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_device(device)  # the current device is per thread
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        yield


def pin_threads(cpus: frozenset[int]) -> None:
    """Confine this process to `cpus`: every thread it has now (Linux sets affinity per
    thread) and, by inheritance, every thread it starts later (the serving threads, CUDA's)."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


def run(config: WorkerConfig, bound: tuple[socket.socket, Address] | None = None) -> int:
    """Serve until SIGTERM; print one JSON line with the address when ready. `bound`: the
    socket a ready worker has listened on since before its hand-over (gpupool.worker.standby)."""
    import signal

    if config.cpus and bound is None:  # a ready worker pinned itself at its start
        pin_threads(config.cpus)
    worker = Worker(config)
    address = worker.start(bound)

    def _stop(signum: int, _frame: object) -> None:
        worker.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    ready = {"event": "ready", "address": str(address), "lease": config.lease_id,
             "device": str(worker.device), "pid": os.getpid()}  # fmt: skip
    line = json.dumps(ready) + "\n"
    if config.ready_fd is None:
        sys.stdout.write(line)
        sys.stdout.flush()
    else:  # the agent's pipe, read once: closed after, so it can never fill
        try:
            os.write(config.ready_fd, line.encode())
        finally:
            os.close(config.ready_fd)
    worker.serve_forever()
    worker.join()
    # Leave without finalizing the interpreter: torch's thread pools do not like to be torn
    # down under a daemon thread that may still be inside an op.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
