"""The batch class beside interactive work: the reserve it leaves free on each replica (policies/admission.py),
the vLLM `priority` a client may send kept within its class's range (policies/priority.py), and its demand kept
out of the replicas-needed signal unless autoscaling.count_batches (policies/scaling.py)."""

from __future__ import annotations

import asyncio
import random

import pytest
from pydantic import ValidationError

from prometheus_client import generate_latest

from backends.replicas import Replica
from policies.admission import ModelQueue
from policies.config import Policy, Priorities, Queue
from policies.metrics import GatewayMetrics
from policies.pipeline import Call, Request
from policies.priority import CLIENT_PRIORITY, Classify
from policies.routing.least_in_flight import LeastInFlight
from policies.routing.pickers import MaxScore
from policies.routing.profile import Profile
from policies.scaling import ScalingSignal
from tests.support.gateway import default_key_record
from tests.support.calls import call_of


def make(cap: int = 4, metrics: GatewayMetrics | None = None, **queue) -> tuple[ModelQueue, Replica]:
    replica = Replica(name="r0", model="m", url="http://10.0.0.1:1", served_name="m", cap=cap)
    q = ModelQueue("m", [replica], Queue(**queue), Profile([(LeastInFlight(), 1.0)], picker=MaxScore(random.Random(0))),
                   metrics or GatewayMetrics())
    return q, replica


def classed(name: str, priorities: Priorities | None = None) -> Call:
    return call_of(Request("r", "chat/completions", {}, "127.0.0.1", 0.0),
                   klass=(priorities or Priorities()).named(name))


async def test_the_batch_class_leaves_an_eighth_of_the_cap_and_an_interactive_request_takes_it_at_once():
    q, r = make(cap=16)
    lines = [classed("batch") for _ in range(15)]
    held = [await q.acquire("k", (), call=line) for line in lines[:14]]
    waiting = asyncio.create_task(q.acquire("k", (), call=lines[14]))
    await asyncio.sleep(0.01)
    assert r.in_flight == 14 and not waiting.done() and q.depth == 1  # 2 of 16 stay free: the default reserve
    assert q.batch_demand() == (14, 1)
    calls = [classed("interactive") for _ in range(2)]
    for call in calls:  # each finds a free slot at once
        await asyncio.wait_for(q.acquire("j", (), call=call), 0.5)
    assert r.in_flight == 16
    q.release(r, calls[0])  # an interactive slot freed (kept priorities.hold for interactive, then free)
    for _ in range(500):
        if r.in_flight == 15:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)
    assert not waiting.done() and r.in_flight == 15  # still within the reserve: the batch line waits
    q.release(held[0], lines[0])
    q.release(r, calls[1])
    assert await asyncio.wait_for(waiting, 1) is r and r.in_flight == 14  # under the reserve again: its turn
    assert q.batch_demand() == (14, 0)


async def test_the_reserve_is_a_setting_never_the_whole_cap():
    for cap, reserve, batch_slots in ((4, None, 3), (8, None, 7), (24, None, 21), (8, 0, 8), (8, 3, 5), (1, None, 1), (2, 5, 1)):
        q, r = make(cap=cap, reserve=reserve)
        for _ in range(batch_slots):
            await asyncio.wait_for(q.acquire("k", (), call=classed("batch")), 0.5)
        refused = asyncio.create_task(q.acquire("k", (), call=classed("batch")))
        await asyncio.sleep(0.01)
        assert not refused.done() and r.in_flight == batch_slots, (cap, reserve)
        refused.cancel()


async def classify(priorities: Priorities, klass: str, own, batch: bool = False) -> Call:
    policy = Policy.model_validate({"models": [{"name": "m", "backends": [{"url": "http://10.0.0.1:8000"}]}],
                                    "priorities": priorities.model_dump()})
    call = call_of(Request("r", "chat/completions", {"x-priority-class": klass}, "10.0.0.2", 0.0), model="m",
                key=default_key_record(client_priority=True), body={"priority": own},
                batch="batch_1" if batch else None)
    await Classify(policy).enter(call)
    return call


async def test_a_clients_own_priority_is_never_ahead_of_a_better_class():
    default = Priorities()  # interactive (vllm_priority 0, prefill levels 0-3), batch (10)
    line = await classify(default, "interactive", -100, batch=True)  # a batch line: always the batch class
    assert line.priority.name == "batch" and CLIENT_PRIORITY.get(line) == 4 and line.body["priority"] == -100
    assert CLIENT_PRIORITY.get(await classify(default, "batch", 0)) == 4  # within interactive's levels: behind them
    assert CLIENT_PRIORITY.get(await classify(default, "batch", 50)) == 50  # within its range: as sent
    assert CLIENT_PRIORITY.get(await classify(default, "interactive", -100)) == -100  # the first class: any
    three = Priorities.model_validate({"classes": [{"name": "urgent", "vllm_priority": -10},
                                                   {"name": "interactive"},
                                                   {"name": "batch", "vllm_priority": 10}]})
    assert CLIENT_PRIORITY.get(await classify(three, "interactive", -100)) == -9
    assert CLIENT_PRIORITY.get(await classify(three, "batch", -100, batch=True)) == 1
    assert CLIENT_PRIORITY.get(await classify(three, "batch", "soon")) == "soon"  # not a number: vLLM's 400


def policy(**autoscaling) -> Policy:
    return Policy.model_validate({"models": [{"name": "m", "backends": [{"url": "http://10.0.0.1:1", "cap": 4}],
                                              "autoscaling": autoscaling}]})


async def test_batch_demand_is_its_own_gauge_and_raises_replicas_needed_only_when_counted():
    metrics = GatewayMetrics()
    signal = ScalingSignal(metrics.registry)
    q, _ = make(cap=4, metrics=metrics)
    lines = [classed("batch") for _ in range(8)]
    for line in lines[:3]:
        await q.acquire("k", (), call=line)
    waiting = [asyncio.create_task(q.acquire("k", (), call=line)) for line in lines[3:]]
    await asyncio.sleep(0.01)
    interactive = classed("interactive")
    await q.acquire("j", (), call=interactive)
    await signal.refresh(policy(headroom=0.0, smoothing_seconds=0), {"m": q})
    view = signal.view("m")
    assert (view["demand"], view["batch_demand"], view["needed"]) == (1, 8, 1)  # the batch alone starts nothing
    text = generate_latest(metrics.registry)
    assert b'llm_gateway_batch_demand{model="m"} 8.0' in text
    assert b'llm_gateway_replicas_needed{model="m"} 1.0' in text
    await signal.refresh(policy(headroom=0.0, smoothing_seconds=0, count_batches=True), {"m": q})
    assert (signal.view("m")["demand"], signal.view("m")["needed"]) == (9, 3)
    alone, _ = make(cap=4, metrics=metrics)  # batch work alone: one replica, or it never runs (scaled to zero)
    batch_only = [asyncio.create_task(alone.acquire("k", (), call=classed("batch"))) for _ in range(2)]
    await asyncio.sleep(0.01)
    await signal.refresh(policy(headroom=0.0, smoothing_seconds=0), {"m": alone})
    assert (signal.view("m")["demand"], signal.view("m")["batch_demand"], signal.view("m")["needed"]) == (0, 2, 1)
    await asyncio.gather(*batch_only)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    for line in lines[:3]:
        q.release(q.replicas[0], line)
    q.release(q.replicas[0], interactive)
    assert q.batch_demand() == (0, 0)


def test_a_classs_prefill_levels_may_not_reach_a_later_classs_priority():
    with pytest.raises(ValidationError, match="prefill_levels"):
        Priorities.model_validate({"classes": [{"name": "interactive", "prefill_levels": 11},
                                               {"name": "batch", "vllm_priority": 10}]})
    fits = Priorities.model_validate({"classes": [{"name": "interactive", "prefill_levels": 10},
                                                  {"name": "batch", "vllm_priority": 10}]})
    assert fits.classes[0].prefill_levels == 10
    # without levels, classes may share a vllm_priority, as they always could
    assert Priorities.model_validate({"default": "a", "classes": [{"name": "a"}, {"name": "b"}]}).classes[1].vllm_priority == 0
