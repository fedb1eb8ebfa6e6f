"""High availability: controllers sharing one PostgreSQL elect one leader, fence the writes
of a leader that lost the lead, forward writes from standbys, and never grant twice, also
while the leader is killed."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from gpupool.client.sdk import PoolClient
from gpupool.controller import ha
from gpupool.controller.app import open_store
from gpupool.controller.models import TenantRow
from gpupool.controller.settings import ControllerSettings
from gpupool.protocol.v1.api import LeaseCreate, TenantCreate
from tests.conftest import AUTH, ControllerProcess, register_fake_node
from tests.timing import scaled

pytestmark = [pytest.mark.postgres]

HOLDING = ("granted", "active", "idle", "preempted")


def ha_status(url: str) -> dict[str, Any] | None:
    try:
        response = httpx.get(url + "/api/v1/ha", timeout=2, headers=AUTH)
    except httpx.HTTPError:
        return None
    return dict(response.json()) if response.status_code == 200 else None


def wait_for_leader(urls: list[str], timeout_s: float = 30, not_: str | None = None) -> str:
    """The URL every controller of `urls` names as leader (and that leads by its own word)."""
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        seen = {u: ha_status(u) for u in urls}
        leaders = {s["leader"] for s in seen.values() if s is not None}
        if len(leaders) == 1:
            leader = leaders.pop()
            mine = seen.get(leader) if leader else None
            if leader and leader != not_ and mine is not None and mine["role"] == "leader":
                return str(leader)
        time.sleep(0.05)
    raise AssertionError(f"no leader agreed by {urls} within {timeout_s} s")


def start_group(
    start_controller: Callable[..., ControllerProcess], db: str, n: int
) -> list[ControllerProcess]:
    controllers = [start_controller(db, ha=True, lease_ttl_s=600.0) for _ in range(n)]
    wait_for_leader([c.url for c in controllers])
    return controllers


def holding_per_gpu(db: str) -> dict[str, tuple[int, int]]:
    """GPU → (compute % granted, number of slices) from the database itself."""
    with psycopg.connect(db) as conn:
        rows = conn.execute(
            "SELECT s.gpu_uuid, sum(s.compute_pct), count(*) FROM lease_slices s "
            "JOIN leases l ON l.id = s.lease_id WHERE l.state = ANY(%s) GROUP BY s.gpu_uuid",
            (list(HOLDING),),
        ).fetchall()
    return {str(g): (int(c), int(n)) for g, c, n in rows}


def lease_states(db: str) -> dict[str, str]:
    with psycopg.connect(db) as conn:
        return {str(i): str(s) for i, s in conn.execute("SELECT id, state FROM leases")}


def test_one_controller_leads_and_the_others_stand_by(ha_pg_url, start_controller) -> None:
    group = start_group(start_controller, ha_pg_url, 3)
    urls = [c.url for c in group]
    leader = wait_for_leader(urls)
    roles = {u: ha_status(u)["role"] for u in urls}  # type: ignore[index]
    assert sorted(roles.values()) == ["leader", "standby", "standby"]
    assert roles[leader] == "leader"
    gauges = {}
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=5).text
        [line] = [ln for ln in text.splitlines() if ln.startswith("gpupool_leader ")]
        gauges[url] = float(line.split()[1])
    assert gauges == {u: (1.0 if u == leader else 0.0) for u in urls}
    summary = httpx.get(urls[0] + "/api/v1/pool", timeout=5, headers=AUTH).json()
    assert summary["ha"]["leader"] == leader
    assert {m["url"] for m in summary["ha"]["members"] if m["up"]} == set(urls)


def test_a_standby_forwards_writes_and_serves_what_they_wrote_at_once(
    ha_pg_url, start_controller
) -> None:
    group = start_group(start_controller, ha_pg_url, 2)
    leader = wait_for_leader([c.url for c in group])
    standby = next(c for c in group if c.url != leader)
    with standby.client() as client:
        register_fake_node(client, gpus=1)
        made = client.post("/leases", json={"compute_pct": 30, "memory": "1GiB"})
        assert made.status_code == 201, made.text
        lease = made.json()
        assert lease["state"] == "granted"
        # Read back from the standby, straight after: the row is the leader's commit.
        assert client.get(f"/leases/{lease['id']}").json()["state"] == "granted"
        released = client.delete(f"/leases/{lease['id']}")
        assert released.json()["state"] == "released"
    assert lease_states(ha_pg_url) == {lease["id"]: "released"}
    # A client that knows both goes to the leader once a standby named it.
    with PoolClient(f"{standby.url},{leader}") as sdk:
        assert sdk.ha().me == standby.url
        sdk.create_tenant(TenantCreate(name="team-a"))
        assert sdk.ha().me == leader


def test_a_standby_reads_every_write_the_leader_committed_before(
    ha_pg_url, start_controller
) -> None:
    group = start_group(start_controller, ha_pg_url, 2)
    leader = wait_for_leader([c.url for c in group])
    standby = next(c for c in group if c.url != leader)
    with (
        httpx.Client(base_url=leader + "/api/v1", timeout=10, headers=AUTH) as direct,
        standby.client() as client,
    ):
        register_fake_node(direct, gpus=1)
        for round_ in range(3):
            made = [
                direct.post("/leases", json={"compute_pct": 60, "memory": "1GiB"}).json()
                for _ in range(2)
            ]
            # At once, through the standby: the queue and the GPU as the leader left them.
            assert [e["lease"]["id"] for e in client.get("/queue").json()] == [made[1]["id"]]
            [gpu] = client.get("/gpus").json()
            assert gpu["compute_granted_pct"] == 60, round_
            for lease in made:
                assert direct.delete(f"/leases/{lease['id']}").status_code == 200
            assert client.get("/queue").json() == []
            assert client.get("/gpus").json()[0]["compute_granted_pct"] == 0


def test_concurrent_requests_to_three_controllers_grant_exactly_the_capacity(
    ha_pg_url, start_controller
) -> None:
    group = start_group(start_controller, ha_pg_url, 3)
    with group[0].client() as client:
        gpus = register_fake_node(client, gpus=2)

    def ask(i: int) -> str:
        with PoolClient(group[i % 3].url) as sdk:
            return sdk.create_lease(LeaseCreate(compute_pct=50, memory="1GiB")).state

    with ThreadPoolExecutor(max_workers=30) as pool:
        states = list(pool.map(ask, range(60)))
    assert states.count("granted") == 4
    assert states.count("queued") == 56
    held = holding_per_gpu(ha_pg_url)
    assert held == {gpus[0]: (100, 2), gpus[1]: (100, 2)}


def controller_log_tails(group: list[Any], lines: int = 60) -> str:
    """The end of every controller's log (errors and tracebacks a failed request left)."""
    tails = []
    for ctl in group:
        for log in ctl.data_dir.glob("controller-*.log"):
            text = log.read_text(errors="replace").splitlines()
            tails.append(f"--- {ctl.url}\n" + "\n".join(text[-lines:]))
    return "\n".join(tails)


def test_nothing_is_granted_twice_or_lost_while_the_leader_is_killed(
    ha_pg_url, start_controller
) -> None:
    group = start_group(start_controller, ha_pg_url, 3)
    urls = [c.url for c in group]
    leader = wait_for_leader(urls)
    with group[0].client() as client:
        gpus = register_fake_node(client, gpus=2)
    answers: list[tuple[str, str]] = []
    lock = threading.Lock()
    half = threading.Event()

    def ask(i: int) -> None:
        # Each client knows every controller, starting from a different one.
        order = urls[i % 3 :] + urls[: i % 3]
        with PoolClient(",".join(order)) as sdk:
            lease = sdk.create_lease(LeaseCreate(compute_pct=25, memory="1GiB"))
        with lock:
            answers.append((lease.id, lease.state))
            if len(answers) == 40:
                half.set()

    with ThreadPoolExecutor(max_workers=20) as pool:
        futures = [pool.submit(ask, i) for i in range(100)]
        assert half.wait(60)
        next(c for c in group if c.url == leader).kill9()
        failures = [f.exception() for f in futures if f.exception() is not None]
    # A failed request's cause is in a controller's log: shown with the failure.
    assert not failures, (failures[:3], controller_log_tails(group))

    survivors = [u for u in urls if u != leader]
    wait_for_leader(survivors, not_=leader)
    ids = [i for i, _ in answers]
    assert len(ids) == len(set(ids)) == 100, "every request made exactly one lease"
    states = lease_states(ha_pg_url)
    assert set(states) == set(ids), "no lease was lost, none was made twice"
    assert sum(1 for s in states.values() if s in HOLDING) == 8
    assert sum(1 for s in states.values() if s == "queued") == 92
    assert holding_per_gpu(ha_pg_url) == {gpus[0]: (100, 4), gpus[1]: (100, 4)}
    # What the clients were told is what the database holds, grant for grant.
    for lease_id, state in answers:
        assert states[lease_id] == state or (state == "queued" and states[lease_id] in HOLDING)


def test_after_kill9_of_the_leader_a_standby_leads_with_every_lease_and_the_queue(
    ha_pg_url, start_controller
) -> None:
    group = start_group(start_controller, ha_pg_url, 3)
    urls = [c.url for c in group]
    leader = wait_for_leader(urls)
    with PoolClient(",".join(urls)) as sdk:
        with httpx.Client(base_url=leader + "/api/v1", timeout=10, headers=AUTH) as client:
            register_fake_node(client, gpus=1)
        made = [sdk.create_lease(LeaseCreate(compute_pct=40, memory="1GiB")) for _ in range(5)]
        assert [m.state for m in made] == ["granted", "granted", "queued", "queued", "queued"]
        queue_before = [e.lease.id for e in sdk.queue()]
        before = lease_states(ha_pg_url)

        killed_at = time.monotonic()
        next(c for c in group if c.url == leader).kill9()
        survivors = [u for u in urls if u != leader]
        new_leader = wait_for_leader(survivors, timeout_s=15, not_=leader)
        takeover_s = time.monotonic() - killed_at
        assert new_leader in survivors
        assert takeover_s < scaled(15)

        assert lease_states(ha_pg_url) == before
        assert [e.lease.id for e in sdk.queue()] == queue_before
        status = sdk.ha()
        assert status.epoch == 2
        dead = next(m for m in status.members if m.url == leader)
        assert not dead.up
        # The new leader serves the queue: a release grants its head.
        sdk.release_lease(made[0].id)
        assert sdk.lease(queue_before[0]).state == "granted"
        assert [e.lease.id for e in sdk.queue()] == queue_before[1:]


def test_a_leader_whose_lock_connection_dies_stops_leading_and_another_takes_over(
    ha_pg_url, start_controller
) -> None:
    group = start_group(start_controller, ha_pg_url, 2)
    urls = [c.url for c in group]
    leader = wait_for_leader(urls)
    with psycopg.connect(ha_pg_url, autocommit=True) as conn:
        [(pid,)] = conn.execute(
            # This database's lock only: HA tests running beside this one hold the same key in
            # databases of their own.
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (ha.LOCK_KEY,),
        ).fetchall()
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    deadline = time.monotonic() + scaled(15)
    while time.monotonic() < deadline:
        status = ha_status(urls[0])
        if status is not None and status["epoch"] >= 2 and status["leader"]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("no takeover after the leader lost its lock connection")
    new_leader = wait_for_leader(urls)
    # The old leader finds out by itself (its lock connection fails) and stands by, unless
    # it won the lead back: either way exactly one leads.
    deadline = time.monotonic() + scaled(15)
    while sorted((ha_status(u) or {}).get("role", "") for u in urls) != ["leader", "standby"]:
        assert time.monotonic() < deadline, "the two controllers disagree on who leads"
        time.sleep(0.1)
    with httpx.Client(base_url=leader + "/api/v1", timeout=10, headers=AUTH) as client:
        # Written through the old leader: forwarded if it stands by, served if it won again.
        assert client.post("/tenants", json={"name": "after"}).status_code == 201
    assert new_leader in urls


def test_a_leader_fenced_by_a_newer_epoch_writes_nothing(ha_pg_url, tmp_path: Path) -> None:
    settings = ControllerSettings(data_dir=tmp_path, db_url=ha_pg_url, ha=True, port=1)
    store = open_store(settings)
    group = ha.Group(store, settings)
    try:
        assert group._try_lock()
        asyncio.run(group._take_lead())
        assert store.leading and group.epoch == 1
        store.write_sync(lambda s: s.add(TenantRow(name="before")))
        # Another controller took the lead while this one still believes it leads.
        with psycopg.connect(ha_pg_url, autocommit=True) as conn:
            conn.execute("UPDATE ha_leader SET epoch = epoch + 1")
        with pytest.raises(ha.NotLeader):
            store.write_sync(lambda s: s.add(TenantRow(name="after")))
        assert group.role is ha.Role.STANDBY and not store.leading
        with psycopg.connect(ha_pg_url) as conn:
            names = {n for (n,) in conn.execute("SELECT name FROM tenants")}
        assert "before" in names and "after" not in names
    finally:
        group._release_lock()
        store.stop()
        store.engine.dispose()


def test_the_same_request_id_sent_twice_makes_one_lease(start_controller, db_url) -> None:
    ctl = start_controller(db_url)
    with ctl.client() as client:
        register_fake_node(client, gpus=1)
        body = {"compute_pct": 10, "memory": "1GiB", "request_id": "r-resent-0001"}
        first = client.post("/leases", json=body)
        second = client.post("/leases", json=body)
        assert first.status_code == second.status_code == 201
        assert first.json()["id"] == second.json()["id"]
        assert len(client.get("/leases").json()) == 1
        assert client.post("/tenants", json={"name": "other"}).status_code == 201
        other = client.post("/leases", json={**body, "tenant": "other"})
        assert other.status_code == 409, "a key is one request's, not another tenant's"


def test_ha_without_postgresql_is_refused_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "gpupool.cli", "controller", "--ha", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--ha needs a PostgreSQL" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


class DbLink:
    """A TCP relay between one controller and PostgreSQL that the test can cut and heal."""

    def __init__(self, upstream_port: int = 5432) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self.open = True
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self.lock:
                self.pairs.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Every connection through the link ends, and new ones are refused."""
        self.open = False
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def heal(self) -> None:
        self.open = True

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_a_leader_cut_off_from_the_database_stops_writing_and_comes_back_as_a_standby(
    ha_pg_url, start_controller
) -> None:
    link = DbLink()
    try:
        via_link = ha_pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{link.port}")
        assert via_link != ha_pg_url
        first = start_controller(via_link, ha=True, lease_ttl_s=600.0)
        assert wait_for_leader([first.url]) == first.url
        second = start_controller(ha_pg_url, ha=True, lease_ttl_s=600.0)
        urls = [first.url, second.url]
        assert wait_for_leader(urls) == first.url
        with PoolClient(",".join(urls)) as sdk:
            with first.client() as client:
                register_fake_node(client, gpus=1)
            before = sdk.create_lease(LeaseCreate(compute_pct=50, memory="1GiB"))

            link.cut()
            deadline = time.monotonic() + scaled(20)
            while (ha_status(second.url) or {}).get("role") != "leader":
                assert time.monotonic() < deadline, "the standby did not take over"
                time.sleep(0.1)
            # Through both URLs, the first one cut off: the request lands on the new leader.
            after = sdk.create_lease(LeaseCreate(compute_pct=50, memory="1GiB"))
            assert after.state == "granted"
            states = lease_states(ha_pg_url)
            assert states == {before.id: "granted", after.id: "granted"}

            link.heal()
            deadline = time.monotonic() + scaled(30)
            while (ha_status(first.url) or {}).get("role") != "standby":
                assert time.monotonic() < deadline, "the old leader did not come back"
                time.sleep(0.2)
            assert wait_for_leader(urls) == second.url
            # The healed controller forwards writes to the new leader.
            with first.client() as client:
                released = client.delete(f"/leases/{before.id}")
                assert released.status_code == 200, released.text
        assert lease_states(ha_pg_url) == {before.id: "released", after.id: "granted"}
        assert list(holding_per_gpu(ha_pg_url).values()) == [(50, 1)]
    finally:
        link.close()
