"""The key cache's store reads under load: calls that miss together (the entry expired while 64 were in flight)
share one read per id; its answer, or its outage, reaches each of them; a change announced while it is under
way is not hidden by it, and a listener that reconnects under it (doubt_all) still leaves its record as the
outage fallback."""

from __future__ import annotations

import asyncio
import time

import pytest

from policies.auth import Authenticate
from policies.errors import AuthenticationFailed, StateUnavailable
from policies.keys import KeyRecord, hash_key, new_key, new_key_id
from policies.store import StoreUnavailable
from policies.teams import TeamRecord


class SlowStore:
    """get_key/get_team answer once `go` is set (with the record as it was when the read began); each read is
    counted."""

    def __init__(self, record: KeyRecord, team: TeamRecord | None = None) -> None:
        self.record, self.team = record, team
        self.key_reads = self.team_reads = 0
        self.go = asyncio.Event()
        self.down = False

    async def get_key(self, key_id: str) -> KeyRecord | None:
        self.key_reads += 1
        record = self.record  # as the store held it when the read began
        await self.go.wait()
        if self.down:
            raise StoreUnavailable("the store went away")
        return record if key_id == record.id else None

    async def get_team(self, name: str) -> TeamRecord | None:
        self.team_reads += 1
        await self.go.wait()
        return self.team

    async def touch_key(self, key_id: str, when: float) -> None:
        pass


def a_key(team: str | None = None) -> tuple[str, KeyRecord]:
    key_id = new_key_id()
    key = new_key(key_id)
    return key, KeyRecord(id=key_id, name="k", team=team, created_at=time.time(), hash=hash_key(key))


def authenticate(store: SlowStore, stale_seconds: float = 0.0) -> Authenticate:
    return Authenticate(store, cache_seconds=5.0, background=lambda coro: coro.close(),  # type: ignore[arg-type]
                        stale_seconds=stale_seconds)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def verifying(auth: Authenticate, key: str) -> asyncio.Future[KeyRecord]:
    """A call verifying `key`, let run until it waits on the store."""
    call = asyncio.ensure_future(auth.verify(f"Bearer {key}"))
    await settle()
    return call


async def test_64_calls_that_miss_together_share_one_read_and_the_next_is_served_from_the_cache():
    key, record = a_key()
    store = SlowStore(record)
    auth = authenticate(store)
    calls = [asyncio.ensure_future(auth.verify(f"Bearer {key}")) for _ in range(64)]
    await settle()
    assert store.key_reads == 1
    store.go.set()
    assert {r.id for r in await asyncio.gather(*calls)} == {record.id}
    assert (await auth.verify(f"Bearer {key}")).id == record.id
    assert store.key_reads == 1 and auth.cache.reading == {} and auth.cache.in_flight == {}


async def test_a_team_read_is_shared_as_a_key_read_is():
    key, record = a_key(team="red")
    store = SlowStore(record, TeamRecord(name="red"))
    auth = authenticate(store)
    store.go.set()
    await auth.verify(f"Bearer {key}")
    store.go.clear()
    teams = [asyncio.ensure_future(auth.team_of(record)) for _ in range(20)]
    await settle()
    store.go.set()
    assert {t.name for t in await asyncio.gather(*teams)} == {"red"}
    assert store.team_reads == 1


async def test_an_outage_during_the_shared_read_reaches_every_caller_as_its_503():
    key, record = a_key()
    store = SlowStore(record)
    store.down = True
    auth = authenticate(store)
    calls = [asyncio.ensure_future(auth.verify(f"Bearer {key}")) for _ in range(10)]
    await settle()
    store.go.set()
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, StateUnavailable) for o in outcomes), outcomes
    assert store.key_reads == 1 and auth.cache.reading == {} and auth.cache.in_flight == {}


async def test_a_caller_that_gives_up_leaves_the_read_to_the_others():
    key, record = a_key()
    store = SlowStore(record)
    auth = authenticate(store)
    first, second = (asyncio.ensure_future(auth.verify(f"Bearer {key}")) for _ in range(2))
    await settle()
    first.cancel()  # its client went away
    await settle()
    store.go.set()
    assert (await second).id == record.id
    assert first.cancelled() and store.key_reads == 1


async def test_a_change_announced_during_a_read_is_not_hidden_by_it():
    key, record = a_key()
    store = SlowStore(record)
    auth = authenticate(store)
    before = await verifying(auth, key)
    store.record = record.model_copy(update={"revoked": True})  # revoked while the first read is under way
    auth.cache.drop(record.id)  # as the admin API and the key-change listener do
    after = await verifying(auth, key)
    assert store.key_reads == 2  # the call after the change did not join the read from before it
    store.go.set()
    assert (await before).id == record.id  # it was in flight before the change, as it would have been alone
    with pytest.raises(AuthenticationFailed):
        await after
    with pytest.raises(AuthenticationFailed):  # the older read was not cached
        await auth.verify(f"Bearer {key}")


async def test_a_read_under_way_when_the_listener_reconnects_is_still_the_outage_fallback():
    key, record = a_key()
    store = SlowStore(record)
    auth = authenticate(store, stale_seconds=60.0)
    before = await verifying(auth, key)
    auth.cache.doubt_all()  # the key-change listener reconnected while the read was under way
    after = await verifying(auth, key)
    assert store.key_reads == 2  # the call after the doubt did not join the read from before it
    store.go.set()
    assert (await before).id == record.id and (await after).id == record.id
    assert auth.cache.in_flight == {} and auth.cache.reading == {}
    store.go.clear()
    store.down = True  # an outage: the record verified before it keeps serving
    store.go.set()
    assert (await auth.verify(f"Bearer {key}")).id == record.id


async def test_a_doubted_read_is_read_again_while_the_store_answers_yet_serves_an_outage():
    key, record = a_key()
    store = SlowStore(record)
    auth = authenticate(store, stale_seconds=60.0)
    only = await verifying(auth, key)
    auth.cache.doubt_all()  # no call after it: the read from before is the only one
    store.go.set()
    assert (await only).id == record.id
    assert auth.cache.get(record.id, time.monotonic()) is None  # doubted: the next call reads it again
    assert (await auth.verify(f"Bearer {key}")).id == record.id and store.key_reads == 2
    auth.cache.doubt_all()
    store.go.clear()
    store.down = True
    outage = await verifying(auth, key)
    store.go.set()
    assert (await outage).id == record.id  # served from the doubted record: the outage fallback


async def test_a_change_to_a_record_whose_read_began_before_a_reconnect_is_not_hidden_by_it():
    key, record = a_key()
    store = SlowStore(record)
    auth = authenticate(store)
    before = await verifying(auth, key)
    auth.cache.doubt_all()  # the read is no longer one a call may join, yet still under way
    store.record = record.model_copy(update={"revoked": True})
    auth.cache.drop(record.id)  # then the key is revoked
    store.go.set()
    await before
    assert auth.cache.in_flight == {}
    store.down = True  # not even as the outage fallback: an outage now refuses the key, never serves it unrevoked
    with pytest.raises(StateUnavailable):
        await auth.verify(f"Bearer {key}")
