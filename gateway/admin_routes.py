"""The admin API under /admin: issue, list, show, update, revoke and rotate API keys; read their usage.

Every route needs an admin JWT (gateway/admin_auth.py); `viewer` tokens may only read. A key's secret is in
exactly one response, the one that creates (or rotates) it. Listings show ids, names and policies, never
secrets or hashes.
"""

from __future__ import annotations

import time

from litestar import Request, Router, get, patch, post
from litestar.params import JSONBody, Parameter
from pydantic import BaseModel, ConfigDict, Field, field_validator

from policies.errors import NotFound
from policies.keys import (
    DataPolicy,
    KeyLimits,
    KeyRecord,
    hash_key,
    new_key,
    new_key_id,
    normalize_cidrs,
)
from policies.store import KeyNotFound

KeyId = Parameter(pattern=r"^[0-9a-f]{16}$", description="the key's public id")


class KeyChanges(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, min_length=1, max_length=200)
    owner: str | None = Field(None, max_length=200)
    models: list[str] | None = Field(None, description="models the key may use; omit or null for all")
    expires_at: float | None = Field(None, description="unix seconds after which the key stops working")
    data_policy: DataPolicy | None = None
    allowed_cidrs: list[str] | None = None
    limits: KeyLimits | None = None

    @field_validator("allowed_cidrs")
    @classmethod
    def valid_cidrs(cls, cidrs: list[str] | None) -> list[str] | None:
        return normalize_cidrs(cidrs)


class NewKey(KeyChanges):
    name: str = Field(min_length=1, max_length=200)
    expires_in: float | None = Field(None, gt=0, description="seconds from now; alternative to expires_at")


class Rotation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grace_seconds: float = Field(3600, ge=0, le=90 * 86400, description="how long the old secret keeps working")


class KeyView(BaseModel):
    id: str
    name: str
    owner: str | None
    models: list[str] | None
    expires_at: float | None
    revoked: bool
    data_policy: str
    allowed_cidrs: list[str] | None
    limits: KeyLimits
    created_at: float
    last_used_at: float | None
    previous_valid_until: float | None = Field(description="while set and in the future, the pre-rotation secret works")

    @classmethod
    def of(cls, record: KeyRecord) -> KeyView:
        data = record.model_dump(exclude={"hash", "previous_hash"})
        return cls(**data)


class IssuedKey(BaseModel):
    key: str = Field(description="the API key; shown only in this response")
    record: KeyView


class Usage(BaseModel):
    id: str
    models: dict[str, dict[str, int]]
    total: dict[str, int]


def admin_router(gateway) -> Router:
    store = gateway.store

    def allow(request: Request, write: bool) -> None:
        gateway.admin_auth.check(request.headers.get("authorization"), write)

    async def load(key_id: str) -> KeyRecord:
        record = await store.get_key(key_id)
        if record is None:
            raise NotFound(f"no API key with id {key_id}", code="key_not_found")
        return record

    async def save(record: KeyRecord) -> KeyView:
        try:
            await store.put_key(record)
        except KeyNotFound:
            raise NotFound(f"no API key with id {record.id}", code="key_not_found") from None
        gateway.forget_key(record.id)
        return KeyView.of(record)

    @post("/keys", status_code=201, summary="Issue a key (its secret is shown only in this response)")
    async def create_key(request: Request, data: JSONBody[NewKey]) -> IssuedKey:
        allow(request, write=True)
        key_id = new_key_id()
        key = new_key(key_id)
        fields = data.model_dump(exclude={"expires_in"}, exclude_none=True)
        if data.expires_in is not None:
            fields["expires_at"] = time.time() + data.expires_in
        record = KeyRecord(id=key_id, created_at=time.time(), hash=hash_key(key), **fields)
        await store.create_key(record)
        return IssuedKey(key=key, record=KeyView.of(record))

    @get("/keys", summary="List keys (never their secrets)")
    async def list_keys(request: Request) -> list[KeyView]:
        allow(request, write=False)
        return [KeyView.of(r) for r in await store.list_keys()]

    @get("/keys/{key_id:str}", summary="Show one key")
    async def show_key(request: Request, key_id: str = KeyId) -> KeyView:
        allow(request, write=False)
        return KeyView.of(await load(key_id))

    @patch("/keys/{key_id:str}", summary="Change a key's name, models, expiry, data policy, networks or limits")
    async def update_key(request: Request, data: JSONBody[KeyChanges], key_id: str = KeyId) -> KeyView:
        allow(request, write=True)
        record = await load(key_id)
        changes = data.model_dump(exclude_unset=True)
        return await save(KeyRecord.model_validate({**record.model_dump(), **changes}))

    @post("/keys/{key_id:str}/revoke", status_code=200,
          summary="Revoke a key; every replica refuses it within auth.cache_seconds")
    async def revoke_key(request: Request, key_id: str = KeyId) -> KeyView:
        allow(request, write=True)
        record = await load(key_id)
        return await save(record.model_copy(update={"revoked": True, "previous_hash": None,
                                                    "previous_valid_until": None}))

    @post("/keys/{key_id:str}/rotate", status_code=200, summary="New secret; the old one works for grace_seconds")
    async def rotate_key(request: Request, key_id: str = KeyId, data: JSONBody[Rotation | None] = None) -> IssuedKey:
        allow(request, write=True)
        record = await load(key_id)
        grace = (data or Rotation()).grace_seconds
        key = new_key(key_id)
        rotated = record.model_copy(update={"hash": hash_key(key), "previous_hash": record.hash,
                                            "previous_valid_until": time.time() + grace})
        return IssuedKey(key=key, record=await save(rotated))

    @get("/keys/{key_id:str}/usage", summary="Requests and tokens used by a key, per model")
    async def key_usage(request: Request, key_id: str = KeyId) -> Usage:
        allow(request, write=False)
        await load(key_id)
        await gateway.record_usage.flush()  # this replica's last quarter second, so a read follows its writes
        models = await store.usage(key_id)
        total: dict[str, int] = {}
        for counts in models.values():
            for name, value in counts.items():
                total[name] = total.get(name, 0) + value
        return Usage(id=key_id, models=models, total=total)

    return Router(
        path="/admin",
        route_handlers=[create_key, list_keys, show_key, update_key, revoke_key, rotate_key, key_usage],
        tags=["admin"],
    )
