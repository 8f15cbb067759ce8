"""The admission queue on its own: caps, FIFO per key, round-robin across keys, bounds, cancellation."""

import asyncio
import random

import pytest

from backends.replicas import Replica
from policies.admission import ModelQueue
from policies.config import Queue
from policies.errors import NoBackendAvailable, RateLimited
from policies.metrics import GatewayMetrics
from policies.routing.least_in_flight import LeastInFlight
from policies.routing.pickers import MaxScore
from policies.routing.profile import Profile
from tests.support.calls import settled


def make(caps=(1,), **queue):
    replicas = [Replica(name=f"r{i}", model="m", url="http://10.0.0.1:1", served_name="m", cap=c)
                for i, c in enumerate(caps)]
    q = ModelQueue("m", replicas, Queue(**queue), Profile([(LeastInFlight(), 1.0)], picker=MaxScore(random.Random(0))),
                   GatewayMetrics())
    return q, replicas


async def test_never_more_than_the_cap_and_slots_pass_to_waiters():
    q, (r0, r1) = make(caps=(2, 1))
    held = [await q.acquire("k", ()) for _ in range(3)]
    assert r0.in_flight == 2 and r1.in_flight == 1
    waiting = asyncio.create_task(q.acquire("k", ()))
    await asyncio.sleep(0.01)
    assert not waiting.done() and q.depth == 1
    q.release(next(h for h in held if h is r1))  # r1 frees: the waiter gets it, nobody exceeds a cap
    assert await asyncio.wait_for(waiting, 1) is r1
    assert r1.in_flight == 1 and q.depth == 0


async def test_round_robin_across_keys_fifo_within_a_key():
    q, (r,) = make(caps=(1,))
    first = await q.acquire("a", ())
    order: list[str] = []

    async def request(owner: str, n: int):
        replica = await q.acquire(owner, ())
        order.append(f"{owner}{n}")
        await asyncio.sleep(0)
        q.release(replica)

    tasks = [asyncio.create_task(request("a", i)) for i in range(5)]
    await asyncio.sleep(0.01)
    tasks += [asyncio.create_task(request("b", i)) for i in range(2)]
    await asyncio.sleep(0.01)
    q.release(first)
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3", "a4"]


async def test_full_queue_and_deadline_are_429_with_retry_after():
    q, (r,) = make(caps=(1,), max_depth=1, max_wait=0.2)
    held = await q.acquire("k", ())
    waiting = asyncio.create_task(q.acquire("k", ()))
    await asyncio.sleep(0.01)
    with pytest.raises(RateLimited) as full:
        await q.acquire("k", ())
    assert full.value.param == "queue_full" and int(full.value.headers["retry-after"]) >= 1
    with pytest.raises(RateLimited) as late:
        await waiting
    assert late.value.param == "queue_timeout" and q.depth == 0
    q.release(held)
    assert r.in_flight == 0


class FakeClock:
    """Stands in for the admission module's `time`: completions land exactly where the test puts them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


async def test_retry_after_follows_the_drain_rate(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("policies.admission.time", clock)
    q, (r,) = make(caps=(1,), max_wait=60)
    for _ in range(11):  # 10 completions over 0.5 s: 20 per second
        q.release(await q.acquire("k", ()))
        clock.now += 0.05
    clock.now -= 0.05  # asked right at the last completion
    held = await q.acquire("k", ())
    waiters = [asyncio.create_task(q.acquire("k", ())) for _ in range(3)]
    await asyncio.sleep(0)
    assert q.depth == 3
    assert q.retry_after() == pytest.approx(0.2)  # (3 waiting + 1) / 20 per second
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    q.release(held)


async def test_cancelled_waiter_leaves_at_once_and_never_gets_a_slot():
    q, (r,) = make(caps=(1,))
    held = await q.acquire("k", ())
    waiting = asyncio.create_task(q.acquire("k", ()))
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert q.depth == 0
    q.release(held)
    assert r.in_flight == 0  # the slot was not handed to the cancelled waiter


async def test_no_routable_replica_is_503_not_a_queue():
    q, (r,) = make(caps=(1,))
    r.state = "down"
    with pytest.raises(NoBackendAvailable):
        await q.acquire("k", ())


def test_adaptive_limit_moves_between_floor_and_cap():
    from policies.config import Adaptive

    q, (r,) = make(caps=(8,))
    r.adaptive = Adaptive(floor=2, target_ttft=0.5)
    for _ in range(20):
        q.last_cut.clear()  # one cut per second in production; here every slow answer counts
        q.observe(r, ttft=2.0)
    assert r.limit == 2.0  # 8 -> 7.2 -> 6.48 -> ... floored at 2
    r.in_flight = 1
    q.observe(r, ttft=0.1)
    assert r.limit == 2.0  # fast, but not using its limit: no reason to grow
    for _ in range(200):
        r.in_flight = int(r.limit)
        q.observe(r, ttft=0.1)
    assert r.limit == 8.0  # grew back to the measured cap and no further
    q.last_cut.clear()
    q.observe(r, ttft=2.0)
    q.observe(r, ttft=2.0)
    assert r.limit == pytest.approx(7.2)  # two slow answers within a second: one cut


def classed(name: str):
    """A call of priority class `name`, as the Classify step leaves it."""
    from policies.config import Priorities
    from policies.pipeline import Call, Request

    call = Call(Request("r", "chat/completions", {}, "127.0.0.1", 0.0))
    settled(call, klass=Priorities().named(name))
    return call


async def test_waiters_are_served_class_first_then_round_robin_across_keys():
    q, (r,) = make(caps=(1,))
    first = await q.acquire("a", ())
    order: list[str] = []

    async def request(owner: str, klass: str, n: int):
        replica = await q.acquire(owner, (), call=classed(klass))
        order.append(f"{klass[0]}-{owner}{n}")
        await asyncio.sleep(0)
        q.release(replica)

    tasks = [asyncio.create_task(request("a", "batch", i)) for i in range(2)]
    await asyncio.sleep(0.01)
    tasks += [asyncio.create_task(request(o, "interactive", i)) for i in range(2) for o in ("a", "b")]
    await asyncio.sleep(0.01)
    assert q.line.depths == [4, 2]
    q.release(first)
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    # the batch requests came first but wait for every interactive one; keys take turns within a class
    assert order == ["i-a0", "i-b0", "i-a1", "i-b1", "b-a0", "b-a1"]


async def test_each_class_has_its_own_max_wait_and_retry_after_counts_only_those_ahead():
    from policies.config import Priorities, PriorityClass

    q, (r,) = make(caps=(1,), max_wait=0.1)
    q.priorities = Priorities(classes=[PriorityClass(name="interactive"), PriorityClass(name="batch", max_wait=5)])
    q.classes = q.priorities.classes
    held = await q.acquire("k", ())
    batch = asyncio.create_task(q.acquire("k", (), call=classed("batch")))
    interactive = asyncio.create_task(q.acquire("k", (), call=classed("interactive")))
    with pytest.raises(RateLimited) as late:
        await interactive  # gave up after the model's 0.1 s
    assert late.value.param == "queue_timeout"
    assert not batch.done()  # still within its own 5 s
    assert q.line.ahead_of(0) == 0 and q.line.ahead_of(1) == 1
    q.release(held)
    assert await asyncio.wait_for(batch, 1) is r


async def test_a_class_that_rents_first_spills_instead_of_waiting():
    from policies.admission import WouldWait

    q, (r,) = make(caps=(1,))
    held = await q.acquire("k", ())
    with pytest.raises(WouldWait):  # batch: straight to the rented provider (its key may rent)
        await q.acquire("k", (), spill_after=30.0, call=classed("batch"))
    waiting = asyncio.create_task(q.acquire("k", (), spill_after=30.0, call=classed("interactive")))
    await asyncio.sleep(0.01)
    assert not waiting.done() and q.depth == 1  # interactive: the expected wait is within its 30 s
    q.release(held)
    assert await asyncio.wait_for(waiting, 1) is r


async def test_a_slot_freed_while_only_a_worse_class_waits_is_held_a_moment_for_its_own_class():
    q, (r,) = make(caps=(1,))
    interactive = classed("interactive")
    first = await q.acquire("a", (), call=interactive)
    batch = asyncio.create_task(q.acquire("b", (), call=classed("batch")))
    await asyncio.sleep(0.01)
    q.release(first, interactive)  # only batch waits: the slot is kept for interactive's next request
    q.dispatch()  # as another release would: a held slot is not free for the waiting batch request
    assert r.in_flight == 1 and q.depth == 1
    again = await asyncio.wait_for(q.acquire("a", (), call=classed("interactive")), 1)  # it came: straight in
    assert again is r and not batch.done()
    q.release(again, interactive)
    assert await asyncio.wait_for(batch, 1) is r  # nobody came within the hold: batch gets the slot
    q.release(r, classed("batch"))  # nobody waits: nothing held, nothing pending
    assert q.depth == 0 and r.in_flight == 0


async def test_no_hold_when_the_policy_sets_none():
    from policies.config import Priorities

    q, (r,) = make(caps=(1,))
    q.priorities = Priorities(hold=0)
    interactive = classed("interactive")
    first = await q.acquire("a", (), call=interactive)
    batch = asyncio.create_task(q.acquire("b", (), call=classed("batch")))
    await asyncio.sleep(0.01)
    q.release(first, interactive)
    assert q.depth == 0 and r.in_flight == 1  # handed on to batch within the release itself
    assert await asyncio.wait_for(batch, 1) is r


def classed_queue(batch_max_wait: float, min_share: float):
    from policies.config import Priorities, PriorityClass

    replica = Replica(name="r0", model="m", url="http://10.0.0.1:1", served_name="m", cap=1)
    priorities = Priorities(classes=[PriorityClass(name="interactive"),
                                     PriorityClass(name="batch", max_wait=batch_max_wait, min_share=min_share)])
    return ModelQueue("m", [replica], Queue(max_wait=30), Profile([(LeastInFlight(), 1.0)],
                      picker=MaxScore(random.Random(0))), GatewayMetrics(), priorities), replica


async def steady_interactive_load(q, slots: int, pause: float = 0.0) -> tuple[dict[str, int], list]:
    """Interactive requests alone fill the cap (two always waiting); a batch request always waits too. Each of
    `slots` rounds frees the slot and resubmits whoever got it. Returns who was served and what batch got."""
    holder = classed("interactive")
    await q.acquire("i", (), call=holder)
    waiting = {asyncio.create_task(q.acquire(f"i{n}", (), call=c)): c for n, c in
               enumerate((classed("interactive"), classed("interactive"), classed("batch")))}
    served = {"interactive": 0, "batch": 0}
    refused = []
    for n in range(slots):
        if refused and pause:
            break
        await asyncio.sleep(0)  # the resubmitted requests are in the queue before the slot frees
        q.release(q.replicas[0], holder)
        done, _ = await asyncio.wait(waiting, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert done, "a freed slot reached nobody"
        for task in done:
            call = waiting.pop(task)
            if task.exception() is not None:
                refused.append(task.exception())
                waiting[asyncio.create_task(q.acquire(f"n{n}", (), call=call))] = call
                continue
            holder = call
            served[call.priority.name] += 1
            fresh = classed(call.priority.name)
            waiting[asyncio.create_task(q.acquire(f"n{n}", (), call=fresh))] = fresh
        if pause:
            await asyncio.sleep(pause)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    q.release(q.replicas[0], holder)
    return served, refused


async def test_batch_gets_its_min_share_of_freed_slots_under_steady_interactive_load():
    q, _ = classed_queue(batch_max_wait=300, min_share=0.25)
    served, _ = await steady_interactive_load(q, 40)
    assert served["batch"] == 10 and served["interactive"] == 30  # every 4th freed slot, as 0.25 says


async def test_without_min_share_batch_starves_and_its_429_says_so_honestly():
    q, _ = classed_queue(batch_max_wait=2.5, min_share=0.0)
    # bounded: 2000 slots at 10 ms or more each outlast the batch request's 2.5 s, which ends the loop
    served, refused = await steady_interactive_load(q, 2000, pause=0.01)
    assert served["batch"] == 0 and refused
    late = refused[0]
    assert late.param == "queue_timeout"
    # the drain rate alone (~100 slots/s) would say 1 s; it starved 2.5 s and will again: its max_wait
    assert late.headers["retry-after"] == "3" and late.headers["retry-after-ms"] == "2500"
