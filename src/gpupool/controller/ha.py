"""High availability: controllers sharing one PostgreSQL elect one leader; the others serve
reads from the database and forward writes to it, and take over when it dies.

Election: a PostgreSQL session advisory lock, held on a connection of its own. PostgreSQL
frees it the moment that connection ends: at once when the leader's process dies (the
kernel closes its socket), within seconds when it is cut off (server-side TCP
keepalives on that connection), so a standby that polls for it takes over within a tick.

Fencing: the lock alone cannot stop a leader that lost it without noticing yet. So each
takeover raises the `epoch` in the one `ha_leader` row, and every write transaction of a
leader first updates that row where the epoch is its own (counting its writes) and refuses
to go on when no row matched. A takeover's UPDATE waits for a write transaction still
holding that row, and any later transaction of the old leader finds the new epoch: the two
leaders' writes never interleave, and the new leader loads the pool only after the old
one's last commit.

Standbys answer reads from the database and from a copy of the pool, reloaded before a read
when the leader's count of writes moved; they forward writes to the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import httpx
from sqlalchemy import delete, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from gpupool import __version__
from gpupool.controller.models import HaLeaderRow, HaMemberRow
from gpupool.controller.services import auth
from gpupool.controller.services.tenants import ensure_default
from gpupool.controller.settings import ControllerSettings
from gpupool.controller.store import Store
from gpupool.core import PoolError
from gpupool.protocol.asgi import send_json
from gpupool.protocol.v1 import API_PREFIX
from gpupool.protocol.v1.api import HaMemberOut, HaOut

if TYPE_CHECKING:
    import psycopg  # imported where used: only --ha controllers, on PostgreSQL, need it

log = logging.getLogger("gpupool.controller.ha")

LOCK_KEY = 7210010
"""The advisory lock whose holder leads (the migration lock is 7210001)."""
BACKGROUND_REFRESH_S = 2.0
"""How often a standby refreshes its copy of the pool unasked; reads refresh it on demand."""
MEMBER_TIMEOUT_S = 5.0
"""A controller that has not reported for this long is shown as down."""
LEADER_HEADER = "x-gpupool-leader"
"""On an answer a standby forwarded: the leader's URL."""
FORWARDED_BY = "x-gpupool-forwarded-by"
"""Set on a write forwarded to the leader: a controller that gets one and does not lead
answers 503 instead of forwarding it again, so a request never loops."""

# The server drops a silent connection after about idle + interval * count seconds, which
# frees the lock of a leader cut off from the database; the client side does the same for
# connections this controller holds.
KEEPALIVE_OPTIONS = (
    "-c tcp_keepalives_idle=2 -c tcp_keepalives_interval=1 -c tcp_keepalives_count=3 "
    "-c tcp_user_timeout=5000"
)
CLIENT_KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 2,
    "keepalives_interval": 1,
    "keepalives_count": 3,
    "tcp_user_timeout": 5000,
    "connect_timeout": 3,
}


Lead = Callable[[asyncio.Event], Coroutine[Any, Any, None]]
"""What the leader runs (the reconcile loop) until the event is set."""


class Role(StrEnum):
    LEADER = "leader"
    STANDBY = "standby"


class NotLeader(PoolError):
    """This controller does not lead (now): the client should try again, another one will."""

    code = "not_leader"
    http_status = 503


class HaUnsupported(PoolError):
    code = "ha_unsupported"
    http_status = 400


def engine_connect_args() -> dict[str, Any]:
    """Driver arguments of an HA controller's engine: keepalives on both ends, so that the
    write transactions of a controller cut off from the database end within seconds and
    cannot hold a takeover back."""
    return {**CLIENT_KEEPALIVES, "options": KEEPALIVE_OPTIONS}


@dataclass(frozen=True, slots=True)
class Leader:
    controller: str | None
    url: str | None
    epoch: int
    since: datetime | None


class Group:
    """This controller's place in its HA group: the election, the fence, the status."""

    def __init__(self, store: Store, settings: ControllerSettings) -> None:
        if store.engine.dialect.name != "postgresql":
            raise HaUnsupported(
                "high availability needs PostgreSQL shared by the controllers "
                f"(--db postgresql://...); this store is {store.engine.dialect.name}"
            )
        self.store = store
        self.settings = settings
        self.me = settings.own_url()
        self.role = Role.STANDBY
        self.epoch = 0
        self.leader = Leader(None, None, 0, None)
        self.started_at = time.time()
        self.took_lead_at: float | None = None
        self._lock_conn: psycopg.Connection[Any] | None = None
        self._holds_lock = False
        self._reload_lock = asyncio.Lock()
        self._refreshed_at = 0.0
        self._loaded_changes = 0
        self._loaded_once = False
        self._http: httpx.AsyncClient | None = None
        self._lead_task: asyncio.Task[None] | None = None
        self._lead_stop = asyncio.Event()
        store.leading = False
        store.fence = self.fence

    # ---- the fence (writer thread) ---------------------------------------------------

    def fence(self, session: Session) -> None:
        """Refuse the write transaction unless this controller leads in the current epoch.

        One UPDATE both checks the epoch and counts the transaction (standbys reload when
        the count moved); its row lock, held to the commit, is what a takeover waits for.
        """
        if self.role is not Role.LEADER:
            raise NotLeader(self.not_leading())
        try:
            counted = session.execute(
                update(HaLeaderRow)
                .where(HaLeaderRow.id == 1, HaLeaderRow.epoch == self.epoch)
                .values(changes=HaLeaderRow.changes + 1)
                .returning(HaLeaderRow.changes)
                .execution_options(synchronize_session=False)
            ).scalar_one_or_none()
        except SQLAlchemyError as exc:
            # Cut off from the database: whether it still leads is unknown, so it may not
            # write; clients are told to try another controller rather than given a 500.
            raise NotLeader(
                f"{self.me} cannot reach the database to check that it leads: try another "
                "controller"
            ) from exc
        if counted is None:
            self._step_down(f"a newer epoch began elsewhere while this one led {self.epoch}")
            raise NotLeader(self.not_leading())

    def leads(self) -> bool:
        return self.role is Role.LEADER

    def not_leading(self) -> str:
        if self.leader.url and self.leader.url != self.me:
            return f"{self.me} does not lead; the leader is {self.leader.url}: try it"
        return f"{self.me} does not lead and no leader is known yet; try again in a second"

    # ---- the election loop -------------------------------------------------------------

    async def run(self, stop: asyncio.Event, lead: Lead) -> None:
        """Try for the lead, lead (running `lead` until the lead is lost), report, repeat."""
        try:
            while not stop.is_set():
                await self._let_go_if_lost()
                try:
                    if self.role is Role.STANDBY:
                        if await asyncio.to_thread(self._try_lock):
                            await self._take_lead()
                        else:
                            await asyncio.to_thread(self.learn_leader)
                            if time.monotonic() - self._refreshed_at >= BACKGROUND_REFRESH_S:
                                # For what no request asks for: history and alert rules.
                                self._refreshed_at = time.monotonic()
                                await self.fresh()
                    elif not await asyncio.to_thread(self._lock_alive):
                        self._step_down("lost the connection that holds the leader lock")
                except Exception:
                    log.exception("HA election step failed; retrying")
                await self._let_go_if_lost()
                if self.role is Role.LEADER and self._lead_task is None:
                    self._lead_stop = asyncio.Event()
                    self._lead_task = asyncio.create_task(lead(self._lead_stop), name="ha-lead")
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self._report, self.role.value)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.settings.ha_tick_s)
        finally:
            self.role = Role.STANDBY
            self.store.leading = False
            await self._let_go_if_lost()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._report, "stopped")
            if self._http is not None:
                await self._http.aclose()

    async def _let_go_if_lost(self) -> None:
        """After the lead was lost (the fence, the lock's connection, a failed takeover):
        stop the leader's loops and free the lock, so this controller competes afresh."""
        if self.role is not Role.STANDBY:
            return
        if self._lead_task is not None:
            self._lead_stop.set()
            await self._lead_task
            self._lead_task = None
        if self._holds_lock:
            await asyncio.to_thread(self._release_lock)

    async def _take_lead(self) -> None:
        try:
            epoch = await asyncio.to_thread(self._claim_epoch)
            # The pool is loaded after the epoch moved: every commit of the old leader is
            # in the database by then, and none can follow. Not beside a standby's reload,
            # whose older copy could otherwise land last.
            async with self._reload_lock:
                await asyncio.to_thread(self.store.load, True)
        except Exception:
            await asyncio.to_thread(self._release_lock)
            raise
        self.epoch = epoch
        self.role = Role.LEADER
        self.store.leading = True
        self.took_lead_at = time.time()
        self.leader = Leader(self.me, self.me, epoch, None)
        log.warning("%s leads the pool (epoch %d)", self.me, epoch)
        await self.store.write(lambda s: ensure_default(self.store, s))
        settings = self.store.settings
        written = await self.store.write(
            lambda s: auth.bootstrap(s, settings.data_dir, settings.admin_token)
        )
        if written:
            log.warning("first admin token written to %s (readable by its owner only)", written)

    def _step_down(self, why: str) -> None:
        if self.role is Role.LEADER:
            log.error("%s stops leading: %s", self.me, why)
        # What it held as leader may include writes that were never committed.
        self._loaded_once = False
        if self.leader.url == self.me:
            self.leader = Leader(None, None, 0, None)
        self.role = Role.STANDBY
        self.store.leading = False
        self.epoch = 0

    # ---- database work (threads) -------------------------------------------------------

    def _lock_dsn(self) -> str:
        return self.store.engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False
        )

    def _try_lock(self) -> bool:
        import psycopg

        if self._lock_conn is None or self._lock_conn.closed:
            self._lock_conn = psycopg.connect(
                self._lock_dsn(),
                autocommit=True,
                options=KEEPALIVE_OPTIONS + " -c statement_timeout=3000",
                **CLIENT_KEEPALIVES,
            )
        row = self._lock_conn.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,)).fetchone()
        self._holds_lock = bool(row and row[0])
        return self._holds_lock

    def _lock_alive(self) -> bool:
        import psycopg

        conn = self._lock_conn
        if conn is None or conn.closed:
            return False
        try:
            conn.execute("SELECT 1")
        except psycopg.Error:
            return False
        return True

    def _release_lock(self) -> None:
        """Close the lock's connection: PostgreSQL frees the lock with it, whatever state
        the connection is in."""
        import psycopg

        conn, self._lock_conn = self._lock_conn, None
        self._holds_lock = False
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def _claim_epoch(self) -> int:
        with Session(self.store.engine) as session, session.begin():
            session.execute(insert(HaLeaderRow).values(id=1, epoch=0).on_conflict_do_nothing())
            epoch = session.execute(
                update(HaLeaderRow)
                .where(HaLeaderRow.id == 1)
                .values(
                    epoch=HaLeaderRow.epoch + 1,
                    controller=self.me,
                    url=self.me,
                    since=func.now(),
                )
                .returning(HaLeaderRow.epoch)
            ).scalar_one()
            # Controllers gone for a day are history, not members.
            session.execute(
                delete(HaMemberRow).where(
                    HaMemberRow.last_seen_at < func.now() - text("interval '1 day'")
                )
            )
        return int(epoch)

    def learn_leader(self) -> None:
        """As a standby: learn who leads, from the leader row."""
        with Session(self.store.engine) as session:
            row = session.get(HaLeaderRow, 1)
            if row is not None:
                self.leader = Leader(row.controller, row.url, row.epoch, row.since)

    def _changes(self) -> int:
        with Session(self.store.engine) as session:
            count = session.scalar(select(HaLeaderRow.changes).where(HaLeaderRow.id == 1))
        return int(count or 0)

    def _reload(self) -> int:
        """Load the pool; returns the count of writes the loaded copy holds at least."""
        count = self._changes()
        self.store.load(forget_liveness=True)
        return count

    async def fresh(self) -> None:
        """On a standby: make the copy of the pool hold every write committed before now.

        Reads that arrive together share one reload; with no new write there is none.
        """
        if self.role is Role.LEADER:
            return
        count = await asyncio.to_thread(self._changes)
        if count <= self._loaded_changes and self._loaded_once:
            return
        async with self._reload_lock:
            # It may have taken the lead while this read waited.
            if self.leads() or (count <= self._loaded_changes and self._loaded_once):
                return
            loaded = await asyncio.to_thread(self._reload)
            self._loaded_changes = max(self._loaded_changes, loaded)
            self._loaded_once = True

    def _report(self, role: str) -> None:
        values = {
            "url": self.me,
            "role": role,
            "epoch": self.epoch,
            "version": __version__,
            "last_seen_at": func.now(),
        }
        statement = insert(HaMemberRow).values(id=self.me, started_at=func.now(), **values)
        statement = statement.on_conflict_do_update(index_elements=["id"], set_=values)
        with Session(self.store.engine) as session, session.begin():
            session.execute(statement)

    def status(self, session: Session) -> HaOut:
        """The group as the database sees it now (runs on a reader thread)."""
        row = session.get(HaLeaderRow, 1)
        members = session.execute(
            select(
                HaMemberRow, func.extract("epoch", func.now() - HaMemberRow.last_seen_at)
            ).order_by(HaMemberRow.id)
        ).all()
        current = row.epoch if row is not None else 0
        out = []
        for member, ago in members:
            seen_s = max(0.0, float(ago or 0.0))
            # A leader of an older epoch lost the lead: it is dead or about to step down.
            stale = member.role == "leader" and member.epoch != current
            up = member.role != "stopped" and seen_s < MEMBER_TIMEOUT_S and not stale
            role = member.role if member.role in ("leader", "standby", "stopped") else "standby"
            out.append(
                HaMemberOut(
                    id=member.id,
                    url=member.url,
                    role=role,
                    epoch=member.epoch,
                    version=member.version,
                    last_seen_s=round(seen_s, 3),
                    up=up,
                )
            )
        leader_url = row.url if row is not None else None
        # The row names the last controller that took the lead; it leads still only if it
        # is alive and holds that epoch.
        alive = any(m.url == leader_url and m.up and m.role == "leader" for m in out) or (
            self.role is Role.LEADER and leader_url == self.me
        )
        return HaOut(
            enabled=True,
            me=self.me,
            role=self.role.value,
            leader=leader_url if alive else None,
            epoch=row.epoch if row is not None else 0,
            leader_since=row.since if row is not None else None,
            members=out,
        )

    # ---- forwarding writes -------------------------------------------------------------

    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            # One INFO line per forwarded request would flood the log and slow every write.
            logging.getLogger("httpx").setLevel(logging.WARNING)
            self._http = httpx.AsyncClient(timeout=30.0)
        return self._http


def single_status(settings: ControllerSettings) -> HaOut:
    """The status of a controller that runs alone: it leads, nobody else exists."""
    return HaOut(
        enabled=False,
        me=settings.own_url(),
        role="leader",
        leader=settings.own_url(),
        epoch=0,
        leader_since=None,
    )


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

READS = frozenset({"GET", "HEAD", "OPTIONS"})
UNCACHED_READS = frozenset({f"{API_PREFIX}/ha", f"{API_PREFIX}/health"})
"""Reads that never look at the copy of the pool: no refresh before them."""
HOP_BY_HOP = frozenset(
    {
        b"host",
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"content-length",
        b"upgrade",
        b"te",
        b"trailer",
        b"proxy-authorization",
        b"proxy-authenticate",
    }
)


class Standby:
    """ASGI middleware of a standby: API writes go to the leader and its answers come back
    as they are; reads are answered here, from a copy of the pool made fresh first.

    Forwarding (rather than redirecting) serves every client the same way: agents, the SDK,
    curl and browsers; the Authorization header travels with the request.
    """

    def __init__(self, app: App, group: Callable[[], Group | None]) -> None:
        self.app = app
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        group = self.group()
        if group is None or scope["type"] != "http" or group.role is Role.LEADER:
            await self.app(scope, receive, send)
            return
        path = str(scope["path"])
        if scope["method"] in READS or not path.startswith(API_PREFIX):
            if path not in UNCACHED_READS:
                try:
                    await group.fresh()
                except Exception as exc:  # the database is away: answer from the last copy
                    log.debug("standby could not refresh before a read: %s", exc)
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]
        target = group.leader.url
        if not target or target == group.me:
            # Just stepped down, or the lead just moved: ask the database before refusing.
            with contextlib.suppress(Exception):
                await asyncio.to_thread(group.learn_leader)
            target = group.leader.url
        if (
            any(k.lower() == FORWARDED_BY.encode() for k, _ in headers)
            or not target
            or target == group.me
        ):
            await _answer(send, 503, NotLeader(group.not_leading()))
            return
        url = target + str(scope["path"])
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers.append((FORWARDED_BY.encode(), group.me.encode()))
        try:
            response = await group.http().request(
                scope["method"], url, content=body, headers=headers
            )
        except httpx.TransportError as exc:
            await _answer(
                send,
                503,
                NotLeader(
                    f"the leader {target} did not answer ({type(exc).__name__}); "
                    "a standby takes over within seconds: try again"
                ),
            )
            return
        out = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in response.headers.items()
            if k.encode("latin-1").lower() not in HOP_BY_HOP and k.lower() != "content-encoding"
        ]
        out.append((b"content-length", str(len(response.content)).encode()))
        # Clients that know several controllers go straight to the leader from now on.
        out.append((LEADER_HEADER.encode(), target.encode("latin-1")))
        await send({"type": "http.response.start", "status": response.status_code, "headers": out})
        await send({"type": "http.response.body", "body": response.content})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


async def _answer(send: Send, status: int, error: PoolError) -> None:
    body = {"error": error.code, "detail": error.message}
    await send_json(send, status, body, [(b"retry-after", b"1")])
