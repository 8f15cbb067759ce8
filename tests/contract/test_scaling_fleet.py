"""The scaling signal's fleet demand on a real Redis (standalone and Cluster): each process's figures are summed,
a process silent past STALE is left out, one silent past FORGET is removed, and a store that fails leaves the
process counting its own demand, saying so."""

from __future__ import annotations

import random
import time

import pytest

from backends.replicas import Replica
from policies.admission import ModelQueue
from policies.config import Policy, Queue
from policies.metrics import GatewayMetrics
from policies.routing.least_in_flight import LeastInFlight
from policies.routing.pickers import MaxScore
from policies.routing.profile import Profile
from policies.scaling import FORGET, STALE, ScalingSignal
from policies.store import open_store
from tests.support.redis_fixtures import redis_prefix, redis_server  # noqa: F401

POLICY = Policy.model_validate({"models": [{"name": "m", "backends": [{"url": "http://10.0.0.1:1", "cap": 4}],
                                            "autoscaling": {"headroom": 0, "smoothing_seconds": 0}}]})


def queue() -> ModelQueue:
    replica = Replica(name="r0", model="m", url="http://10.0.0.1:1", served_name="m", cap=4)
    return ModelQueue("m", [replica], Queue(), Profile([(LeastInFlight(), 1.0)], picker=MaxScore(random.Random(0))),
                      GatewayMetrics())


@pytest.fixture(params=["redis", "redis-cluster"])
async def store(request, redis_server, redis_prefix):  # noqa: F811
    store = open_store("redis", url=redis_server.url, prefix=redis_prefix)
    assert store.cluster == (request.param == "redis-cluster")
    yield store
    await store.close()


async def test_live_processes_are_summed_and_silent_ones_left_out_then_removed(store):
    one, two = ScalingSignal(GatewayMetrics().registry, store), ScalingSignal(GatewayMetrics().registry, store)
    q1, q2 = queue(), queue()
    for _ in range(3):
        await q1.acquire("k", ())
    for _ in range(4):
        await q2.acquire("k", ())
    await one.refresh(POLICY, {"m": q1})
    await two.refresh(POLICY, {"m": q2})
    assert two.view("m")["demand"] == 7 and two.view("m")["needed"] == 2 and two.view()["fleet"] is True
    key = one.key("m")
    now = time.time()
    await store.client.hset(key, "silent", f"50 0 {now - STALE - 1:.3f}")  # died a moment ago: left out
    await store.client.hset(key, "long-gone", f"50 0 {now - FORGET - 1:.3f}")  # and long ago: removed
    await one.refresh(POLICY, {"m": q1})
    assert one.view("m")["demand"] == 7
    fields = {k.decode() if isinstance(k, bytes) else k for k in await store.client.hkeys(key)}
    assert "silent" in fields and "long-gone" not in fields
    assert await store.client.ttl(key) > 0  # the whole hash goes once every process has stopped writing


async def test_a_failing_store_leaves_the_process_counting_its_own_demand(store, caplog):
    signal = ScalingSignal(GatewayMetrics().registry, store)
    q = queue()
    for _ in range(2):
        await q.acquire("k", ())
    await store.close()  # every call now fails
    await signal.refresh(POLICY, {"m": q})
    assert signal.view("m")["demand"] == 2 and signal.view()["fleet"] is False
    assert "counts this gateway replica alone" in caplog.text
