"""The replicas-needed signal (policies/scaling.py) on real admission queues, and scale from zero in the queue:
a model with no replica holds its requests for autoscaling.cold_start_wait, serves them when one appears, and
past the bound answers 503 with Retry-After."""

import asyncio
import random

import pytest
from prometheus_client import generate_latest

from backends.replicas import DOWN, UP, Replica
from policies.admission import ModelQueue
from policies.config import Autoscaling, Policy, PolicyError, Queue, parse_policy
from policies.errors import NoBackendAvailable
from policies.metrics import GatewayMetrics
from policies.routing.least_in_flight import LeastInFlight
from policies.routing.pickers import MaxScore
from policies.routing.profile import Profile
from policies.scaling import ScalingSignal, needed, smooth


def queue(caps=(4,), autoscaling: Autoscaling | None = None, metrics=None, **settings):
    replicas = [Replica(name=f"r{i}", model="m", url="http://10.0.0.1:1", served_name="m", cap=c)
                for i, c in enumerate(caps)]
    q = ModelQueue("m", replicas, Queue(**settings), Profile([(LeastInFlight(), 1.0)], picker=MaxScore(random.Random(0))),
                   metrics or GatewayMetrics())
    q.autoscaling = autoscaling
    return q, replicas


def policy(**autoscaling) -> Policy:
    return Policy.model_validate({"models": [{"name": "m", "backends": [{"url": "http://10.0.0.1:1", "cap": 4}],
                                              "autoscaling": autoscaling}]})


def test_needed_is_the_ceiling_of_demand_at_the_cap_with_headroom():
    assert needed(0, 4, 0.1) == 0
    assert needed(0.2, 4, 0.1) == 1  # anything at all needs a replica: scale from zero
    assert needed(3, 4, 0.1) == 1 and needed(4, 4, 0.1) == 2  # at the cap: the next one before anyone waits
    assert needed(4, 4, 0.0) == 1 and needed(8, 4, 0.0) == 2 and needed(9, 4, 0.0) == 3
    assert needed(30, 10, 0.0) == 3  # no float drift: 3.0000000000000004 would ask for 4


def test_smoothing_rises_at_once_and_falls_with_its_time_constant():
    assert smooth(2.0, 10.0, 1.0, 60.0) == 10.0
    after_tau = smooth(10.0, 0.0, 60.0, 60.0)
    assert after_tau == pytest.approx(10.0 / 2.718281828, rel=1e-6)
    assert smooth(10.0, 0.0, 600.0, 60.0) == 0.0  # under ZERO: none (a decay never reaches 0 by itself)
    assert smooth(10.0, 4.0, 1.0, 0.0) == 4.0  # no smoothing


async def test_the_signal_counts_in_flight_and_queued_and_leads_the_backend():
    metrics = GatewayMetrics()
    signal = ScalingSignal(metrics.registry)
    p = policy(headroom=0.0, smoothing_seconds=0)
    q, (r,) = queue(caps=(4,), autoscaling=p.models[0].autoscaling, metrics=metrics)
    await signal.refresh(p, {"m": q})
    assert signal.view("m")["needed"] == 0
    held = [await q.acquire("k", ()) for _ in range(4)]  # at the cap: the backend itself has no queue at all
    waiting = [asyncio.create_task(q.acquire("k", ())) for _ in range(3)]
    await asyncio.sleep(0.01)
    await signal.refresh(p, {"m": q})
    view = signal.view("m")
    assert (view["in_flight"], view["queued"], view["demand"], view["needed"], view["replicas"]) == (4, 3, 7, 2, 1)
    assert b'llm_gateway_replicas_needed{model="m"} 2.0' in generate_latest(metrics.registry)
    for replica in held:
        q.release(replica)
    await asyncio.gather(*waiting)
    assert signal.view() == {"models": {"m": view}, "fleet": False}  # read between refreshes: the last figures


async def test_a_fall_is_smoothed_so_a_lull_keeps_the_replicas():
    signal = ScalingSignal(GatewayMetrics().registry)
    p = policy(headroom=0.0, smoothing_seconds=3600)
    q, _ = queue(caps=(4,))
    held = [await q.acquire("k", ()) for _ in range(4)]
    q.replicas[0].cap = q.replicas[0].limit = 8
    held += [await q.acquire("k", ()) for _ in range(4)]
    await signal.refresh(p, {"m": q})
    assert signal.view("m")["needed"] == 2
    for replica in held:
        q.release(replica)
    await signal.refresh(p, {"m": q})
    assert signal.view("m")["demand"] == 0 and signal.view("m")["needed"] == 2


async def test_a_model_without_a_known_cap_has_no_signal_and_autoscaling_needs_one():
    p = Policy.model_validate({"models": [{"name": "m", "backends": [{"url": "http://10.0.0.1:1"}]}]})
    signal = ScalingSignal(GatewayMetrics().registry)
    q, _ = queue(caps=(None,))
    await signal.refresh(p, {"m": q})
    assert signal.view("m") is None and signal.view() == {"models": {}, "fleet": False}
    with pytest.raises(PolicyError, match="autoscaling of m needs the cap of one replica"):
        parse_policy("models:\n- name: m\n  backends: [{url: 'http://10.0.0.1:1'}]\n  autoscaling: {}\n")
    with_cap = parse_policy("models:\n- name: m\n  backends: [{url: 'http://10.0.0.1:1'}]\n"
                                "  autoscaling: {replica_cap: 16}\n")
    assert with_cap.models[0].autoscaling.replica_cap == 16


async def test_a_model_with_no_replica_holds_requests_until_one_comes_up():
    q, (r,) = queue(caps=(2,), autoscaling=Autoscaling(cold_start_wait=30), max_wait=0.05)
    r.state = DOWN  # scaled away (or still starting)
    waiting = [asyncio.create_task(q.acquire(f"k{i}", ())) for i in range(3)]
    await asyncio.sleep(0.2)  # past the queue's own max_wait: the cold start bound holds them
    assert q.depth == 3 and not any(w.done() for w in waiting)
    r.state = UP
    q.dispatch()  # what the replica set's change callback does (Admission.replica_changed)
    done, pending = await asyncio.wait(waiting, timeout=5)
    assert len(done) == 2 and len(pending) == 1 and r.in_flight == 2  # the cap holds, the rest keep waiting
    q.release(r)
    assert await asyncio.wait_for(pending.pop(), 5) is r


async def test_past_the_cold_start_bound_a_503_with_retry_after():
    q, (r,) = queue(caps=(2,), autoscaling=Autoscaling(cold_start_wait=0.2), max_wait=0.05)
    r.state = DOWN
    with pytest.raises(NoBackendAvailable) as refused:
        await q.acquire("k", ())
    assert refused.value.code == "no_replica_started" and refused.value.headers["retry-after"] == "30"
    assert q.depth == 0


async def test_without_autoscaling_or_for_a_key_that_may_rent_no_replica_is_a_503_at_once():
    for autoscaling, spill_after in ((None, None), (Autoscaling(), 2.0)):
        q, (r,) = queue(caps=(2,), autoscaling=autoscaling)
        r.state = DOWN
        with pytest.raises(NoBackendAvailable) as refused:
            await asyncio.wait_for(q.acquire("k", (), spill_after=spill_after), 1)
        assert refused.value.code == "no_backend_available"


def test_a_reload_gives_the_kept_queue_the_new_autoscaling(tmp_path):
    from gateway.wiring import Gateway
    from policies.snapshot import compile_snapshot

    def with_wait(wait):
        models = [{"name": "m", "backends": [{"url": "http://10.0.0.1:1", "cap": 4}]}]
        if wait is not None:
            models[0]["autoscaling"] = {"cold_start_wait": wait}
        return Policy.model_validate({"store": {"kind": "sqlite", "path": str(tmp_path / "k.db")}, "models": models})

    gw = Gateway(with_wait(None))
    queue = gw.snapshot.admission.queues["m"]
    assert queue.autoscaling is None
    reloaded = compile_snapshot(with_wait(42), gw.snapshot, gw.shared, "v2")
    assert reloaded.admission.queues["m"] is queue and queue.autoscaling.cold_start_wait == 42
    compile_snapshot(with_wait(None), reloaded, gw.shared, "v3")
    assert queue.autoscaling is None
