"""Preemption's bounds (policies/preemption.py): a better class's waiting request stops the youngest Batch API line
holding a slot it may use, one per waiting request, never a call of a better class nor one not filed as stoppable;
a line runs again after each preemption and, once preempted batch.max_preemptions times, to its end
(policies/batches/runner.py); a stopped call ends the line's run as Preempted, the runner's own cancellation
stays a cancellation (gateway/batch_calls.py)."""

from __future__ import annotations

import asyncio
import random
from contextlib import ExitStack

import pytest
from prometheus_client import generate_latest

from backends.replicas import Replica
from gateway.batch_calls import handled
from policies.admission import ModelQueue
from policies.config.batches import BatchSettings
from policies.batches.runner import Answer, Preempted, Runner
from policies.config import Priorities, PriorityClass, Queue
from policies.metrics import GatewayMetrics
from policies.pipeline import Call, Request
from policies.preemption import PREEMPTIBLE, RUNNING, stoppable
from policies.routing.least_in_flight import LeastInFlight
from policies.routing.pickers import MaxScore
from policies.routing.profile import Profile
from tests.support.calls import settled

THREE = Priorities(classes=[PriorityClass(name="interactive"), PriorityClass(name="standard"),
                            PriorityClass(name="batch", max_wait=300, vllm_priority=10)])


def make(cap: int = 2, replicas: int = 1) -> tuple[ModelQueue, list[Replica], GatewayMetrics]:
    fleet = [Replica(name=f"r{i}", model="m", url="http://10.0.0.1:1", served_name="m", cap=cap)
             for i in range(replicas)]
    metrics = GatewayMetrics()
    q = ModelQueue("m", fleet, Queue(reserve=0), Profile([(LeastInFlight(), 1.0)], picker=MaxScore(random.Random(0))),
                   metrics, THREE)
    return q, fleet, metrics


def classed(name: str) -> Call:
    call = Call(Request("r", "chat/completions", {}, "127.0.0.1", 0.0))
    settled(call, klass=THREE.named(name))
    return call


class Running:
    """Calls that got a slot and were sent upstream (as the proxy marks them), some filed as stoppable."""

    def __init__(self, q: ModelQueue, stack: ExitStack) -> None:
        self.q, self.stack = q, stack
        self.stopped: list[Call] = []
        self.sent = 0.0

    async def start(self, klass: str, stoppable_: bool = True) -> Call:
        call = classed(klass)
        replica = await asyncio.wait_for(self.q.acquire(klass, (), call=call), 1)
        self.sent += 1.0
        call.replica, call.holds_replica, call.sent_at = replica, True, self.sent
        if stoppable_:
            self.stack.enter_context(stoppable(call, lambda: self.stop(call)))
        return call

    def stop(self, call: Call) -> bool:
        self.stopped.append(call)
        return True

    def end(self, call: Call) -> None:
        """The stopped call ends as the proxy ends it: its slot released once."""
        call.holds_replica = False
        self.q.release(call.replica, call)


def preemptions(metrics: GatewayMetrics) -> float:
    value = metrics.registry.get_sample_value("llm_gateway_batch_preemptions_total", {"model": "m"})
    return value or 0.0


async def test_a_waiting_interactive_request_stops_the_youngest_line_and_takes_its_slot():
    q, (r,), metrics = make(cap=2)
    with ExitStack() as stack:
        running = Running(q, stack)
        older, younger = [await running.start("batch") for _ in range(2)]
        waiting = asyncio.create_task(q.acquire("i", (), call=classed("interactive")))
        await asyncio.sleep(0)
        assert running.stopped == [younger] and preemptions(metrics) == 1  # the least work lost
        assert not waiting.done()  # the slot is its once the stopped call has ended
        running.end(younger)
        assert await asyncio.wait_for(waiting, 1) is r and r.in_flight == 2
        assert q.batch_demand() == (1, 0)
    assert not RUNNING  # nothing stays filed once the calls' runs end


async def test_one_preemption_per_waiting_request_and_none_when_nothing_may_be_stopped():
    q, (r,), metrics = make(cap=3)
    with ExitStack() as stack:
        running = Running(q, stack)
        lines = [await running.start("batch") for _ in range(2)]
        own = await running.start("batch", stoppable_=False)  # a client's own call of the batch class
        waiters = [asyncio.create_task(q.acquire("i", (), call=classed("interactive"))) for _ in range(4)]
        await asyncio.sleep(0)
        assert running.stopped == [lines[1], lines[0]]  # one each for the first two; the rest find none to stop
        assert preemptions(metrics) == 2 and own not in running.stopped
        for line in lines:
            running.end(line)
        done = await asyncio.wait_for(asyncio.gather(*waiters[:2]), 1)
        assert done == [r, r] and not any(w.done() for w in waiters[2:])
        for waiter in waiters[2:]:
            waiter.cancel()
        await asyncio.gather(*waiters[2:], return_exceptions=True)


async def test_never_a_better_class_nor_for_a_batch_class_request():
    q, (r,), metrics = make(cap=2)
    with ExitStack() as stack:
        running = Running(q, stack)
        # filed as stoppable, but of better classes than the batch class: never stopped, whoever waits
        better = [await running.start("interactive"), await running.start("standard")]
        waiting = asyncio.create_task(q.acquire("i", (), call=classed("interactive")))
        await asyncio.sleep(0)
        assert running.stopped == [] and preemptions(metrics) == 0
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        for call in better:
            running.end(call)
        lines = [await running.start("batch") for _ in range(2)]
        # a request of the batch class itself waits its turn: it stops no line
        batch_wait = asyncio.create_task(q.acquire("b", (), call=classed("batch")))
        await asyncio.sleep(0)
        assert running.stopped == [] and preemptions(metrics) == 0
        # any class better than the batch class does: a middle one too
        standard = asyncio.create_task(q.acquire("s", (), call=classed("standard")))
        await asyncio.sleep(0)
        assert running.stopped == [lines[1]] and preemptions(metrics) == 1
        running.end(lines[1])
        assert await asyncio.wait_for(standard, 1) is r and not batch_wait.done()  # the better class first
        batch_wait.cancel()
        await asyncio.gather(batch_wait, return_exceptions=True)


async def test_only_a_line_on_a_replica_the_waiting_request_may_use():
    q, (r0, r1), metrics = make(cap=1, replicas=2)
    with ExitStack() as stack:
        running = Running(q, stack)
        lines = [await running.start("batch") for _ in range(2)]
        on_r0 = next(c for c in lines if c.replica is r0)
        waiting = asyncio.create_task(q.acquire("i", (r1,), call=classed("interactive")))  # r1 already failed it
        await asyncio.sleep(0)
        assert running.stopped == [on_r0] and preemptions(metrics) == 1
        running.end(on_r0)
        assert await asyncio.wait_for(waiting, 1) is r0


def runner(execute, **settings) -> Runner:
    config = BatchSettings(**settings)
    return Runner(store=None, settings=lambda: config, execute=execute)  # type: ignore[arg-type]  # runs() only


class Preempting:
    """A line's calls: each run its runner lets be preempted is preempted."""

    def __init__(self) -> None:
        self.runs: list[bool] = []

    async def __call__(self, _record: dict, line: dict) -> Answer:
        self.runs.append(PREEMPTIBLE.get())
        if PREEMPTIBLE.get():
            raise Preempted
        return Answer(200, {"id": line["custom_id"]}, "req")


@pytest.mark.parametrize(("settings", "runs"), [
    ({}, [True, True, True, False]),  # the default: 3 preemptions, then to its end
    ({"max_preemptions": 1}, [True, False]),
    ({"max_preemptions": 0}, [False]),
    ({"preempt": False}, [False]),
])
async def test_a_line_runs_again_after_each_preemption_and_to_its_end_after_max_preemptions(settings, runs):
    calls = Preempting()
    answer = await runner(calls, **settings).runs({"id": "batch_x"}, {"custom_id": "c"})
    assert answer == Answer(200, {"id": "c"}, "req")  # one answer, never an error of its own
    assert calls.runs == runs
    assert PREEMPTIBLE.get() is False  # set for the line's runs only


class SlowProxy:
    """A proxy whose call holds its slot until cancelled, as the real one's `handle` does while vLLM answers."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = False

    async def handle(self, call: Call, body: bytes):
        self.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def test_a_stopped_call_is_preempted_and_the_runners_own_cancel_stays_a_cancel():
    proxy, call = SlowProxy(), classed("batch")
    token = PREEMPTIBLE.set(True)
    try:
        run = asyncio.create_task(handled(proxy, call, b"{}"))  # type: ignore[arg-type]
        await asyncio.wait_for(proxy.started.wait(), 1)
        assert RUNNING[call].preempt()
        with pytest.raises(Preempted):
            await asyncio.wait_for(run, 1)
        assert proxy.cancelled and call not in RUNNING

        proxy, call = SlowProxy(), classed("batch")
        run = asyncio.create_task(handled(proxy, call, b"{}"))  # type: ignore[arg-type]
        await asyncio.wait_for(proxy.started.wait(), 1)
        run.cancel()  # the runner stopping (its batch cancelled, the process draining)
        with pytest.raises(asyncio.CancelledError):
            await run
        assert proxy.cancelled and call not in RUNNING
    finally:
        PREEMPTIBLE.reset(token)


async def test_the_counter_is_exposed_by_model():
    q, _, metrics = make(cap=1)
    with ExitStack() as stack:
        running = Running(q, stack)
        line = await running.start("batch")
        waiting = asyncio.create_task(q.acquire("i", (), call=classed("interactive")))
        await asyncio.sleep(0)
        running.end(line)
        await asyncio.wait_for(waiting, 1)
    assert b'llm_gateway_batch_preemptions_total{model="m"} 1.0' in generate_latest(metrics.registry)
