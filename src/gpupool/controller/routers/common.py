"""What every router needs: the store, and who is calling with which rights."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Path, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gpupool.controller.services import auth
from gpupool.controller.services.auth import Principal
from gpupool.controller.store import Store
from gpupool.core import Forbidden, Unauthenticated
from gpupool.protocol.v1.api import Role
from gpupool.protocol.v1.tokens import split

SESSION_COOKIE = "gpupool_session"
CSRF_HEADER = "X-Gpupool-Csrf"
"""Writes authenticated by the dashboard's cookie must carry this header: a page of another
site can make a browser send the cookie, but cannot add a header without CORS consent."""

NO_NUL = r"^[^\x00]*$"
"""Names in paths and filters are looked up in the database, which cannot hold NUL."""

Key = Annotated[str, Path(min_length=1, max_length=128, pattern=NO_NUL)]
"""A lease id, GPU UUID, node or tenant name in a path: as long as the columns they live in."""

Filter = Annotated[str | None, Query(max_length=128, pattern=NO_NUL)]
"""An optional filter on a listing, compared with a column of at most 128 characters."""

_bearer = HTTPBearer(auto_error=False, description="an API token: gpp_<id>_<secret>")
_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})


async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def authenticate(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> Principal:
    """The caller of this request, from its bearer token or the dashboard's session cookie."""
    cached = request.scope.get("gpupool.principal")
    if isinstance(cached, Principal):
        return cached
    if credentials is not None:
        token = credentials.credentials
    else:
        token = request.cookies.get(SESSION_COOKIE, "")
        if not token:
            raise Unauthenticated(
                "this call needs a token: send 'Authorization: Bearer <token>' "
                "(CLI: --token or GPUPOOL_TOKEN)"
            )
        if request.method not in _SAFE and CSRF_HEADER.lower() not in request.headers:
            raise Forbidden(f"a write signed in by cookie needs the {CSRF_HEADER} header")
    principal = await verify(request, token)
    request.scope["gpupool.principal"] = principal
    return principal


async def verify(request: Request, token: str) -> Principal:
    parts = split(token)
    if parts is None:
        raise Unauthenticated("the token is malformed: it reads gpp_<id>_<secret>")
    token_id, secret = parts
    cache: auth.TokenCache = request.app.state.tokens
    entry = cache.get(token_id)
    if entry is None:
        store: Store = request.app.state.store
        row = await store.read(lambda s: auth.lookup(s, token_id))
        entry = cache.put(row) if row is not None else None
    return auth.check(entry, secret)


def allow(*roles: Role) -> Callable[..., Awaitable[Principal]]:
    """A dependency that admits the given roles and refuses the others with a reason."""
    allowed = frozenset(roles)
    names = ", ".join(sorted(allowed))

    async def dependency(principal: Principal = Depends(authenticate)) -> Principal:
        auth.refuse_unbound(principal)
        if principal.role not in allowed:
            raise Forbidden(f"a {principal.role} token cannot do this (needs: {names})")
        return principal

    return dependency


EVERYONE = allow("admin", "viewer", "agent", "tenant", "join", "scheduler")
"""Only for asking who one is: a join token does nothing else, so its agent can tell it."""
ANYONE = allow("admin", "viewer", "agent", "tenant")
READERS = allow("admin", "viewer", "tenant")
OPERATORS = allow("admin", "viewer")
"""Pool-wide views (events, dashboard, history): operators' business, not tenants'."""
ADMIN = allow("admin")
AGENTS = allow("admin", "agent")
"""Node calls: an agent token may make them for its own node only (Principal.check_node)."""
SCHEDULERS = allow("admin", "scheduler")
"""The Kubernetes extender's calls: placement, and claims on any node."""
JOINERS = allow("join")
HOLDERS = allow("admin", "tenant")
