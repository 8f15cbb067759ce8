"""What the stores promise across restarts and outages: keys outlive the process (SQLite file, Redis AOF),
an unreachable Redis fails fast with StoreUnavailable instead of hanging a request, and the same store object
works again as soon as Redis is back."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest

from policies.keys import KeyRecord, hash_key, new_key, new_key_id
from policies.store import StoreUnavailable, open_store
from tests.support.redis_fixtures import redis_server  # noqa: F401
from tests.support.redis_server import RedisServer

BOUND_S = 3.0
GIVE_UP_S = 6.0  # a store that hangs fails the test here instead of stalling the run


def record(created_at: float = 1.0) -> KeyRecord:
    key_id = new_key_id()
    return KeyRecord(
        id=key_id, name="durable", owner="ops", models=["m"], created_at=created_at, hash=hash_key(new_key(key_id))
    )


@pytest.fixture
def own_redis():
    """A private server: these tests stop and pause it, which must not disturb the shared one."""
    with RedisServer() as server:
        yield server


async def test_sqlite_survives_close_and_reopen(tmp_path):
    path = str(tmp_path / "gateway.db")
    first = open_store("sqlite", path=path)
    kept = record()
    await first.create_key(kept)
    await first.touch_key(kept.id, 42.5)
    await first.add_usage(kept.id, "m", requests=3, prompt_tokens=30, completion_tokens=9, rented=True)
    await first.close()

    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    second = open_store("sqlite", path=path)
    try:
        assert await second.get_key(kept.id) == kept.model_copy(update={"last_used_at": 42.5})
        assert [r.id for r in await second.list_keys()] == [kept.id]
        assert (await second.usage(kept.id))["m"]["rented_prompt_tokens"] == 30
    finally:
        await second.close()


async def test_sqlite_unopenable_file_is_unavailable_then_recovers(tmp_path):
    folder = tmp_path / "not-yet"
    store = open_store("sqlite", path=str(folder / "gateway.db"))
    try:
        with pytest.raises(StoreUnavailable):
            await store.ping()
        folder.mkdir()
        await store.ping()
        await store.create_key(record())
    finally:
        await store.close()


async def test_redis_key_survives_server_restart(own_redis):
    store = open_store("redis", url=own_redis.url)
    try:
        kept = record()
        await store.create_key(kept)
        await store.add_usage(kept.id, "m", requests=1, prompt_tokens=2, completion_tokens=3)
        own_redis.restart()
        # the first call on the same object, whose pooled connections all died with the old process
        assert await store.get_key(kept.id) == kept
        assert (await store.usage(kept.id))["m"]["completion_tokens"] == 3
    finally:
        await store.close()
    assert (own_redis.data_dir / "appendonlydir").is_dir()


async def test_redis_down_every_call_fails_fast_then_recovers(own_redis):
    store = open_store("redis", url=own_redis.url)
    try:
        kept = record()
        await store.create_key(kept)
        own_redis.stop()
        calls = {
            "ping": store.ping,
            "create_key": lambda: store.create_key(record()),
            "get_key": lambda: store.get_key(kept.id),
            "list_keys": store.list_keys,
            "put_key": lambda: store.put_key(kept),
            "touch_key": lambda: store.touch_key(kept.id, 5.0),
            "add_usage": lambda: store.add_usage(kept.id, "m", requests=1, prompt_tokens=1, completion_tokens=1),
            "usage": lambda: store.usage(kept.id),
        }
        for name, call in calls.items():
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as caught:
                async with asyncio.timeout(GIVE_UP_S):
                    await call()
            assert time.monotonic() - started < BOUND_S, name
            assert kept.hash not in str(caught.value)
        own_redis.start()
        assert await store.get_key(kept.id) == kept
        await store.touch_key(kept.id, 5.0)
        assert len(await store.list_keys()) == 1
    finally:
        await store.close()


async def test_redis_hung_server_times_out_then_recovers(own_redis):
    """A server that accepts connections but never answers (SIGSTOP) must not hang a request either."""
    store = open_store("redis", url=own_redis.url)
    try:
        await store.ping()
        own_redis.pause()
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                async with asyncio.timeout(GIVE_UP_S):
                    await store.ping()
            assert time.monotonic() - started < BOUND_S
        finally:
            own_redis.resume()
        await store.ping()
        assert await store.list_keys() == []
    finally:
        await store.close()


def pooled_connections(client) -> list:
    """The idle connections in a client's pools (a Cluster has one pool per node)."""
    if hasattr(client, "get_nodes"):
        return [c for node in client.get_nodes() for c in node._free]
    return list(client.connection_pool._available_connections)


@pytest.mark.parametrize("setup", ["redis", "redis-cluster"])
def test_a_pooled_connection_the_server_closed_is_the_store_unavailable_not_an_error(redis_server, setup):  # noqa: F811
    """The server (a failover, a proxy, a restart) closes a pooled connection; under uvloop, the gateway's loop,
    redis-py's next write on it raised the loop's RuntimeError, which no retry or guard knew: a 500. It is the
    store being unavailable for that call, and the call after it gets a fresh connection."""
    import uvloop

    async def scenario() -> str:
        store = open_store("redis", url=redis_server.url)
        try:
            await store.ping()
            connections = pooled_connections(store.client)
            assert connections
            for connection in connections:
                connection._writer.transport.close()  # the event loop sees the reset; redis-py is not told
            await asyncio.sleep(0.05)
            try:
                await store.ping()
                outcome = "served"  # a retry on a fresh connection would do too
            except StoreUnavailable:
                outcome = "unavailable"
            await store.ping()  # and the next call works
            return outcome
        finally:
            await store.close()

    assert uvloop.run(scenario()) in ("served", "unavailable")
