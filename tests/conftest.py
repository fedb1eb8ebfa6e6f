"""Shared fixtures: free ports, fresh PostgreSQL databases, and real controller processes;
and the suite's slowdown factor (tests/timing.py), which stretches every test's timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gpupool.cli.local import stop_process
from gpupool.protocol.v1.tokens import new_token
from tests.ports import free_port
from tests.timing import SLOWDOWN_ENV, scaled, slowdown

PG_ADMIN = os.environ.get("GPUPOOL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")

# Every controller the tests start installs this admin token ($GPUPOOL_ADMIN_TOKEN), and every
# CLI, SDK client and agent they start sends it ($GPUPOOL_TOKEN). Tests of the roles make
# tokens of their own.
ADMIN_TOKEN = os.environ.setdefault("GPUPOOL_ADMIN_TOKEN", new_token()[2])
os.environ.setdefault("GPUPOOL_TOKEN", ADMIN_TOKEN)
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# Agents keep no ready workers unless a test asks (--ready-workers, or ready_per_gpu): a worker
# started ahead of its lease is a torch process per simulated GPU of every agent of the suite.
os.environ.setdefault("GPUPOOL_READY_WORKERS", "0")
# No test reads or changes the user's own contexts (`gpupool up` records one): every test
# process, and what it starts, uses a config file of its own.
os.environ["GPUPOOL_CONFIG"] = str(
    Path(tempfile.mkdtemp(prefix="gpupool-test-config-")) / "config.toml"
)


_FACTOR_SOURCE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Take the slowdown factor before any test runs: measured here in the main process (and
    put in the environment), read from it in pytest-xdist's workers."""
    given = os.environ.get(SLOWDOWN_ENV)
    source = f"from {SLOWDOWN_ENV}" if given else f"measured (set {SLOWDOWN_ENV} to choose it)"
    config.stash[_FACTOR_SOURCE] = source
    try:
        slowdown()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> str:
    default = _default_timeout(config)
    stretched = f" (timeout {default:g} s -> {default * slowdown():g} s)" if default else ""
    return (
        f"gpupool slowdown: x{slowdown():g}, {config.stash[_FACTOR_SOURCE]}: "
        f"test timeouts and waits scaled by it{stretched}"
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The factor again at the end, where `-q` (which hides the header) still shows it."""
    terminalreporter.write_line(f"gpupool slowdown: x{slowdown():g}")


def _default_timeout(config: pytest.Config) -> float:
    """pytest-timeout's resolved setting: --timeout, else PYTEST_TIMEOUT, else the ini file's."""
    return float(getattr(config, "_env_timeout", None) or 0)


def _timeout_of(marker: pytest.Mark | None, default: float) -> float:
    if marker is None:
        return default
    if marker.args:
        return float(marker.args[0])
    return float(marker.kwargs.get("timeout", default))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Stretch each test's pytest-timeout limit (its own `timeout` marker, else the configured
    one) by the slowdown factor: a marker put first wins over any other."""
    factor = slowdown()
    default = _default_timeout(config)
    for item in items:
        marker = item.get_closest_marker("timeout")
        timeout = _timeout_of(marker, default)
        if timeout <= 0:  # no timeout asked for: nothing to stretch
            continue
        kwargs = {k: v for k, v in (marker.kwargs if marker else {}).items() if k != "timeout"}
        item.add_marker(pytest.mark.timeout(round(timeout * factor, 1), **kwargs), append=False)


def _pg_available() -> str | None:
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN, connect_timeout=3):
            return None
    except Exception as exc:  # any failure means: no PostgreSQL here
        return f"PostgreSQL at {PG_ADMIN} is not reachable: {exc}"


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    problem = _pg_available()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)
    return PG_ADMIN


@pytest.fixture
def pg_url(pg_admin_url: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    import psycopg

    name = f"gpupool_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield pg_admin_url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def ha_pg_url(pg_admin_url: str) -> Iterator[str]:
    """A fresh PostgreSQL database for one high-availability test, shared by its controllers.

    Ask for it before `start_controller`, so that the controllers stop before it is dropped.
    """
    import psycopg

    name = f"gpupool_ha_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield pg_admin_url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    """Runs a test once on SQLite (None: the embedded default) and once on PostgreSQL."""
    if request.param == "sqlite":
        return None
    return str(request.getfixturevalue("pg_url"))


@dataclass
class ControllerProcess:
    url: str
    port: int
    data_dir: Path
    db_url: str | None
    proc: subprocess.Popen[bytes]
    extra: dict[str, object]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url + "/api/v1", timeout=scaled(30), headers=AUTH)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=scaled(10))

    def stop(self) -> None:
        stop_process(self.proc)

    def restart(self) -> None:
        self.stop()
        self.proc = _spawn(self.port, self.data_dir, self.db_url, self.extra)
        _wait_ready(self.url, self.proc)


def _spawn(
    port: int, data_dir: Path, db_url: str | None, extra: dict[str, object]
) -> subprocess.Popen[bytes]:
    args = ", ".join(f"{k}={v!r}" for k, v in extra.items())
    code = (
        "from pathlib import Path\n"
        "from gpupool.startup import imports_without_gc\n"
        "with imports_without_gc():\n"
        "    from gpupool.controller.settings import ControllerSettings\n"
        "    from gpupool.controller.server import serve\n"
        f"serve(ControllerSettings(port={port}, data_dir=Path({str(data_dir)!r}), "
        f"db_url={db_url!r}{', ' + args if args else ''}))\n"
    )
    log = open(data_dir / f"controller-{port}.log", "ab")  # noqa: SIM115 - lives with the process
    return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"controller exited with {proc.returncode}")
        try:
            if httpx.get(url + "/api/v1/health", timeout=scaled(2)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"controller did not become ready within {scaled(timeout_s):.0f} s")


@pytest.fixture
def start_controller(tmp_path: Path) -> Iterator[object]:
    """Start real controller processes on loopback: `start_controller(db_url, **settings)`."""
    started: list[ControllerProcess] = []

    def start(db_url: str | None = None, **extra: object) -> ControllerProcess:
        port = free_port()
        data_dir = tmp_path / f"ctl-{port}"
        data_dir.mkdir()
        proc = _spawn(port, data_dir, db_url, extra)
        ctl = ControllerProcess(f"http://127.0.0.1:{port}", port, data_dir, db_url, proc, extra)
        started.append(ctl)
        _wait_ready(ctl.url, proc)
        return ctl

    yield start
    for ctl in started:
        ctl.stop()


def register_fake_node(
    client: httpx.Client, name: str = "node-a", gpus: int = 1, memory_mib: int = 81920
) -> list[str]:
    body = {
        "name": name,
        "backend": "fake",
        "gpus": [
            {
                "uuid": f"GPU-sim-{name}-{i}",
                "index": i,
                "model": "H100-80GB (simulated)",
                "memory_mib": memory_mib,
                "simulated": True,
            }
            for i in range(gpus)
        ],
    }
    response = client.post("/nodes", json=body)
    assert response.status_code == 201, response.text
    return [g["uuid"] for g in body["gpus"]]  # type: ignore[index]
