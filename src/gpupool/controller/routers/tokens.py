"""Routes of /tokens (admins manage API tokens), /whoami and the dashboard's /session."""

from __future__ import annotations

import re

from fastapi import APIRouter, Depends, Query, Request, Response, status

from gpupool.controller.routers.common import (
    ADMIN,
    EVERYONE,
    JOINERS,
    SESSION_COOKIE,
    Key,
    get_store,
    verify,
)
from gpupool.controller.services import auth
from gpupool.controller.services.auth import Principal
from gpupool.controller.store import Store
from gpupool.core import InvalidRequest
from gpupool.protocol.v1.api import (
    NODE_NAME,
    SessionCreate,
    TokenCreate,
    TokenCreated,
    TokenOut,
    WhoAmI,
)

NODE_NAME_RE = re.compile(NODE_NAME)

router = APIRouter(tags=["tokens"])


@router.post("/tokens", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
async def create_token(
    body: TokenCreate, store: Store = Depends(get_store), who: Principal = Depends(ADMIN)
) -> TokenCreated:
    """The answer holds the token's secret; it is shown this once and never stored."""
    return await store.write(lambda s: auth.create(s, body, who.actor))


@router.get("/tokens", response_model=list[TokenOut])
async def list_tokens(
    include_revoked: bool = Query(default=False, alias="all"),
    store: Store = Depends(get_store),
    _who: Principal = Depends(ADMIN),
) -> list[TokenOut]:
    return await store.read(lambda s: auth.list_tokens(s, include_revoked))


@router.delete("/tokens/{token_id}", response_model=TokenOut)
async def revoke_token(
    token_id: str,
    request: Request,
    store: Store = Depends(get_store),
    who: Principal = Depends(ADMIN),
) -> TokenOut:
    out = await store.write(lambda s: auth.revoke(s, token_id, who))
    cache: auth.TokenCache = request.app.state.tokens
    cache.drop(token_id)
    return out


@router.post("/nodes/{name}/join", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
async def join_node(
    name: Key, store: Store = Depends(get_store), who: Principal = Depends(JOINERS)
) -> TokenCreated:
    """A join token's one call: an agent token for the new node `name`, shown this once."""
    if not NODE_NAME_RE.match(name):
        raise InvalidRequest(f"node name {name!r} must be letters, digits, '.', '_' or '-'")
    return await store.write(lambda s: auth.join(s, who, name))


@router.get("/whoami", response_model=WhoAmI)
async def whoami(who: Principal = Depends(EVERYONE)) -> WhoAmI:
    return WhoAmI(
        token_id=who.token_id,
        name=who.name,
        role=who.role,
        tenant=who.tenant,
        node=who.node,
        actor=who.actor,
    )


@router.post("/session", response_model=WhoAmI)
async def sign_in(body: SessionCreate, request: Request, response: Response) -> WhoAmI:
    """The dashboard's sign-in: checks the token and keeps it in an HttpOnly cookie, so page
    scripts never hold it; SameSite=Strict keeps other sites from sending it."""
    who = await verify(request, body.token.strip())
    response.set_cookie(
        SESSION_COOKIE,
        body.token.strip(),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
        max_age=12 * 3600,
    )
    return WhoAmI(
        token_id=who.token_id,
        name=who.name,
        role=who.role,
        tenant=who.tenant,
        node=who.node,
        actor=who.actor,
    )


@router.delete("/session", status_code=status.HTTP_204_NO_CONTENT)
async def sign_out() -> Response:
    response = Response(status_code=status.HTTP_204_NO_CONTENT)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response
