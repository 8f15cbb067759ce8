"""One contract, both limiters: in-process (embedded default) and Redis (shared by replicas)."""

from __future__ import annotations

import asyncio
import time

import pytest

from policies.ratelimit import MemoryLimiter, Scope, Ticket
from policies.ratelimit.redis import RedisLimiter
from policies.store import open_store
from tests.support.redis_fixtures import redis_prefix, redis_server  # noqa: F401
from tests.support.calls import settled


# These tests judge what the limiters decide, never how fast: a store call may take this long before it counts
# as unreachable (the default, 2.5 s, was once passed by the first script load of a 200-call burst through
# Sentinel while three test workers and a package build shared the two cores)
CONTRACT_DEADLINE = 15.0


@pytest.fixture(params=["memory", "redis", "redis-sentinel", "redis-cluster"])
async def limiter(request):
    if request.param == "memory":
        yield MemoryLimiter()
        return
    store = open_store("redis", url=request.getfixturevalue("redis_server").url,
                       prefix=request.getfixturevalue("redis_prefix"), deadline=CONTRACT_DEADLINE)
    yield RedisLimiter(store)
    await store.close()


async def take(limiter, scopes, cost=1, member="m", lease=60.0):
    decision = await limiter.acquire(tuple(scopes), cost, member, lease)
    return decision, Ticket(tuple(scopes), member, cost, limiter=limiter)


async def test_requests_per_minute_admits_exactly_the_limit(limiter):
    key = Scope("key:a", requests_per_minute=5)
    results = [(await take(limiter, [key], member=f"r{i}"))[0] for i in range(8)]
    assert [d.allowed for d in results] == [True] * 5 + [False] * 3
    assert [d.remaining_requests for d in results[:5]] == [4, 3, 2, 1, 0]
    refused = results[5]
    assert refused.kind == "requests" and refused.scope == "key:a"
    assert 11.0 < refused.retry_after <= 12.0  # one request refills in 60/5 s
    assert 59.0 < results[4].reset_requests <= 60.0  # empty bucket: a minute to full


async def test_tokens_are_reserved_and_settled(limiter):
    key = Scope("key:t", tokens_per_minute=1000)
    first, ticket = await take(limiter, [key], cost=600, member="a")
    assert first.allowed and first.remaining_tokens == 400
    refused, _ = await take(limiter, [key], cost=600, member="b")
    assert not refused.allowed and refused.kind == "tokens"
    assert 11.0 < refused.retry_after <= 12.1  # 200 tokens at 1000/60 per second
    await limiter.release(ticket, used=100)  # the response used far less: 500 come back
    again, _ = await take(limiter, [key], cost=600, member="c")
    assert again.allowed and again.remaining_tokens <= 300


async def test_overrun_is_charged(limiter):
    key = Scope("key:o", tokens_per_minute=1000)
    _, ticket = await take(limiter, [key], cost=100, member="a")
    await limiter.release(ticket, used=1500)  # used more than reserved: the bucket goes into debt
    refused, _ = await take(limiter, [key], cost=10, member="b")
    assert not refused.allowed and refused.retry_after > 20


async def test_concurrency_slots(limiter):
    key = Scope("key:c", max_concurrent=2)
    (d1, t1), (d2, t2), (d3, _) = [await take(limiter, [key], member=f"s{i}") for i in range(3)]
    assert d1.allowed and d2.allowed and not d3.allowed and d3.kind == "concurrency"
    assert await limiter.slots("key:c") == 2
    await limiter.release(t1, used=0)
    assert await limiter.slots("key:c") == 1
    assert (await take(limiter, [key], member="s9"))[0].allowed


async def test_expired_leases_free_their_slots(limiter):
    key = Scope("key:l", max_concurrent=1)
    # the lease must outlast the round trip to the next call (a stall there of its length would free the slot
    # early): 0.5 s; the sleep, only ever longer than asked, is past it whatever the machine
    assert (await take(limiter, [key], member="lost", lease=0.5))[0].allowed
    assert not (await take(limiter, [key], member="next"))[0].allowed
    await asyncio.sleep(0.6)
    assert (await take(limiter, [key], member="next"))[0].allowed


async def test_all_or_nothing_across_scopes(limiter):
    key = Scope("key:x", requests_per_minute=10, tokens_per_minute=1_000)
    model = Scope("model:m", requests_per_minute=1)
    assert (await take(limiter, [key, model], member="1"))[0].allowed
    refused, _ = await take(limiter, [key, model], cost=500, member="2")
    assert not refused.allowed and refused.scope == "model:m"
    # the key's own buckets were not charged for the refused request: 8 requests left (one refills in 6 s),
    # and 998 tokens, up to the 1,000 the bucket refills to at 17/s; charged, they would be 7 and ~498
    ok, _ = await take(limiter, [key], cost=1, member="3")
    assert ok.remaining_requests == 8 and 1_000 - 2 <= ok.remaining_tokens <= 1_000


async def test_concurrent_burst_is_exact(limiter, request):
    # 200 acquisitions started together. Each is counted in flight from its call until its decision, so the
    # peak shows how far they really overlapped. For Redis they go through four limiters on four connection
    # pools, as four gateway replicas would, and all 200 are in flight at once (each waits on the network):
    # only the server-side script's atomicity keeps the count at 25; a check and a take in two round trips
    # (or a lock that only serializes one replica's calls) would admit far more.
    key = Scope("key:burst", requests_per_minute=25, max_concurrent=1000)
    limiters, stores = [limiter], []
    if isinstance(limiter, RedisLimiter):
        for _ in range(3):
            stores.append(open_store("redis", url=request.getfixturevalue("redis_server").url,
                                     prefix=request.getfixturevalue("redis_prefix"), deadline=CONTRACT_DEADLINE))
            limiters.append(RedisLimiter(stores[-1]))
    in_flight = peak = 0

    async def one(i):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await limiters[i % len(limiters)].acquire((key,), 1, f"b{i}", 60.0)
        finally:
            in_flight -= 1

    try:
        decisions = await asyncio.gather(*(one(i) for i in range(200)))
    finally:
        for store in stores:
            await store.close()
    assert sum(d.allowed for d in decisions) == 25
    assert await limiter.slots("key:burst") == 25
    if isinstance(limiter, RedisLimiter):
        assert peak == 200  # they did interleave: every one was waiting on Redis before any had its answer


def finish_without_suspending(coro):
    """Run a coroutine one step: return its result if it finished there; fail if it stopped to wait."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("suspended midway: another task could run between its check and its take")


def test_memory_limiter_is_atomic_because_it_never_suspends():
    # The in-process limiter has no lock: it is atomic because acquire and release run from start to end
    # without an await that suspends, so no other task on the loop can run between a check and its take
    # (the burst above can then not interleave). An await added midway would break that; this finds it.
    limiter = MemoryLimiter()
    scopes = (Scope("key:a", requests_per_minute=2, tokens_per_minute=100, max_concurrent=1),
              Scope("model:m", requests_per_minute=5))
    first = finish_without_suspending(limiter.acquire(scopes, 10, "a", 60.0))
    refused = finish_without_suspending(limiter.acquire(scopes, 10, "b", 60.0))
    assert first.allowed and not refused.allowed and refused.kind == "concurrency"
    finish_without_suspending(limiter.release(Ticket(scopes, "a", 10, limiter=limiter), used=5))
    assert finish_without_suspending(limiter.slots("key:a")) == 0


async def test_a_release_queued_before_close_reaches_the_store(limiter):
    """At shutdown (gateway/app.py) a release still waiting for its batch is sent at once, not left to its lease."""
    key = Scope("key:close", tokens_per_minute=1000, max_concurrent=1)
    first, ticket = await take(limiter, [key], cost=600, member="a")
    assert first.allowed
    if isinstance(limiter, RedisLimiter):
        limiter.returning.delay = 3600.0  # no batch timer sends it within the test: only close can
    releasing = asyncio.create_task(limiter.release(ticket, used=100))
    await asyncio.sleep(0)  # queued
    await limiter.close()
    await asyncio.wait_for(releasing, 5)
    assert await limiter.slots("key:close") == 0
    again, _ = await take(limiter, [key], cost=800, member="b")  # the slot and the 500 unused tokens came back
    assert again.allowed and again.remaining_tokens == 1000 - 600 + 500 - 800


@pytest.mark.parametrize("setup", ["redis", "redis-cluster"])
async def test_a_release_travels_with_the_next_admission_of_its_scopes(setup, redis_server, redis_prefix):  # noqa: F811
    store = open_store("redis", url=redis_server.url, prefix=redis_prefix)
    limiter = RedisLimiter(store)
    try:
        scopes = [Scope("key:p", tokens_per_minute=1000, max_concurrent=1), Scope("model:p", max_concurrent=1)]
        first, ticket = await take(limiter, scopes, cost=600, member="a")
        assert first.allowed
        releasing = asyncio.create_task(limiter.release(ticket, used=100))
        await asyncio.sleep(0)  # the release is queued, not yet sent (it may wait up to 2 ms)
        second, _ = await take(limiter, scopes, cost=800, member="b")
        # the admission carried the release: the slot was free and the 500 tokens back before it was checked
        assert second.allowed and second.remaining_tokens == 1000 - 600 + 500 - 800
        await asyncio.wait_for(releasing, 5)
        # alone, a release goes within its 2 ms in a call of its own, with the others queued meanwhile
        tickets = [Ticket(tuple(scopes), "b", 800, limiter=limiter)]
        await asyncio.wait_for(asyncio.gather(*(limiter.release(t, used=800) for t in tickets)), 5)
        assert await limiter.slots("key:p") == 0 and await limiter.slots("model:p") == 0
    finally:
        await store.close()


async def test_requests_that_go_away_while_admitted_leave_no_slot(redis_server, redis_prefix):  # noqa: F811
    """A client that disconnects cancels its request while the admission script may already have run: the slot
    (and the tokens) it took must come back at once, not when its lease ends."""
    import random
    from types import SimpleNamespace

    from gateway.background import Background
    from policies.config import parse_policy
    from policies.keys import KeyLimits
    from policies.metrics import GatewayMetrics
    from policies.pipeline import Call, Request
    from policies.rate_limit import RateLimit

    store = open_store("redis", url=redis_server.url, prefix=redis_prefix)
    background = Background()
    step = RateLimit(parse_policy('models: [{name: m, backends: [{url: "http://127.0.0.1:9"}]}]'),
                     RedisLimiter(store), background.run, GatewayMetrics())
    key = SimpleNamespace(id="gone", limits=KeyLimits(max_concurrent=8))
    rng = random.Random(5)

    async def one(i: int) -> None:
        call = Call(Request(f"r{i}", "chat/completions", {}, "127.0.0.1", 0.0))
        settled(call, model="m", key=key)
        entered = asyncio.create_task(step.enter(call))
        await asyncio.sleep(rng.uniform(0, 0.003))  # often while the script's reply is on its way
        entered.cancel()
        try:
            await entered
        except asyncio.CancelledError:
            return
        except Exception:  # refused: at most 8 at once
            return
        await step.leave(call)

    for n in range(20):
        await asyncio.gather(*(one(n * 16 + i) for i in range(16)))
    # past the batching of releases (2 ms) and the store's round trips for the last of them; bounded far under
    # the slots' lease, so a slot left to end on its own still fails
    await asyncio.sleep(0.2)
    deadline = time.monotonic() + 5
    while (held := await step.limiter.slots("key:gone")) != 0:
        assert time.monotonic() < deadline, f"{held} slots of requests that went away stayed"
        await asyncio.sleep(0.05)
    await store.close()
