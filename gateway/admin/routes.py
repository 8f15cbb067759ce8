"""The admin API under /admin: issue, list, show, update, revoke and rotate API keys; read their usage and the
audit log. Every change is recorded in the audit log (gateway/admin/audit.py) with who made it.

Every route needs an admin JWT (gateway/admin/auth.py), checked before anything in the request is read;
`viewer` tokens may only read (GET). A key's secret is in exactly one response, the one that creates (or
rotates) it. Listings show ids, names and policies, never secrets or hashes. The OpenAPI document at /schema
describes every answer, errors included (gateway/openapi.py).
"""

from __future__ import annotations

from typing import Protocol

import orjson
from litestar import Response, Router, get, patch, post, route
from litestar.enums import HttpMethod
from litestar.handlers import BaseRouteHandler, HTTPRouteHandler
from litestar.params import JSONBody, Parameter

from gateway.admin.audit import audit_handlers
from gateway.admin.auth import AdminAuth
from gateway.admin.live import Live, live_handlers
from gateway.admin.keys import (
    IssuedKey,
    KeyAdmin,
    KeyChanges,
    KeyView,
    NewKey,
    Rotation,
    Usage,
)
from gateway.admin.scope import check_route, own_team, remember
from policies.json_depth import json_too_deep, too_deep
from gateway.http.asgi import AnyConnection, AnyRequest
from gateway.openapi import ADMIN_SECURITY, OptionalBody, errors
from gateway.admin.report import Reporting, report_handlers
from gateway.admin.teams import Accounts, team_handlers
from gateway.admin.variants import Weighing, variant_handlers
from policies.errors import BadRequest, PermissionDenied
from policies.keys import TEAM_NAME

KeyId = Parameter(pattern=r"^[0-9a-f]{16}$", description="the key's public id")
TeamFilter = Parameter(default=None, pattern=TEAM_NAME, description="only the keys of this team")


READS = ("GET", "HEAD", "OPTIONS")


class Administered(Live, Reporting, Weighing, Accounts, Protocol):
    """The admin API: the check of its tokens, and what its routes ask (keys and teams, the live policy and
    replicas, the report and budgets, variant weights, the audit log)."""

    admin_auth: AdminAuth


def admin_router(gateway: Administered) -> Router:
    async def admin_token(connection: AnyConnection, _handler: BaseRouteHandler) -> None:
        """A guard: runs before the path and body are parsed, so a caller without a token learns nothing. The
        verified claims stay in the scope (ADMIN_CLAIMS): the audit log's actor, and a team admin's team."""
        write = connection.scope["method"] not in READS  # type: ignore[typeddict-item]  # HTTP only: no websockets
        opt = _handler.opt
        claims = await gateway.admin_auth.check(connection.headers.get("authorization"), write,
                                                opt.get("operator", False), opt.get("team", False))
        remember(connection, claims)
        check_route(connection, opt.get("team", False))

    keys = KeyAdmin(gateway)

    @post("/keys", status_code=201, summary="Issue a key (its secret is shown only in this response)",
          opt={"team": True}, responses=errors(400, 401, 403, 404, 409, 413, 503))
    async def create_key(request: AnyRequest, data: JSONBody[NewKey]) -> IssuedKey:
        return await keys.create(request, data)

    @get("/keys", summary="List keys (never their secrets)", opt={"team": True}, responses=errors(400, 401, 403, 503))
    async def list_keys(request: AnyRequest, team: str | None = TeamFilter) -> list[KeyView]:
        own = own_team(request)
        if own is not None:
            if team not in (None, own):
                raise PermissionDenied(f"this admin token lists keys of team {own} only", code="other_team")
            team = own
        return await keys.listing(team)

    @get("/keys/{key_id:str}", summary="Show one key", opt={"team": True}, responses=errors(400, 401, 403, 404, 503))
    async def show_key(request: AnyRequest, key_id: str = KeyId) -> KeyView:
        return KeyView.of(await keys.load(key_id, request))

    @patch("/keys/{key_id:str}", summary="Change a key's name, team, models, expiry, data policy, networks, limits or"
           " priority class", opt={"team": True}, responses=errors(400, 401, 403, 404, 409, 413, 503))
    async def update_key(request: AnyRequest, data: JSONBody[KeyChanges], key_id: str = KeyId) -> KeyView:
        return await keys.update(request, key_id, data)

    @post("/keys/{key_id:str}/revoke", status_code=200,
          summary="Revoke a key; every replica refuses it within auth.cache_seconds",
          opt={"team": True}, responses=errors(400, 401, 403, 404, 503))
    async def revoke_key(request: AnyRequest, key_id: str = KeyId) -> KeyView:
        return await keys.revoke(request, key_id)

    @post("/keys/{key_id:str}/rotate", status_code=200, summary="New secret; the old one works for grace_seconds",
          description="The body may be left out: the old secret then works for another hour.",
          operation_class=OptionalBody, opt={"team": True}, responses=errors(400, 401, 403, 404, 413, 503))
    async def rotate_key(request: AnyRequest, key_id: str = KeyId,
                         data: JSONBody[Rotation | None] = None) -> IssuedKey:
        return await keys.rotate(request, key_id, data)

    @get("/keys/{key_id:str}/usage", summary="Requests and tokens used by a key, per model",
         opt={"team": True}, responses=errors(400, 401, 403, 404, 503))
    async def key_usage(request: AnyRequest, key_id: str = KeyId) -> Usage:
        return await keys.usage(key_id, request)

    handlers = [create_key, list_keys, show_key, update_key, revoke_key, rotate_key, key_usage,
                *live_handlers(gateway), *report_handlers(gateway, KeyId, keys.load), *variant_handlers(gateway),
                *team_handlers(gateway), *audit_handlers(gateway)]
    return Router(
        path="/admin",
        route_handlers=[*options_handlers(handlers), *handlers],  # OPTIONS first, or Litestar adds its own
        tags=["admin"],
        guards=[admin_token],
        before_request=bounded_json,  # runs after the guard: nothing is read before the token is checked
        security=[{ADMIN_SECURITY: []}],
    )


async def bounded_json(request: AnyRequest) -> None:
    """Every admin route's before_request: a body that nests past MAX_JSON_DEPTH is a 400 naming the bound before
    the handler's body is decoded (Litestar's decoder recurses, and a body 100k levels deep was a 500). orjson
    reads it here without recursing in Python; a body that is not JSON is left to the route's own decoding."""
    if request.method in READS:
        return
    raw = await request.body()  # within the app's body limit; Litestar keeps it for the handler
    if not raw:
        return
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if exc.msg != "depth limit exceeded":  # orjson's own bound (1024 levels), well past ours
            return
    else:
        if not too_deep(value):
            return
    raise BadRequest(json_too_deep("the request body"), code="json_too_deep")


def options_handlers(handlers: list[HTTPRouteHandler]) -> list[HTTPRouteHandler]:
    """OPTIONS for each path, answering with an Allow header that lists every method the path serves.

    Litestar makes one itself, but when a router registers a path's handlers one at a time its Allow header
    keeps only the methods registered first (GET /keys and POST /keys would answer `Allow: OPTIONS, POST`).
    These must be registered before the handlers they describe, or Litestar's own stays in place.
    """
    methods: dict[str, set[str]] = {}
    for handler in handlers:
        for path in handler.paths:
            methods.setdefault(path, {"OPTIONS"}).update(handler.http_methods)
    return [allow_handler(path, ", ".join(sorted(allowed))) for path, allowed in methods.items()]


def allow_handler(path: str, allow: str) -> HTTPRouteHandler:
    @route(path, http_method=[HttpMethod.OPTIONS], include_in_schema=False, sync_to_thread=False,
           name=f"options {path}")
    def options() -> Response[None]:
        return Response(None, status_code=204, headers={"allow": allow})

    return options
