"""API tokens: who may call the controller, as whom, and for which tenant.

Tokens have the format of protocol/v1/tokens.py; only hashes of their secrets are stored, so
the database (or a backup of it) grants nothing.

Checking a token happens on every request, so verified tokens are cached for a few seconds;
revoking a token on this controller drops it from the cache at once, and other controllers
(high availability) see the revocation when their cache entry ages out.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpupool.controller.models import TenantRow, TokenRow, utcnow
from gpupool.controller.services.events import record
from gpupool.core import Conflict, Forbidden, InvalidRequest, NotFound, Unauthenticated
from gpupool.protocol.v1.api import Role, TokenCreate, TokenCreated, TokenOut
from gpupool.protocol.v1.tokens import digest, new_token, split

log = logging.getLogger(__name__)

ADMIN_TOKEN_FILE = "admin.token"
CACHE_S = 5.0
"""How long a verified token is trusted without looking at the database again."""


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of one request, as its token says."""

    token_id: str
    name: str
    role: Role
    tenant: str | None
    node: str | None = None
    """The one node an agent token acts for."""

    @property
    def actor(self) -> str:
        """The caller in the event log: the role and the token's name, and the tenant or node."""
        if self.role == "tenant":
            return f"tenant:{self.tenant}/{self.name}"
        if self.role == "agent" and self.node is not None:
            return f"agent:{self.node}/{self.name}"
        return f"{self.role}:{self.name}"

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def owns(self, tenant: str) -> bool:
        """May this caller see and act on the leases of `tenant`?"""
        return self.role != "tenant" or self.tenant == tenant

    def check_node(self, node: str, doing: str) -> None:
        """Refuse, saying why, unless this caller may act for `node` (an admin, or the agent
        token made for it): one node's agent must never speak for another."""
        if self.role == "admin":
            return
        if self.role != "agent":
            raise Forbidden(f"a {self.role} token cannot {doing}")
        if self.node != node:
            raise Forbidden(
                f"this agent token acts for node {self.node!r} only: it cannot {doing} "
                f"for node {node!r}"
            )


UNBOUND_AGENT = (
    "this agent token names no node (it was made before agent tokens were bound to one node) "
    "and is refused: make one per node with `gpupool token create NODE --role agent --node "
    "NODE` (or a join token: `gpupool token create NAME --role join --max-nodes N`), give it "
    "to that node's agent, and revoke this one"
)
"""Why an agent token of an older database is refused: no row says which node it served,
and binding it to whichever node registers first would let one stolen token pick a node."""


def refuse_unbound(principal: Principal) -> None:
    if principal.role == "agent" and principal.node is None:
        raise Forbidden(UNBOUND_AGENT)


def token_out(row: TokenRow) -> TokenOut:
    return TokenOut(
        id=row.id,
        name=row.name,
        role=row.role,
        tenant=row.tenant,
        created_at=row.created_at,
        created_by=row.created_by,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
        node=row.node,
        joins_left=row.joins_left,
    )


# ---- verification ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Entry:
    principal: Principal
    secret_sha256: str
    expires_at: datetime | None
    checked_at: float


class TokenCache:
    """Verified token rows by id, each trusted for `CACHE_S` seconds."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def get(self, token_id: str) -> _Entry | None:
        entry = self._entries.get(token_id)
        if entry is None or time.monotonic() - entry.checked_at > CACHE_S:
            return None
        return entry

    def put(self, row: TokenRow) -> _Entry:
        entry = _Entry(
            principal=Principal(
                row.id,
                row.name,
                row.role,  # type: ignore[arg-type]
                row.tenant,
                row.node if row.role == "agent" else None,
            ),
            secret_sha256=row.secret_sha256,
            expires_at=row.expires_at,
            checked_at=time.monotonic(),
        )
        self._entries[row.id] = entry
        return entry

    def drop(self, token_id: str) -> None:
        self._entries.pop(token_id, None)


def lookup(session: Session, token_id: str) -> TokenRow | None:
    """The live row of a token id (not revoked), for the cache to hold."""
    row = session.get(TokenRow, token_id)
    if row is None or row.revoked_at is not None:
        return None
    session.expunge(row)
    return row


def check(entry: _Entry | None, secret: str) -> Principal:
    """The principal of a token whose row is `entry`; raises Unauthenticated otherwise."""
    if entry is None or not hmac.compare_digest(entry.secret_sha256, digest(secret)):
        raise Unauthenticated("the token is not valid (unknown, revoked or mistyped)")
    if entry.expires_at is not None and entry.expires_at <= utcnow():
        raise Unauthenticated(f"the token expired at {entry.expires_at.isoformat()}")
    return entry.principal


# ---- management (admin) ------------------------------------------------------------------


def _check_scope(session: Session, body: TokenCreate) -> None:
    """Each role's scope: a tenant for tenant tokens, a node for agent tokens, a number of new
    nodes for join tokens, and nothing for the pool-wide roles."""
    if body.role == "tenant":
        if body.tenant is None:
            raise InvalidRequest("a tenant token needs --tenant: the tenant it acts for")
        if (found := session.get(TenantRow, body.tenant)) is None or found.deleted_at is not None:
            raise NotFound(f"no tenant {body.tenant!r}")
    elif body.tenant is not None:
        raise InvalidRequest(f"a {body.role} token acts for no one tenant: leave out the tenant")
    if body.role == "agent" and body.node is None:
        raise InvalidRequest(
            "an agent token acts for one node: give --node NAME (the name its agent registers), "
            "or make a join token (--role join) that agents of new nodes trade for their own"
        )
    if body.role != "agent" and body.node is not None:
        raise InvalidRequest(f"only an agent token names a node, not a {body.role} token")
    if body.role != "join" and body.max_nodes is not None:
        raise InvalidRequest(f"only a join token has --max-nodes, not a {body.role} token")


def create(session: Session, body: TokenCreate, actor: str) -> TokenCreated:
    _check_scope(session, body)
    token_id, secret, token = new_token()
    expires = utcnow() + timedelta(seconds=body.expires_in_s) if body.expires_in_s else None
    row = TokenRow(
        id=token_id,
        name=body.name,
        role=body.role,
        tenant=body.tenant,
        node=body.node,
        joins_left=(body.max_nodes or 1) if body.role == "join" else None,
        secret_sha256=digest(secret),
        created_at=utcnow(),
        created_by=actor,
        expires_at=expires,
    )
    session.add(row)
    if body.tenant:
        scope = f" for tenant {body.tenant}"
    elif body.node:
        scope = f" for node {body.node}"
    elif body.role == "join":
        scope = f" for at most {row.joins_left} new node(s)"
    else:
        scope = ""
    record(session, actor, "token.created", token_id, f"{body.role} token {body.name!r}{scope}")
    return TokenCreated(**token_out(row).model_dump(), token=token)


def live_node_tokens(session: Session, node: str) -> list[TokenRow]:
    """The agent tokens that act for `node` now (neither revoked nor expired)."""
    now = utcnow()
    rows = session.scalars(
        select(TokenRow).where(
            TokenRow.role == "agent", TokenRow.node == node, TokenRow.revoked_at.is_(None)
        )
    )
    return [r for r in rows if r.expires_at is None or r.expires_at > now]


def join(session: Session, joiner: Principal, node: str) -> TokenCreated:
    """Trade a join token for an agent token of a new node, once per node.

    A node that has a live agent token already is refused: otherwise whoever holds the join
    token could take over any node by joining it again. An operator whose node lost its
    credential revokes the old token first, which the answer says.
    """
    if joiner.role != "join":
        raise Forbidden(f"a {joiner.role} token cannot join nodes (needs a join token)")
    row = session.get(TokenRow, joiner.token_id)
    if row is None or row.revoked_at is not None:
        raise Unauthenticated("the join token is not valid (unknown or revoked)")
    if row.expires_at is not None and row.expires_at <= utcnow():
        raise Unauthenticated(f"the join token expired at {row.expires_at.isoformat()}")
    if (row.joins_left or 0) <= 0:
        raise Forbidden(
            f"join token {row.id} ({row.name}) has joined all the nodes it may: make a new one "
            "with `gpupool token create NAME --role join --max-nodes N`"
        )
    held = live_node_tokens(session, node)
    if held:
        ids = ", ".join(r.id for r in held)
        raise Conflict(
            f"node {node} has an agent token already ({ids}): a join token joins new nodes only. "
            "If this node lost its token, revoke it (`gpupool token revoke ID`) and join again"
        )
    row.joins_left = (row.joins_left or 0) - 1
    made = create(
        session,
        TokenCreate(name=node, role="agent", node=node, expires_in_s=None),
        joiner.actor,
    )
    record(
        session,
        joiner.actor,
        "node.joined",
        node,
        f"agent token {made.id} made for node {node} by join token {row.id} "
        f"({row.joins_left} join(s) left)",
    )
    return made


def list_tokens(session: Session, include_revoked: bool) -> list[TokenOut]:
    query = select(TokenRow).order_by(TokenRow.created_at, TokenRow.id)
    if not include_revoked:
        query = query.where(TokenRow.revoked_at.is_(None))
    return [token_out(r) for r in session.scalars(query)]


def revoke(session: Session, token_id: str, actor: Principal) -> TokenOut:
    row = session.get(TokenRow, token_id)
    if row is None:
        raise NotFound(f"no token {token_id!r}")
    if row.revoked_at is not None:
        raise Conflict(f"token {token_id} was revoked already at {row.revoked_at.isoformat()}")
    if row.role == "admin" and _live_admins(session) <= 1:
        raise Conflict("this is the last admin token: create another admin token first")
    if token_id == actor.token_id:
        log.warning("%s revokes its own token", actor.actor)
    row.revoked_at = utcnow()
    record(session, actor.actor, "token.revoked", token_id, f"{row.role} token {row.name!r}")
    return token_out(row)


def drop_tenant_tokens(session: Session, tenant: str, actor: str) -> int:
    """Delete a tenant's tokens with the tenant: they could never be used again."""
    rows = list(session.scalars(select(TokenRow).where(TokenRow.tenant == tenant)))
    for row in rows:
        session.delete(row)
    if rows:
        record(session, actor, "token.deleted", tenant, f"{len(rows)} token(s) of the tenant")
    return len(rows)


def _live_admins(session: Session) -> int:
    now = utcnow()
    rows = session.scalars(
        select(TokenRow).where(TokenRow.role == "admin", TokenRow.revoked_at.is_(None))
    )
    return sum(1 for r in rows if r.expires_at is None or r.expires_at > now)


# ---- the first admin ---------------------------------------------------------------------


def bootstrap(session: Session, data_dir: Path, given: str | None) -> str | None:
    """Make sure an admin can get in; returns where a new admin token was written, if any.

    `given` (from $GPUPOOL_ADMIN_TOKEN or --admin-token-file) is installed as an admin token,
    which is how deployments hand the controller a secret they already keep. Otherwise, on the
    very first start (no admin token at all), one is made and written to
    `<data_dir>/admin.token`, readable by its owner only.
    """
    if given is not None:
        parts = split(given.strip())
        if parts is None:
            raise InvalidRequest(
                "the given admin token is malformed: it must read gpp_<12 hex digits>_<secret>; "
                "make one with `gpupool token new`"
            )
        token_id, secret = parts
        row = session.get(TokenRow, token_id)
        if row is None:
            session.add(_admin_row(token_id, secret, "bootstrap"))
            record(session, "controller", "token.created", token_id, "admin token given at start")
        elif row.role != "admin" or row.secret_sha256 != digest(secret):
            raise Forbidden(
                f"the given admin token's id {token_id} belongs to another token; "
                "give a new token, not a changed one"
            )
        elif row.revoked_at is not None:
            raise Forbidden(f"the given admin token {token_id} was revoked; give a new one")
        return None
    if _live_admins(session) > 0:
        return None
    token_id, secret, token = new_token()
    session.add(_admin_row(token_id, secret, "first-admin"))
    record(session, "controller", "token.created", token_id, "first admin token")
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / ADMIN_TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    os.chmod(path, 0o600)
    return str(path)


def _admin_row(token_id: str, secret: str, name: str) -> TokenRow:
    """An admin token the controller itself installs (given at start, or the first one)."""
    return TokenRow(
        id=token_id,
        name=name,
        role="admin",
        tenant=None,
        secret_sha256=digest(secret),
        created_at=utcnow(),
        created_by="controller",
    )
