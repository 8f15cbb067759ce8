"""A request's deadline: read once from the timeout its client's SDK sends, and kept by the queue and retries."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from policies.deadline import deadline_of
from policies.errors import RateLimited
from policies.pipeline import Call, Request
from tests.unit.test_admission import make


def test_the_sdks_timeouts_make_the_deadline_and_the_shortest_wins() -> None:
    assert deadline_of({}, 10.0) == math.inf
    assert deadline_of({"x-stainless-read-timeout": "600.0"}, 10.0) == 610.0  # openai's default
    assert deadline_of({"x-stainless-read-timeout": "5", "x-stainless-timeout": "2.5"}, 10.0) == 12.5  # anthropic
    for bad in ("0", "-1", "nan", "inf", "1e400", "soon", "", "1" * 40, "86401"):
        assert deadline_of({"x-stainless-read-timeout": bad}, 10.0) == math.inf, bad


def with_deadline(seconds: float) -> Call:
    now = time.perf_counter()
    return Call(Request("r", "chat/completions", {}, "127.0.0.1", now, deadline=now + seconds))


async def test_a_waiter_is_refused_at_its_clients_deadline_not_the_queues_max_wait() -> None:
    q, (r,) = make(caps=(1,), max_wait=30)
    held = await q.acquire("k", ())
    started = time.perf_counter()
    with pytest.raises(RateLimited) as refused:
        await q.acquire("k", (), call=with_deadline(0.2))
    assert refused.value.param == "past_deadline" and "client's timeout" in refused.value.message
    assert 0.15 < time.perf_counter() - started < 5  # its 0.2 s, nowhere near the queue's 30
    assert q.depth == 0 and r.in_flight == 1  # it left the line and took nothing
    q.release(held)
    assert await q.acquire("k", (), call=with_deadline(0.2)) is r  # a free slot is taken whatever the deadline


async def test_a_request_whose_slot_the_drain_rate_puts_past_its_deadline_is_refused_at_once() -> None:
    q, (r,) = make(caps=(1,), max_wait=30)
    for i in range(5):  # a slot freed every 2 s
        q.drain.tick(time.monotonic() - 10 + 2 * i)
    held = await q.acquire("k", ())
    started = time.perf_counter()
    with pytest.raises(RateLimited) as refused:
        await q.acquire("k", (), call=with_deadline(1.0))  # its slot in ~2 s, its client gone in 1
    assert refused.value.param == "past_deadline" and time.perf_counter() - started < 0.5
    assert "retry-after" in refused.value.headers
    waiter = asyncio.create_task(q.acquire("k", (), call=with_deadline(10.0)))  # ~2 s is within 10: it waits
    await asyncio.sleep(0.05)
    assert not waiter.done() and q.depth == 1
    q.release(held)
    assert await asyncio.wait_for(waiter, 2) is r
    with pytest.raises(RateLimited):
        await q.acquire("k", (), call=with_deadline(-1.0))  # already past: refused before it queues
