"""What an admin does to API keys, whichever door it comes through: the admin API (gateway/admin/routes.py)
and the console (gateway/console/) call these, so a key issued, changed, rotated or revoked in one is exactly
what the other would have done. The request and answer models are the admin API's documented shapes.

Each change is recorded in the audit log (gateway/admin/audit.py) here, whichever door it came through: the
caller passes its connection, whose scope holds the verified claims of the admin acting (ADMIN_CLAIMS). A team
admin's token (gateway/admin/scope.py) reaches only its own team's keys, and a key in a team may only narrow
what the team allows (policies/teams.py): 409 naming each excess, nothing stored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from litestar.params import KwargDefinition
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.admin.scope import check_key, own_team
from gateway.http.asgi import AnyConnection
from gateway.admin.teams import ClassName, ManagesKeys, TeamName
from policies.accounting import by_model, totals
from policies.audit import diff
from policies.errors import Conflict, NotFound, PermissionDenied, StateUnavailable
from policies.keys import (
    CIDR_PATTERN,
    DataPolicy,
    KeyBudget,
    KeyLimits,
    KeyRecord,
    hash_key,
    new_key,
    new_key_id,
    normalize_cidrs,
)
from policies.priority import class_order
from policies.store import KeyExists, KeyNotFound
from policies.teams import key_problems

CREATE_ATTEMPTS = 5  # ids tried for one new key
# The pattern is for the document; the validator below checks the same form with a readable message.
Cidr = Annotated[str, KwargDefinition(pattern=CIDR_PATTERN,
                                      description="a network, e.g. 10.0.0.0/8 or 2001:db8::/32")]


class KeyChanges(BaseModel):
    """A PATCH: only the fields sent change. null means the default: no owner, every model, no expiry,
    private_only, any network, no limits."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(None, min_length=1, max_length=200)  # type: ignore[assignment]  # absent: unchanged; null is refused
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


class KeyAdmin:
    """The key operations over one gateway's store; each change drops the key from every replica's cache."""

    def __init__(self, gateway: ManagesKeys) -> None:
        self.gateway = gateway
        self.store = gateway.store

    async def load(self, key_id: str, connection: AnyConnection | None = None) -> KeyRecord:
        """The key, if the admin on `connection` may manage it (a team admin: only its team's)."""
        record = await self.store.get_key(key_id)
        if record is None:
            raise NotFound(f"no API key with id {key_id}", code="key_not_found")
        if connection is not None:
            check_key(connection, record)
        return record

    async def fits_team(self, record: KeyRecord) -> None:
        """409 naming every way the key would allow more than its team as it stands (404: no such team)."""
        if record.team is None:
            return
        team = await self.store.get_team(record.team)
        if team is None:
            raise NotFound(f"no team named {record.team}", param="team", code="team_not_found")
        problems = key_problems(record, team, class_order(self.gateway.policy.priorities))
        if problems:
            raise Conflict(f"a key may only narrow what its team allows: {'; '.join(t for _, t in problems)}",
                           param=problems[0][0], code="exceeds_team")

    async def save(self, connection: AnyConnection, action: str, before: KeyRecord, record: KeyRecord,
                   more: dict[str, Any] | None = None) -> KeyView:
        """Store a changed key, drop it from every replica's cache and record the act (its from/to diff)."""
        try:
            await self.store.put_key(record)
        except KeyNotFound:
            raise NotFound(f"no API key with id {record.id}", code="key_not_found") from None
        await self.gateway.forget_key(record.id)
        view = KeyView.of(record)
        await self.gateway.audit.act(connection, action, record.id,
                                     {**diff(KeyView.of(before).model_dump(), view.model_dump()), **(more or {})})
        return view

    async def create(self, connection: AnyConnection, data: NewKey) -> IssuedKey:
        fields = data.model_dump(exclude={"expires_in"}, exclude_none=True)
        if data.expires_in is not None:
            fields["expires_at"] = time.time() + data.expires_in
        team = own_team(connection)
        if team is not None:  # a team admin's keys are its team's
            if data.team not in (None, team):
                raise PermissionDenied(f"this admin token issues keys of team {team} only", code="other_team")
            fields["team"] = team
        for attempt in range(CREATE_ATTEMPTS):  # a taken id (1 in 2**64 per key issued) gets a fresh one
            key_id = new_key_id()
            key = new_key(key_id)
            record = KeyRecord(id=key_id, created_at=time.time(), hash=hash_key(key), **fields)
            if attempt == 0:
                await self.fits_team(record)
            try:
                await self.store.create_key(record)
            except KeyExists:
                continue
            view = KeyView.of(record)
            await self.gateway.audit.act(connection, "key.create", key_id, view.model_dump())
            return IssuedKey(key=key, record=view)
        raise StateUnavailable(f"no free key id in {CREATE_ATTEMPTS} tries; try again")

    async def listing(self, team: str | None = None) -> list[KeyView]:
        """Every key, or the keys of `team`."""
        return [KeyView.of(r) for r in await self.store.list_keys() if team is None or r.team == team]

    async def update(self, connection: AnyConnection, key_id: str, data: KeyChanges) -> KeyView:
        record = await self.load(key_id, connection)
        changes = data.model_dump(exclude_unset=True)
        own = own_team(connection)
        if own is not None and changes.get("team", own) != own:
            raise PermissionDenied(f"a team admin cannot move keys out of team {own}", code="other_team")
        for field in ("data_policy", "limits", "client_priority"):  # null: back to the default, as when issued
            if field in changes and changes[field] is None:
                changes[field] = KeyRecord.model_fields[field].get_default()
        if isinstance(changes.get("limits"), dict):  # only the limits sent change (one sent as null: unlimited)
            changes["limits"] = {**record.limits.model_dump(), **changes["limits"]}
        updated = KeyRecord.model_validate({**record.model_dump(), **changes})
        await self.fits_team(updated)
        return await self.save(connection, "key.update", record, updated)

    async def revoke(self, connection: AnyConnection, key_id: str) -> KeyView:
        record = await self.load(key_id, connection)
        revoked = record.model_copy(update={"revoked": True, "previous_hash": None, "previous_valid_until": None})
        return await self.save(connection, "key.revoke", record, revoked)

    async def rotate(self, connection: AnyConnection, key_id: str, rotation: Rotation | None = None) -> IssuedKey:
        record = await self.load(key_id, connection)
        grace = (rotation or Rotation()).grace_seconds
        key = new_key(key_id)
        rotated = record.model_copy(update={"hash": hash_key(key), "previous_hash": record.hash,
                                            "previous_valid_until": time.time() + grace})
        view = await self.save(connection, "key.rotate", record, rotated, {"grace_seconds": grace})
        return IssuedKey(key=key, record=view)

    async def usage(self, key_id: str, connection: AnyConnection | None = None) -> Usage:
        await self.load(key_id, connection)
        await self.gateway.record_usage.flush()  # this replica's last quarter second, so a read follows its writes
        models, variants = by_model(await self.store.usage(key_id))
        return Usage(id=key_id, models=models, variants=variants, total=totals(models))
