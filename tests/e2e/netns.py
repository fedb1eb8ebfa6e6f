"""Several hosts on one machine: network namespaces joined by veth pairs to a bridge.

Each host is a namespace of its own with one interface (`eth0`, 10.200.0.N/24) whose other
end is a port of a bridge living in a switch namespace, so the machine's own network is
never touched and parallel runs (unique name prefixes) do not see each other. Processes
start with `ip netns exec NS ...` and talk real TCP across the bridge. `cut()` takes a
host's switch port down: its packets go nowhere, as when a cable is pulled, and `heal()`
brings it back with every connection's state intact.

The test process itself stays in the machine's namespace and reaches the controller through
a forwarder: a path-named Unix socket (visible from every namespace) relayed by a small
process inside the controller's namespace to its TCP port.

Run as a script, `python netns.py forward UDS_PATH PORT` is that forwarder.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

NAME_PREFIX = "gpupool-"
SUBNET = "10.200.0"
PREFIX_LEN = 24


class NetnsUnavailable(Exception):
    """This machine cannot build namespaces (not root, no `ip`, no veth/bridge support)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces, veth pairs and a bridge)"
    if shutil.which("ip") is None:
        return "multi-host tests need iproute2's `ip` command"
    probe = f"gpprobe-{uuid.uuid4().hex[:8]}"
    try:
        added = _ip("netns", "add", probe, check=False)
        if added.returncode != 0:
            return f"cannot create a network namespace: {added.stderr.strip()}"
        bridge = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"cannot create a bridge in a namespace: {bridge.stderr.strip()}"
        return None
    finally:
        _ip("netns", "del", probe, check=False)


def sweep_orphans() -> list[str]:
    """Remove the namespaces of runs whose process is gone (killed before cleaning up),
    and stop what still runs in them; those of live runs are left alone."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for name in (line.split()[0] for line in listed if line.startswith(NAME_PREFIX)):
        try:
            creator = int(name[len(NAME_PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(creator, 0)
            continue  # its run is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        pids = _ip("netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


@dataclass
class Host:
    """One host: a namespace with an address on the fabric's bridge."""

    name: str
    netns: str
    address: str
    fabric: Fabric
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(
        self, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start a process in this host; `ip netns exec` execs it, so the pid is its own."""
        with log.open("ab") as out:
            proc = subprocess.Popen(
                self.argv(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
            )
        self.procs.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], timeout: float = 120, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
        )

    def pids(self) -> list[int]:
        """Every process running in this host's namespace (its agent's workers included)."""
        done = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in done.stdout.split()]

    def cut(self) -> None:
        """Pull the cable: nothing reaches this host and nothing leaves it."""
        _ip("-n", self.fabric.switch, "link", "set", "dev", self.port, "down")

    def heal(self) -> None:
        _ip("-n", self.fabric.switch, "link", "set", "dev", self.port, "up")

    @property
    def port(self) -> str:
        return f"p-{self.name}"[:15]


class Fabric:
    """A switch namespace with a bridge, and the hosts plugged into it."""

    def __init__(self, workdir: Path) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        self.workdir = workdir
        sweep_orphans()
        # The creator's pid in the name: a run killed before its cleanup can be swept later.
        self.prefix = f"{NAME_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.prefix}-sw"
        self.hosts: dict[str, Host] = {}
        self._forwarders: list[subprocess.Popen[bytes]] = []
        # Unix socket paths are limited to 107 bytes: pytest's tmp_path may be longer.
        self.sockdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def add_host(self, name: str) -> Host:
        """A new host with the next free address; `name` is short (it names the switch port)."""
        number = len(self.hosts) + 2
        host = Host(name, f"{self.prefix}-{name}", f"{SUBNET}.{number}", self)
        _ip("netns", "add", host.netns)
        self.hosts[name] = host
        # Both ends are created inside their namespaces: nothing appears in the machine's.
        _ip("link", "add", "eth0", "netns", host.netns, "type", "veth",
            "peer", "name", host.port, "netns", self.switch)  # fmt: skip
        _ip("-n", self.switch, "link", "set", "dev", host.port, "master", "br0")
        _ip("-n", self.switch, "link", "set", "dev", host.port, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        return host

    def forward(self, host: Host, port: int) -> Path:
        """A Unix socket in the workdir that reaches `host`'s TCP `port` on loopback."""
        path = self.sockdir / f"{host.name}-{port}.sock"
        log = self.workdir / f"forward-{host.name}-{port}.log"
        proc = host.popen([sys.executable, __file__, "forward", str(path), str(port)], log)
        self._forwarders.append(proc)
        deadline = time.monotonic() + 30
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"forwarder did not start: {log.read_text(errors='replace')}")
            time.sleep(0.05)
        return path

    def close(self) -> None:
        """Stop every process in every host (ours: the namespaces are this run's), then remove
        the namespaces; safe to call twice and after a failure half-way."""
        for host in self.hosts.values():
            for proc in host.procs:
                if proc.poll() is None:
                    proc.terminate()
        deadline = time.monotonic() + 10
        for host in self.hosts.values():
            for proc in host.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for host in self.hosts.values():
            # What is left (workers an agent started, processes it left behind) dies now.
            for pid in host.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for proc in host.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for host in self.hosts.values():
            _ip("netns", "del", host.netns, check=False)
        self.hosts.clear()
        _ip("netns", "del", self.switch, check=False)
        shutil.rmtree(self.sockdir, ignore_errors=True)


# ---- the forwarder -------------------------------------------------------------------------


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError):
            writer.close()


async def _serve_forward(path: str, port: int) -> None:
    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()  # the controller is down: the client sees a closed connection
            return
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    tmp = path + ".tmp"
    server = await asyncio.start_unix_server(relay, path=tmp)
    os.replace(tmp, path)  # appears only once it accepts
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "forward":
        asyncio.run(_serve_forward(sys.argv[2], int(sys.argv[3])))
    else:
        sys.exit("usage: netns.py forward UDS_PATH PORT")
