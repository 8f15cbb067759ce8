"""A backend's cap holds across endpoint flaps: an endpoint removed and re-added (a flaky readiness probe, a
slice deleted and recreated) is the same backend, whose requests in flight still count against its cap.

The flaps drive `ReplicaSet.apply` as discovery does (the desired list without the endpoint, then with a fresh
replica of the same name and address), under a steady load; the backend counts what it serves at once."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from backends.replicas import UNKNOWN
from tools.simulator import SimConfig, create_app
from tests.support.asgi import InFlight
from tests.support.gateway import AUTH, one_model, running_gateway
from tests.support.servers import serve_app

CAP, CLIENTS = 8, 20


async def completions(http: httpx.AsyncClient, url: str, stop: asyncio.Event, statuses: list[int],
                      max_tokens: int = 20) -> None:
    """One client of the load: completions one after another until `stop`, each status kept."""
    body = {"model": "m", "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True}
    for _ in range(5000):  # bounded even if the test fails before it stops the load
        if stop.is_set():
            return
        statuses.append((await http.post(f"{url}/v1/completions", json=body)).status_code)


@pytest.mark.parametrize("gap", [0.0, 0.05, 0.3])
async def test_cap_holds_when_the_endpoint_flaps_under_load(gap):
    sim = SimConfig(model="served-m", step_base_ms=5, step_ms_per_seq=0, max_num_seqs=64)
    backend = InFlight(create_app(sim))
    policy = one_model("")
    async with serve_app(backend) as up:
        policy["models"][0]["backends"] = [{"url": up, "cap": CAP}]
        async with running_gateway(policy) as gw, httpx.AsyncClient(headers=AUTH, timeout=60) as http:
            replicas = gw.state.replicas
            (original,) = replicas.by_model["m"]
            stop = asyncio.Event()
            statuses: list[int] = []

            for _ in range(500):  # bounded: until the replica has passed its first probe
                if original.routable:
                    break
                await asyncio.sleep(0.02)
            clients = [asyncio.create_task(completions(http, gw.url, stop, statuses)) for _ in range(CLIENTS)]
            for _ in range(500):  # bounded: until the backend holds its cap's worth
                if backend.now == CAP:
                    break
                await asyncio.sleep(0.01)
            for _ in range(5):  # five flaps while the backend is full
                fresh = dataclasses.replace(original, in_flight=0, state=UNKNOWN, draining=False, failures=0)
                replicas.apply("m", [])
                if gap:
                    await asyncio.sleep(gap)
                replicas.apply("m", [fresh])
                await asyncio.sleep(0.3)
            stop.set()
            await asyncio.gather(*clients)
    assert backend.served > CAP * 5
    assert backend.peak <= CAP  # never past its cap, as the backend saw it, across every flap
    assert 200 in statuses
    if not gap:  # re-added at once: the replica never left, so no request saw the model without one
        assert set(statuses) == {200}


async def test_no_503_while_a_healthy_replica_exists_as_another_flaps_or_is_added():
    """Replica a stays healthy; b flaps (back at once, after 50 ms, 300 ms, and after 1.5 s when its drain is
    over and it returns as a new replica) and c is added: each new one is probed before it gets traffic, so
    under load nothing answers 503 and neither backend goes past its cap."""
    sim = SimConfig(model="served-m", step_base_ms=5, step_ms_per_seq=0, max_num_seqs=64)
    a, b, c = (InFlight(create_app(sim)) for _ in range(3))
    async with serve_app(a) as ua, serve_app(b) as ub, serve_app(c) as uc:
        policy = one_model("")
        policy["models"][0]["backends"] = [{"url": ua, "cap": CAP, "name": "a"}, {"url": ub, "cap": CAP, "name": "b"}]
        async with running_gateway(policy) as gw, httpx.AsyncClient(headers=AUTH, timeout=60) as http:
            replicas = gw.state.replicas
            ra, rb = replicas.by_model["m"]
            stop = asyncio.Event()
            statuses: list[int] = []

            for _ in range(500):  # bounded: until both have passed their first probe
                if ra.routable and rb.routable:
                    break
                await asyncio.sleep(0.02)
            clients = [asyncio.create_task(completions(http, gw.url, stop, statuses)) for _ in range(CLIENTS)]
            for gap in (0.0, 0.05, 0.3, 1.5):
                fresh = dataclasses.replace(rb, in_flight=0, state=UNKNOWN, draining=False, failures=0)
                replicas.apply("m", [ra])
                await asyncio.sleep(gap)
                replicas.apply("m", [ra, fresh])
                await asyncio.sleep(0.5)
            rc = dataclasses.replace(rb, name="c", url=uc, in_flight=0, state=UNKNOWN, draining=False, failures=0)
            replicas.apply("m", [ra, fresh, rc])
            for _ in range(500):  # bounded: until c gets traffic
                if c.served:
                    break
                await asyncio.sleep(0.02)
            stop.set()
            await asyncio.gather(*clients)
    assert c.served > 0 and len(statuses) > 100
    assert sorted(set(statuses)) == [200]  # a healthy replica existed throughout: no 503
    assert max(a.peak, b.peak, c.peak) <= CAP
