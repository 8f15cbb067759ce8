"""The request path's script calls over one pipelined connection per server, on real redis-servers: the same
replies as redis-py, a script the server forgot is loaded again, a connection that breaks is replaced, and a
Cluster slot that moved is followed (through redis-py) instead of failing."""

from __future__ import annotations

import asyncio

import pytest

from policies.store import open_store
from tests.support.redis_fixtures import redis_prefix, redis_server  # noqa: F401

INCR = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


@pytest.fixture
async def store(redis_server, redis_prefix):  # noqa: F811
    store = open_store("redis", url=redis_server.url, prefix=redis_prefix)
    yield store
    await store.close()


@pytest.mark.parametrize("setup", ["redis", "redis-sentinel", "redis-cluster"])
async def test_concurrent_calls_share_one_connection_and_get_their_own_replies(setup, store):
    script = store.script(INCR)
    keys = [f"{store.prefix}{{n{i % 4}}}" for i in range(200)]
    replies = await asyncio.gather(*(script(keys=[k], args=[1]) for k in keys))
    assert sorted(replies) == sorted(r for i in range(4) for r in range(1, 51))  # each key counted 1..50
    assert store._fast is not None and store._fast.wires  # it went the fast way
    wires = len(store._fast.wires)
    assert wires <= (3 if setup == "redis-cluster" else 1)  # one per server that holds the keys


async def test_a_script_the_server_forgot_is_loaded_again(store):
    script = store.script(INCR)
    assert await script(keys=[f"{store.prefix}a"], args=[2]) == 2
    await store.client.script_flush()
    assert await script(keys=[f"{store.prefix}a"], args=[3]) == 5


async def test_a_broken_connection_is_replaced_and_errors_keep_their_kind(store):
    script = store.script(INCR)
    assert await script(keys=[f"{store.prefix}b"], args=[1]) == 1
    for wire in store._fast.wires.values():
        wire.transport.abort()  # as a server restart or a failover would
    await asyncio.sleep(0)
    assert await script(keys=[f"{store.prefix}b"], args=[1]) == 2
    bad = store.script("return redis.call('INCRBY', KEYS[1], 'x')")
    from redis.exceptions import ResponseError
    with pytest.raises(ResponseError):
        await bad(keys=[f"{store.prefix}b"], args=[])
    assert await script(keys=[f"{store.prefix}b"], args=[1]) == 3  # the connection survived the error reply


@pytest.mark.parametrize("setup", ["redis-cluster"])
async def test_a_redirect_goes_through_redis_py(setup, store):
    script = store.script(INCR)
    key = f"{store.prefix}{{moved}}"
    assert await script(keys=[key], args=[1]) == 1
    # point the fast path at the wrong primary for the key's slot: it answers MOVED, and the call still lands
    nodes = store.client.get_primaries()
    right = store.client.get_node_from_key(key)
    wrong = next(n for n in nodes if (n.host, n.port) != (right.host, right.port))
    store._fast.address = lambda keys: asyncio.sleep(0, (wrong.host, wrong.port))
    assert await script(keys=[key], args=[1]) == 2
