"""One contract, both stores: whatever passes here for SQLite must pass for Redis, so callers never care
which one they hold. Redis runs as a real server; each test writes under its own prefix."""

from __future__ import annotations

import asyncio

import pytest

from policies.keys import KeyBudget, KeyLimits, KeyRecord, hash_key, new_key, new_key_id
from policies.store import (
    USAGE_FIELDS,
    KeyExists,
    KeyNotFound,
    Store,
    StoreError,
    StoreUnavailable,
    TeamExists,
    TeamNotFound,
    open_store,
)
from policies.teams import TeamRecord
from tests.support.redis_fixtures import redis_prefix, redis_server  # noqa: F401


@pytest.fixture(params=["sqlite", "redis", "redis-sentinel", "redis-cluster"])
async def store(request, tmp_path):
    if request.param == "sqlite":
        opened = open_store("sqlite", path=str(tmp_path / "gateway.db"))
    else:
        server = request.getfixturevalue("redis_server")
        opened = open_store("redis", url=server.url, prefix=request.getfixturevalue("redis_prefix"))
    assert isinstance(opened, Store)
    await opened.ping()
    yield opened
    await opened.close()


def full_record(created_at: float = 1712345678.123456, **changes) -> KeyRecord:
    """A record with every field away from its default, so a field that is dropped or rounded shows."""
    key_id = new_key_id()
    fields = {
        "id": key_id,
        "name": "billing service",
        "owner": "team-ñ@example.com",
        "team": "billing",
        "models": ["llama-3:8b", "org/embed"],
        "expires_at": 1893456000.5,
        "revoked": True,
        "data_policy": "allow_rented",
        "allowed_cidrs": ["10.0.0.0/8", "fd00::/8"],
        "limits": KeyLimits(requests_per_minute=60, tokens_per_minute=90_000, max_concurrent=4),
        "priority_class": "batch",
        "client_priority": True,
        "budget": KeyBudget(max_rented_spend=12.5, max_tokens_per_period=10**8, period="week", when_spent="reject"),
        "created_at": created_at,
        "last_used_at": 1712345999.000001,
        "hash": hash_key(new_key(key_id)),
        "previous_hash": hash_key(new_key(key_id)),
        "previous_valid_until": 1712349278.25,
    }
    return KeyRecord(**(fields | changes))


def minimal_record(created_at: float) -> KeyRecord:
    key_id = new_key_id()
    return KeyRecord(id=key_id, name="k", created_at=created_at, hash=hash_key(new_key(key_id)))


async def test_create_get_round_trips_every_field(store):
    record = full_record()
    await store.create_key(record)
    got = await store.get_key(record.id)
    assert got == record
    assert got.model_dump() == record.model_dump()
    assert set(record.model_fields_set) == set(KeyRecord.model_fields)  # the test really sets every field


async def test_minimal_record_keeps_its_defaults(store):
    record = minimal_record(1.5)
    await store.create_key(record)
    assert await store.get_key(record.id) == record


async def test_get_missing_is_none(store):
    assert await store.get_key(new_key_id()) is None


async def test_duplicate_create_raises_key_exists_and_keeps_the_original(store):
    record = full_record()
    await store.create_key(record)
    with pytest.raises(KeyExists):
        await store.create_key(record.model_copy(update={"name": "impostor"}))
    assert (await store.get_key(record.id)).name == "billing service"
    assert len(await store.list_keys()) == 1


async def test_list_is_sorted_by_created_at(store):
    records = [minimal_record(t) for t in (30.0, 10.0, 20.0, 5.5)]
    for record in records:
        await store.create_key(record)
    listed = await store.list_keys()
    assert [r.created_at for r in listed] == [5.5, 10.0, 20.0, 30.0]
    assert sorted(listed, key=lambda r: r.id) == sorted(records, key=lambda r: r.id)


async def test_list_empty(store):
    assert await store.list_keys() == []


async def test_put_replaces_every_field(store):
    before = minimal_record(100.0)
    await store.create_key(before)
    after = full_record(created_at=50.0, id=before.id, hash=before.hash)
    await store.put_key(after)
    assert await store.get_key(before.id) == after
    assert await store.list_keys() == [after]


async def test_put_reorders_the_listing_when_created_at_changes(store):
    a, b = minimal_record(1.0), minimal_record(2.0)
    await store.create_key(a)
    await store.create_key(b)
    moved = a.model_copy(update={"created_at": 3.0})
    await store.put_key(moved)
    assert [r.id for r in await store.list_keys()] == [b.id, a.id]


async def test_revoke_and_rotate_through_put(store):
    record = minimal_record(10.0)
    await store.create_key(record)
    new_secret = new_key(record.id)
    rotated = record.model_copy(
        update={"hash": hash_key(new_secret), "previous_hash": record.hash, "previous_valid_until": 99.0}
    )
    await store.put_key(rotated)
    got = await store.get_key(record.id)
    assert got.matches(new_secret, now=50.0) and got.previous_hash == record.hash
    await store.put_key(got.model_copy(update={"revoked": True}))
    assert (await store.get_key(record.id)).usable(now=50.0) is False


async def test_put_missing_raises_key_not_found(store):
    with pytest.raises(KeyNotFound):
        await store.put_key(full_record())
    assert await store.list_keys() == []


async def test_touch_keeps_the_latest_time(store):
    record = minimal_record(10.0)
    await store.create_key(record)
    assert (await store.get_key(record.id)).last_used_at is None
    await store.touch_key(record.id, 200.25)
    await store.touch_key(record.id, 150.0)  # late, out-of-order report: ignored
    assert (await store.get_key(record.id)).last_used_at == 200.25
    assert (await store.list_keys())[0].last_used_at == 200.25
    await store.touch_key(record.id, 300.5)
    assert (await store.get_key(record.id)).last_used_at == 300.5
    # a put carrying an older last_used_at does not roll the touched time back
    await store.put_key(record.model_copy(update={"name": "renamed"}))
    got = await store.get_key(record.id)
    assert (got.name, got.last_used_at) == ("renamed", 300.5)


async def test_touch_missing_key_is_ignored(store):
    ghost = new_key_id()
    await store.touch_key(ghost, 5.0)
    assert await store.get_key(ghost) is None
    record = minimal_record(1.0).model_copy(update={"id": ghost})
    await store.create_key(record)
    assert (await store.get_key(ghost)).last_used_at is None


async def test_usage_accumulates_across_calls_and_models(store):
    key_a, key_b = new_key_id(), new_key_id()
    assert await store.usage(key_a) == {}
    await store.add_usage(key_a, "llama-3:8b", requests=1, prompt_tokens=10, completion_tokens=5)
    await store.add_usage(key_a, "llama-3:8b", requests=1, prompt_tokens=7, completion_tokens=3, rented=True)
    await store.add_usage(key_a, "org/embed", requests=2, prompt_tokens=40, completion_tokens=0)
    await store.add_usage(key_b, "llama-3:8b", requests=1, prompt_tokens=1, completion_tokens=1)
    assert await store.usage(key_a) == {
        "llama-3:8b": {
            "requests": 2, "prompt_tokens": 17, "completion_tokens": 8,
            "rented_requests": 1, "rented_prompt_tokens": 7, "rented_completion_tokens": 3,
        },
        "org/embed": {
            "requests": 2, "prompt_tokens": 40, "completion_tokens": 0,
            "rented_requests": 0, "rented_prompt_tokens": 0, "rented_completion_tokens": 0,
        },
    }  # fmt: skip
    assert await store.usage(key_b) == {"llama-3:8b": dict(zip(USAGE_FIELDS, (1, 1, 1, 0, 0, 0)))}


async def test_usage_rejects_negative_increments(store):
    key_id = new_key_id()
    with pytest.raises(ValueError):
        await store.add_usage(key_id, "m", requests=1, prompt_tokens=-5, completion_tokens=0)
    assert await store.usage(key_id) == {}


async def test_concurrent_add_usage_is_exact(store):
    key_id = new_key_id()
    models = ["a", "b:large"]

    async def one(i: int) -> None:
        await store.add_usage(
            key_id, models[i % 2], requests=1, prompt_tokens=i, completion_tokens=2, rented=i % 5 == 0
        )

    await asyncio.gather(*(one(i) for i in range(200)))
    usage = await store.usage(key_id)
    for parity, model in enumerate(models):
        mine = [i for i in range(200) if i % 2 == parity]
        rented = [i for i in mine if i % 5 == 0]
        assert usage[model] == {
            "requests": 100, "prompt_tokens": sum(mine), "completion_tokens": 200,
            "rented_requests": len(rented), "rented_prompt_tokens": sum(rented),
            "rented_completion_tokens": 2 * len(rented),
        }  # fmt: skip


async def test_shared_secret_is_made_once_for_every_store_on_the_same_data(store, request, tmp_path):
    if request.node.callspec.params["store"] == "sqlite":
        second = open_store("sqlite", path=store.path)
    else:
        second = open_store("redis", url=request.getfixturevalue("redis_server").url, prefix=store.prefix)
    try:
        first_view = await asyncio.gather(*(s.shared_secret("owners") for s in (store, second, store, second)))
        assert len(set(first_view)) == 1 and len(first_view[0]) == 32
        assert await second.shared_secret("owners") == first_view[0]
        assert await store.shared_secret("other") not in (first_view[0], b"")
    finally:
        await second.close()


async def test_closed_store_refuses_calls_and_closes_twice(store):
    await store.close()
    await store.close()
    with pytest.raises(StoreError) as caught:
        await store.get_key(new_key_id())
    assert not isinstance(caught.value, StoreUnavailable)


def full_team(name: str = "billing", **changes) -> TeamRecord:
    """A team with every field away from its default."""
    fields = {
        "name": name,
        "description": "Billing – ñ",
        "models": ["llama-3:8b", "org/embed"],
        "data_policy": "allow_rented",
        "limits": KeyLimits(requests_per_minute=600, tokens_per_minute=900_000, max_concurrent=40),
        "budget": KeyBudget(max_rented_spend=125.25, max_tokens_per_period=10**9, period="day", when_spent="reject"),
        "created_at": 1712345678.123456,
        "max_priority_class": "interactive",
    }
    return TeamRecord(**(fields | changes))


async def test_team_create_get_list_put_delete(store):
    team = full_team()
    assert set(team.model_fields_set) == set(TeamRecord.model_fields)
    await store.create_team(team)
    await store.create_team(full_team("ads", models=None))
    assert await store.get_team("billing") == team
    assert [t.name for t in await store.list_teams()] == ["ads", "billing"]
    with pytest.raises(TeamExists):
        await store.create_team(full_team(description="other"))
    assert (await store.get_team("billing")).description == team.description  # the original stays
    changed = team.model_copy(update={"limits": KeyLimits(requests_per_minute=5)})
    await store.put_team(changed)
    assert await store.get_team("billing") == changed
    await store.delete_team("billing")
    assert await store.get_team("billing") is None
    assert [t.name for t in await store.list_teams()] == ["ads"]
    with pytest.raises(TeamNotFound):
        await store.delete_team("billing")
    with pytest.raises(TeamNotFound):
        await store.put_team(team)
    assert await store.get_team("billing") is None  # a put never creates


async def test_teams_empty(store):
    assert await store.list_teams() == []
    assert await store.get_team("nobody") is None
