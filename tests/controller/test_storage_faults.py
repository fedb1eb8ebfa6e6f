"""Storage faults (read-only or full disk, a failing database) are answered with a clean 503
and a log line; reads go on, nothing is corrupted, and the controller never exits silently."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import OperationalError

from gpupool.controller import store as store_module
from gpupool.controller.store import Store
from tests.conftest import AUTH, register_fake_node
from tests.controller.inprocess import API, controller, register
from tests.timing import scaled


def _names(client: Any, prefix: str = "") -> set[str]:
    return {t["name"] for t in client.get(f"{prefix}/tenants").json()}


# ---- injected faults: every database, every machine ---------------------------------------


@contextlib.contextmanager
def _commits_fail(store: Store, reason: str) -> Iterator[None]:
    """Every commit of the store's engine fails as the driver would on a full disk."""
    dialect = store.engine.dialect
    real = dialect.do_commit

    def refuse(connection: Any) -> None:
        if not store._flushed:  # a read-only transaction commits on a full disk too
            real(connection)
            return
        raise OperationalError("COMMIT", {}, sqlite3.OperationalError(reason))

    dialect.do_commit = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        dialect.do_commit = real  # type: ignore[method-assign]


def test_failed_commit_is_a_503_with_the_reason_and_the_pool_stays_what_was_committed(
    tmp_path: Path, db_url: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    with controller(tmp_path, db_url=db_url) as client:
        store: Store = client.app.state.store  # type: ignore[attr-defined]
        register(client, gpus=1)
        held = client.post(f"{API}/leases", json={"compute_pct": 50, "memory": "1GiB"}).json()
        with _commits_fail(store, "database or disk is full"):
            refused = client.post(f"{API}/leases", json={"compute_pct": 50, "memory": "1GiB"})
            tenant = client.post(f"{API}/tenants", json={"name": "t-new"})
            # Reads go on meanwhile, and show only what was committed.
            leases = client.get(f"{API}/leases").json()
            names = _names(client, API)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == "storage_unavailable"
        assert "database or disk is full" in refused.json()["detail"]
        assert "nothing was changed" in refused.json()["detail"]
        assert tenant.status_code == 503
        assert [lease["id"] for lease in leases] == [held["id"]]
        assert "t-new" not in names
        # The pool in memory was rebuilt from the database: the refused grant is not held.
        assert set(store.pool.holdings) == {held["id"]}
        assert "t-new" not in store.pool.quotas
        assert any("refused a write" in r.message for r in caplog.records)
        # Once the storage works, so do writes; the half-made ones never come back.
        again = client.post(f"{API}/leases", json={"compute_pct": 50, "memory": "1GiB"})
        assert again.status_code == 201, again.text
        assert {lease["id"] for lease in client.get(f"{API}/leases").json()} == {
            held["id"],
            again.json()["id"],
        }
        assert any("writes work again" in r.message for r in caplog.records)


def test_a_database_that_cannot_be_read_back_refuses_writes_then_stops_the_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with controller(tmp_path) as client:
        store: Store = client.app.state.store  # type: ignore[attr-defined]
        stopped: list[str] = []
        store.on_fatal = stopped.append
        real_load = store.load

        def unreadable(forget_liveness: bool = False) -> None:
            raise OperationalError("SELECT", {}, sqlite3.OperationalError("disk I/O error"))

        monkeypatch.setattr(store, "load", unreadable)
        with _commits_fail(store, "disk I/O error"):
            first = client.post(f"{API}/tenants", json={"name": "t-a"})
        assert first.status_code == 503
        assert store.stale_since is not None
        # The pool may hold the failed batch's changes: nothing runs on it until rebuilt.
        monkeypatch.setattr(store_module, "STALE_EXIT_S", 0.0)
        second = client.post(f"{API}/tenants", json={"name": "t-b"})
        assert second.status_code == 503
        assert "disk I/O error" in second.json()["detail"]
        assert stopped and "could not be read" in stopped[0]
        assert store.fatal == stopped[0]
        assert any(r.levelname == "CRITICAL" for r in caplog.records)
        monkeypatch.setattr(store, "load", real_load)


# ---- real faults on a real controller process (root: chattr, tmpfs) -----------------------


def _chattr(flag: str, *paths: Path) -> None:
    subprocess.run(["chattr", flag, *map(str, paths)], check=True, capture_output=True)


@pytest.fixture
def immutable(tmp_path: Path) -> Iterator[list[Path]]:
    """Files made immutable (read-only even for root) during a test, made writable after."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    try:
        _chattr("+i", probe)
        _chattr("-i", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot make files immutable here (needs root and ext4/xfs): {exc}")
    paths: list[Path] = []
    yield paths
    for path in paths:
        with contextlib.suppress(subprocess.CalledProcessError):
            _chattr("-i", path)


@pytest.mark.slow
def test_read_only_database_gets_503_reads_go_on_and_writes_resume_after(
    start_controller: Any, immutable: list[Path]
) -> None:
    ctl = start_controller()
    files = [ctl.data_dir / "gpupool.db", ctl.data_dir / "gpupool.db-wal"]
    with ctl.client() as client:
        assert client.post("/tenants", json={"name": "t-before"}).status_code == 201
        immutable.extend(files)
        _chattr("+i", *files)
        refused = client.post("/tenants", json={"name": "t-during"})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == "storage_unavailable"
        assert ctl.proc.poll() is None
        assert _names(client) == {"default", "t-before"}
        _chattr("-i", *files)
        assert client.post("/tenants", json={"name": "t-after"}).status_code == 201
    log = (ctl.data_dir / f"controller-{ctl.port}.log").read_text()
    assert "the database refused a write" in log
    ctl.restart()
    with ctl.client() as client:
        assert _names(client) == {"default", "t-before", "t-after"}


@pytest.mark.slow
def test_read_only_shared_memory_file_stops_the_controller_loudly_not_silently(
    start_controller: Any, immutable: list[Path]
) -> None:
    """SQLite maps gpupool.db-shm; made immutable, the kernel kills the process with SIGBUS
    at the next write. No Python code can catch that: the log says so, the exit is non-zero."""
    ctl = start_controller()
    files = [ctl.data_dir / f"gpupool.db{suffix}" for suffix in ("", "-wal", "-shm")]
    with ctl.client() as client:
        immutable.extend(files)
        _chattr("+i", *files)
        with contextlib.suppress(httpx.HTTPError):
            client.post("/tenants", json={"name": "t-during"})
    assert ctl.proc.wait(timeout=scaled(30)) != 0
    log = (ctl.data_dir / f"controller-{ctl.port}.log").read_text()
    assert "Fatal Python error" in log
    for path in files:
        _chattr("-i", path)
    ctl.restart()
    with ctl.client() as client:
        assert "default" in _names(client)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (root only), unmounted after the test."""
    mount = tmp_path / "small-fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    with filler.open("wb") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 65536)
            out.flush()
    return filler


@pytest.mark.slow
def test_full_disk_answers_every_request_with_http_and_keeps_what_was_committed(
    start_controller: Any, small_fs: Path
) -> None:
    ctl = start_controller(f"sqlite:///{small_fs / 'gpupool.db'}")
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        kept = client.post("/leases", json={"compute_pct": 10, "memory": "1GiB"}).json()
        filler = _fill(small_fs)
        statuses = []
        for i in range(20):
            # Every request gets an HTTP answer: a connection reset would raise here.
            response = client.post("/tenants", json={"name": f"t-full-{i}"})
            statuses.append(response.status_code)
            if response.status_code == 503:
                assert "full" in response.json()["detail"]
        assert 503 in statuses
        assert ctl.proc.poll() is None
        assert [lease["id"] for lease in client.get("/leases").json()] == [kept["id"]]
        filler.unlink()
        assert client.post("/tenants", json={"name": "t-after"}).status_code == 201
    log = (ctl.data_dir / f"controller-{ctl.port}.log").read_text()
    assert "database or disk is full" in log
    ctl.restart()
    with httpx.Client(base_url=ctl.url + "/api/v1", headers=AUTH, timeout=30) as client:
        assert [lease["id"] for lease in client.get("/leases").json()] == [kept["id"]]
        assert "t-after" in _names(client)


def test_a_read_the_database_cannot_answer_is_a_503_not_a_500(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with controller(tmp_path) as client:
        store: Store = client.app.state.store  # type: ignore[attr-defined]

        async def unreadable(_query: Any) -> Any:
            raise OperationalError("SELECT", {}, sqlite3.OperationalError("disk I/O error"))

        monkeypatch.setattr(store, "read", unreadable)
        response = client.get(f"{API}/events")
        assert response.status_code == 503, response.text
        assert response.json()["error"] == "storage_unavailable"
        assert "disk I/O error" in response.json()["detail"]


@pytest.mark.slow
def test_controller_that_cannot_rebuild_its_pool_says_why_and_exits_non_zero(
    tmp_path: Path,
) -> None:
    """A real controller process whose database stops taking writes and cannot be read back
    (injected in the driver): it refuses writes with 503, then stops with a CRITICAL line
    and a non-zero exit status, instead of serving a pool that may not be what is stored."""
    import sys

    from tests.conftest import _wait_ready, free_port

    port = free_port()
    code = f"""
import sqlite3
from pathlib import Path
from sqlalchemy.exc import OperationalError
from gpupool.controller import store as store_module
from gpupool.controller.server import serve
from gpupool.controller.settings import ControllerSettings

store_module.STALE_EXIT_S = 0.0
broken = Path({str(tmp_path / "broken")!r})
real_load = store_module.Store.load

def fault():
    return OperationalError("COMMIT", {{}}, sqlite3.OperationalError("disk I/O error"))

def load(self, forget_liveness=False):
    if broken.exists():
        raise fault()
    real_load(self, forget_liveness)

store_module.Store.load = load

def commit_fails(session):
    if broken.exists():
        raise fault()

from sqlalchemy import event
from sqlalchemy.orm import Session
event.listen(Session, "before_commit", commit_fails)
serve(ControllerSettings(port={port}, data_dir=Path({str(tmp_path / "data")!r})))
"""
    (tmp_path / "data").mkdir()
    log = tmp_path / "controller.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc)
        (tmp_path / "broken").write_text("")
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}/api/v1", headers=AUTH, timeout=30
        ) as client:
            first = client.post("/tenants", json={"name": "t-a"})
            assert first.status_code == 503, first.text
        assert proc.wait(timeout=scaled(60)) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "CRITICAL" in text and "cannot go on" in text, text[-2000:]
    assert "gpupool controller stopped:" in text
