"""The admin API under /admin: issue, list, show, update, revoke and rotate API keys; read their usage.

Every route needs an admin JWT (gateway/admin_auth.py), checked before anything in the request is read;
`viewer` tokens may only read (GET). A key's secret is in exactly one response, the one that creates (or
rotates) it. Listings show ids, names and policies, never secrets or hashes. The OpenAPI document at /schema
describes every answer, errors included (gateway/openapi.py).
"""

from __future__ import annotations

import time
from typing import Annotated

from litestar import Request, Response, Router, get, patch, post, route
from litestar.connection import ASGIConnection
from litestar.enums import HttpMethod
from litestar.params import JSONBody, KwargDefinition, Parameter
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.admin_live import live_handlers
from gateway.admin_scope import check_key, check_route, own_team, remember
from gateway.openapi import ADMIN_SECURITY, OptionalBody, errors
from gateway.report_routes import report_handlers
from gateway.team_routes import TeamName, team_handlers
from gateway.variant_routes import variant_handlers
from policies.accounting import by_model, totals
from policies.errors import Conflict, NotFound, PermissionDenied, StateUnavailable
from policies.keys import (
    CIDR_PATTERN,
    CLASS_NAME,
    TEAM_NAME,
    DataPolicy,
    KeyBudget,
    KeyLimits,
    KeyRecord,
    hash_key,
    new_key,
    new_key_id,
    normalize_cidrs,
)
from policies.store import KeyExists, KeyNotFound
from policies.teams import key_problems

KeyId = Parameter(pattern=r"^[0-9a-f]{16}$", description="the key's public id")
TeamFilter = Parameter(default=None, pattern=TEAM_NAME, description="only the keys of this team")


READS = ("GET", "HEAD", "OPTIONS")
CREATE_ATTEMPTS = 5  # ids tried for one new key
# The pattern is for the document; the validator below checks the same form with a readable message.
Cidr = Annotated[str, KwargDefinition(pattern=CIDR_PATTERN,
                                      description="a network, e.g. 10.0.0.0/8 or 2001:db8::/32")]
# The key record checks the form (a 400 naming the field); the pattern here is for the document.
ClassName = Annotated[str, KwargDefinition(pattern=CLASS_NAME, description="a priority class, e.g. batch")]


class KeyChanges(BaseModel):
    """A PATCH: only the fields sent change. null means the default: no owner, every model, no expiry,
    private_only, any network, no limits."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(None, min_length=1, max_length=200)  # a key always has a name: null is not one
    owner: str | None = Field(None, max_length=200)
    team: TeamName | None = Field(None, description="the team the key belongs to (it may only narrow what the"
                                  " team allows); null for none. A team admin's keys are always in its team")
    models: list[str] | None = Field(None, description="models the key may use; omit or null for all (in a team:"
                                     " all of the team's)")
    expires_at: float | None = Field(None, description="unix seconds after which the key stops working")
    data_policy: DataPolicy | None = None
    allowed_cidrs: list[Cidr] | None = Field(None, description="client networks (CIDR) the key may be used from;"
                                            " omit or null for any")
    limits: KeyLimits | None = None
    priority_class: ClassName | None = Field(None, description="the key's priority class (the"
                                       " policy's priorities.classes; a name it does not declare is served as its"
                                       " default); null for the default (interactive)")
    client_priority: bool | None = Field(None, description="whether its clients may pick a class by header and"
                                         " send vLLM's `priority` field; null: no")
    budget: KeyBudget | None = Field(None, description="rented spend and tokens per period; null for none")

    @field_validator("allowed_cidrs")
    @classmethod
    def valid_cidrs(cls, cidrs: list[str] | None) -> list[str] | None:
        return normalize_cidrs(cidrs, strict_form=True)


class NewKey(KeyChanges):
    name: str = Field(min_length=1, max_length=200)
    expires_in: float | None = Field(None, gt=0, description="seconds from now; alternative to expires_at",
                                     json_schema_extra={"exclusive_minimum": 0})  # Litestar drops a bound of 0


class Rotation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grace_seconds: float = Field(3600, ge=0, le=90 * 86400, description="how long the old secret keeps working")


class KeyView(BaseModel):
    model_config = ConfigDict(extra="forbid")  # documented as closed: a hash can never slip into a listing
    id: str
    name: str
    owner: str | None
    team: str | None
    models: list[str] | None
    expires_at: float | None
    revoked: bool
    data_policy: str
    allowed_cidrs: list[str] | None
    limits: KeyLimits
    priority_class: str | None
    client_priority: bool
    budget: KeyBudget | None
    created_at: float
    last_used_at: float | None
    previous_valid_until: float | None = Field(description="while set and in the future, the pre-rotation secret works")

    @classmethod
    def of(cls, record: KeyRecord) -> KeyView:
        data = record.model_dump(exclude={"hash", "previous_hash"})
        return cls(**data)


class IssuedKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str = Field(description="the API key; shown only in this response")
    record: KeyView


class Usage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    models: dict[str, dict[str, int]]
    variants: dict[str, dict[str, dict[str, int]]] = Field(
        default_factory=dict, description="for each model with variants, its usage per variant (also in `models`)")
    total: dict[str, int]


def admin_router(gateway) -> Router:
    store = gateway.store

    def admin_token(connection: ASGIConnection, _handler) -> None:
        """A guard: runs before the path and body are parsed, so a caller without a token learns nothing."""
        write = connection.scope["method"] not in READS
        remember(connection, gateway.admin_auth.check(connection.headers.get("authorization"), write,
                                                      _handler.opt.get("operator", False)))
        check_route(connection, _handler.opt.get("team", False))

    async def load(key_id: str, connection: ASGIConnection) -> KeyRecord:
        """The key, if this token may manage it (a team admin: only its team's)."""
        record = await store.get_key(key_id)
        if record is None:
            raise NotFound(f"no API key with id {key_id}", code="key_not_found")
        check_key(connection, record)
        return record

    async def fits_team(record: KeyRecord) -> None:
        """409 naming every way the key would allow more than its team as it stands (404: no such team)."""
        if record.team is None:
            return
        team = await store.get_team(record.team)
        if team is None:
            raise NotFound(f"no team named {record.team}", param="team", code="team_not_found")
        problems = key_problems(record, team)
        if problems:
            raise Conflict(f"a key may only narrow what its team allows: {'; '.join(t for _, t in problems)}",
                             param=problems[0][0], code="exceeds_team")

    async def save(record: KeyRecord) -> KeyView:
        try:
            await store.put_key(record)
        except KeyNotFound:
            raise NotFound(f"no API key with id {record.id}", code="key_not_found") from None
        await gateway.forget_key(record.id)
        return KeyView.of(record)

    @post("/keys", status_code=201, summary="Issue a key (its secret is shown only in this response)",
          opt={"team": True}, responses=errors(400, 401, 403, 404, 409, 413, 503))
    async def create_key(request: Request, data: JSONBody[NewKey]) -> IssuedKey:
        fields = data.model_dump(exclude={"expires_in"}, exclude_none=True)
        if data.expires_in is not None:
            fields["expires_at"] = time.time() + data.expires_in
        team = own_team(request)
        if team is not None:  # a team admin's keys are its team's
            if data.team not in (None, team):
                raise PermissionDenied(f"this admin token issues keys of team {team} only", code="other_team")
            fields["team"] = team
        for attempt in range(CREATE_ATTEMPTS):  # a taken id (1 in 2**64 per key issued) gets a fresh one
            key_id = new_key_id()
            key = new_key(key_id)
            record = KeyRecord(id=key_id, created_at=time.time(), hash=hash_key(key), **fields)
            if attempt == 0:
                await fits_team(record)
            try:
                await store.create_key(record)
            except KeyExists:
                continue
            return IssuedKey(key=key, record=KeyView.of(record))
        raise StateUnavailable(f"no free key id in {CREATE_ATTEMPTS} tries; try again")

    @get("/keys", summary="List keys (never their secrets)", opt={"team": True}, responses=errors(400, 401, 403, 503))
    async def list_keys(request: Request, team: str | None = TeamFilter) -> list[KeyView]:
        own = own_team(request)
        if own is not None:
            if team not in (None, own):
                raise PermissionDenied(f"this admin token lists keys of team {own} only", code="other_team")
            team = own
        return [KeyView.of(r) for r in await store.list_keys() if team is None or r.team == team]

    @get("/keys/{key_id:str}", summary="Show one key", opt={"team": True}, responses=errors(400, 401, 403, 404, 503))
    async def show_key(request: Request, key_id: str = KeyId) -> KeyView:
        return KeyView.of(await load(key_id, request))

    @patch("/keys/{key_id:str}", summary="Change a key's name, team, models, expiry, data policy, networks, limits or"
           " priority class", opt={"team": True}, responses=errors(400, 401, 403, 404, 409, 413, 503))
    async def update_key(request: Request, data: JSONBody[KeyChanges], key_id: str = KeyId) -> KeyView:
        record = await load(key_id, request)
        changes = data.model_dump(exclude_unset=True)
        own = own_team(request)
        if own is not None and changes.get("team", own) != own:
            raise PermissionDenied(f"a team admin cannot move keys out of team {own}", code="other_team")
        for field in ("data_policy", "limits", "client_priority"):  # null: back to the default, as when the key was issued
            if field in changes and changes[field] is None:
                changes[field] = KeyRecord.model_fields[field].get_default()
        if isinstance(changes.get("limits"), dict):  # only the limits sent change (one sent as null: unlimited)
            changes["limits"] = {**record.limits.model_dump(), **changes["limits"]}
        changed = KeyRecord.model_validate({**record.model_dump(), **changes})
        await fits_team(changed)
        return await save(changed)

    @post("/keys/{key_id:str}/revoke", status_code=200,
          summary="Revoke a key; every replica refuses it within auth.cache_seconds",
          opt={"team": True}, responses=errors(400, 401, 403, 404, 503))
    async def revoke_key(request: Request, key_id: str = KeyId) -> KeyView:
        record = await load(key_id, request)
        return await save(record.model_copy(update={"revoked": True, "previous_hash": None,
                                                    "previous_valid_until": None}))

    @post("/keys/{key_id:str}/rotate", status_code=200, summary="New secret; the old one works for grace_seconds",
          description="The body may be left out: the old secret then works for another hour.",
          operation_class=OptionalBody, opt={"team": True}, responses=errors(400, 401, 403, 404, 413, 503))
    async def rotate_key(request: Request, key_id: str = KeyId, data: JSONBody[Rotation | None] = None) -> IssuedKey:
        record = await load(key_id, request)
        grace = (data or Rotation()).grace_seconds
        key = new_key(key_id)
        rotated = record.model_copy(update={"hash": hash_key(key), "previous_hash": record.hash,
                                            "previous_valid_until": time.time() + grace})
        return IssuedKey(key=key, record=await save(rotated))

    @get("/keys/{key_id:str}/usage", summary="Requests and tokens used by a key, per model",
         opt={"team": True}, responses=errors(400, 401, 403, 404, 503))
    async def key_usage(request: Request, key_id: str = KeyId) -> Usage:
        await load(key_id, request)
        await gateway.record_usage.flush()  # this replica's last quarter second, so a read follows its writes
        models, variants = by_model(await store.usage(key_id))
        return Usage(id=key_id, models=models, variants=variants, total=totals(models))

    handlers = [create_key, list_keys, show_key, update_key, revoke_key, rotate_key, key_usage,
                *live_handlers(gateway), *report_handlers(gateway, KeyId, load), *variant_handlers(gateway),
                *team_handlers(gateway)]
    return Router(
        path="/admin",
        route_handlers=[*options_handlers(handlers), *handlers],  # OPTIONS first, or Litestar adds its own
        tags=["admin"],
        guards=[admin_token],
        security=[{ADMIN_SECURITY: []}],
    )


def options_handlers(handlers) -> list:
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


def allow_handler(path: str, allow: str):
    @route(path, http_method=[HttpMethod.OPTIONS], include_in_schema=False, sync_to_thread=False,
           name=f"options {path}")
    def options() -> Response:
        return Response(None, status_code=204, headers={"allow": allow})

    return options
