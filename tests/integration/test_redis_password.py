"""A Redis that requires a password (`requirepass`, the policy's store.password_env or password_file): the
rate limiter's scripts go through the pipelined wire (policies/store/pipelined.py), which sends AUTH on each
connection it opens, and a wrong password is a store error that names neither password."""

from __future__ import annotations

import pytest

from policies.ratelimit import Scope
from policies.ratelimit.redis import RedisLimiter
from policies.store import StoreError, open_store
from tests.support.redis_server import RedisServer

PASSWORD = "Redis0nlyForTh1sTest"


async def test_a_password_protected_redis_serves_the_limits_through_the_pipelined_wire():
    with RedisServer(password=PASSWORD) as server:
        store = open_store("redis", url=server.url, password=PASSWORD, prefix="pw:", deadline=5.0)
        try:
            assert store._fast is not None  # the pipelined wire serves this client (no TLS, a known pool)
            limiter = RedisLimiter(store)
            key = Scope("key:a", requests_per_minute=2)
            decisions = [await limiter.acquire((key,), 1, f"m{i}", 60.0) for i in range(3)]
            assert [d.allowed for d in decisions] == [True, True, False]  # the third is over the limit
            assert store._fast.wires  # the scripts went over the pipelined wire, authenticated
        finally:
            await store.close()

        wrong = open_store("redis", url=server.url, password="NotTheRightOne9", prefix="pw:", deadline=5.0)
        try:
            with pytest.raises(StoreError) as refused:
                await RedisLimiter(wrong).acquire((Scope("key:b", requests_per_minute=2),), 1, "x", 60.0)
            said = f"{refused.value!r} {refused.value.__cause__!r}"
            assert PASSWORD not in said and "NotTheRightOne9" not in said
        finally:
            await wrong.close()
