"""Requests queued for a slot when every replica they may use goes down leave the line at once: a key that may
rent is served by the rented provider (`overflow.when_unavailable`), a private one gets a 503 with Retry-After,
well before the queue's max_wait; none of them waits it out for a 429.

The owned backend is a slow simulator behind a TCP proxy that takes it down (refused connections, the request in
flight cut off), capped at 1 in flight so that a long request holds its only slot; the rented provider is the
stand-in process of tests/integration/test_overflow.py, whose log shows what reached it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from backends.replicas import Replica
from tools.simulator import SimConfig, create_app
from tests.integration import test_overflow
from tests.integration.test_overflow import issue
from tests.support.gateway import RunningGateway, running_gateway
from tests.support.redis_fixtures import redis_prefix, redis_server, redis_standalone  # noqa: F401
from tests.support.rented_standin import read_log
from tests.support.servers import free_port, serve_app
from tests.support.tcp_proxy import TcpProxy, tcp_proxy

SLOW = SimConfig(model="served-m", step_base_ms=20, step_ms_per_seq=0)  # ~50 tokens/s
MAX_WAIT = 30  # the queue's bound: a waiter failed "at once" answers far sooner
FAST = 10  # seconds: generous for a loaded machine, a third of MAX_WAIT
standin = test_overflow.standin  # the rented stand-in process (a fixture): its URL, its log, its key


def body(max_tokens: int) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "ignore_eos": True}


LONG = body(1900)  # ~40 s: holds the slot for as long as the test needs
SHORT = body(5)


def policy(backends: list[dict], rented: str, **model) -> dict:
    return {
        "providers": [{"name": "standin", "base_url": rented, "api_key_env": "STANDIN_KEY",
                       "models": {"m": "rented-model"}, "allow_private_address": True}],
        "models": [{"name": "m", "served_name": "served-m", "backends": backends,
                    "queue": {"max_depth": 100, "max_wait": MAX_WAIT},
                    # far past the queue's expected wait: keys that may rent queue as the private ones do
                    "overflow": {"provider": "standin", "when_wait_exceeds": 120}, **model}],
        "health": {"interval": 0.2, "backoff_initial": 0.2, "backoff_max": 1},
    }


async def until(what: Callable[[], object], message: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {message}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def proxied_backends(count: int) -> AsyncIterator[list[TcpProxy]]:
    """`count` proxies, each a replica of its own in front of one slow simulator."""
    async with serve_app(create_app(SLOW)) as sim, contextlib.AsyncExitStack() as stack:
        port = int(sim.rsplit(":", 1)[1])
        yield [await stack.enter_async_context(tcp_proxy("127.0.0.1", port, free_port())) for _ in range(count)]


class Client:
    def __init__(self, gw: RunningGateway, http: httpx.AsyncClient) -> None:
        self.gw, self.http = gw, http

    def send(self, key: str, rid: str, payload: dict) -> asyncio.Task[httpx.Response]:
        return asyncio.create_task(self.http.post(
            f"{self.gw.url}/v1/chat/completions", json=payload,
            headers={"authorization": f"Bearer {key}", "x-request-id": rid}))

    @property
    def replicas(self) -> list[Replica]:
        return self.gw.state.replicas.by_model["m"]

    @property
    def depth(self) -> int:
        return self.gw.state.admission.queues["m"].depth

    async def hold_slot(self, key: str, rid: str) -> tuple[asyncio.Task[httpx.Response], Replica]:
        """A long request in flight: which replica's slot it holds."""
        busy = {r.name for r in self.replicas if r.in_flight}
        task = self.send(key, rid, LONG)
        await until(lambda: any(r.in_flight and r.name not in busy for r in self.replicas), "the long call is sent")
        return task, next(r for r in self.replicas if r.in_flight and r.name not in busy)

    async def queue_both(self, private: str, renter: str, tag: str) -> tuple[asyncio.Task, asyncio.Task]:
        """A private call and a call of a key that may rent, both waiting in the queue."""
        depth = self.depth
        waiting = self.send(private, f"priv-{tag}", SHORT), self.send(renter, f"rent-{tag}", SHORT)
        await until(lambda: self.depth == depth + 2, "both calls queue")
        return waiting

    async def fail_fast(self, waiting: tuple[asyncio.Task, asyncio.Task], down: Callable, log: str, tag: str) -> None:
        """Take the last replica down: the private waiter gets its 503 and the other is rented, both soon."""
        start = time.monotonic()
        await down()
        private, renter = await asyncio.wait_for(asyncio.gather(*waiting), MAX_WAIT + 15)
        elapsed = time.monotonic() - start
        assert private.status_code == 503, private.text
        assert int(private.headers["retry-after"]) >= 1
        assert private.json()["error"]["code"] == "no_backend_available"
        assert renter.status_code == 200, renter.text
        assert renter.headers["x-gateway-served-by"] == "rented"
        assert elapsed < FAST, f"the waiters answered after {elapsed:.1f} s (max_wait {MAX_WAIT} s)"
        rented = {e["request_id"] for e in read_log(log)}
        assert f"rent-{tag}" in rented and f"priv-{tag}" not in rented  # private data never left
        assert self.depth == 0
        assert await self.gw.metric("llm_gateway_queue_depth", model="m") == 0


@pytest.fixture(params=["sqlite", "redis"])
def store(request) -> dict:
    if request.param == "sqlite":
        return {}
    server, prefix = request.getfixturevalue("redis_server"), request.getfixturevalue("redis_prefix")
    return {"store": {"kind": "redis", "url": server.url, "prefix": prefix}}


async def test_the_only_replica_going_down_fails_its_waiters_at_once(standin, store):
    rented_url, log, _ = standin
    async with proxied_backends(1) as (proxy,), \
            running_gateway({**policy([{"url": proxy.url, "cap": 1}], rented_url), **store}) as gw, \
            httpx.AsyncClient(timeout=MAX_WAIT + 30, limits=httpx.Limits(max_connections=20)) as http:
        c = Client(gw, http)
        private, renter = await issue(gw, "private_only"), await issue(gw, "allow_rented")
        await until(lambda: c.replicas[0].routable, "the replica passes its first probe")
        long, replica = await c.hold_slot(private, "long")
        waiting = await c.queue_both(private, renter, "1")

        await c.fail_fast(waiting, proxy.down, log, "1")
        assert (await long).status_code >= 500  # cut off with its backend
        assert await gw.metric("llm_gateway_admission_rejected_total", model="m", reason="replicas_down") == 2
        assert not replica.routable

        # no slot leaked: back up, the replica serves new calls, one at a time as its cap says
        await proxy.up()
        await until(lambda: replica.routable, "the replica is back")
        assert replica.in_flight == 0
        queue = gw.state.admission.queues["m"]
        if hasattr(queue, "fleet"):
            await until(lambda: queue.fleet_count[replica] == 0, "the fleet's leases are given back")
        again = await asyncio.gather(*(c.send(k, f"after-{i}", SHORT) for i, k in enumerate((private, renter) * 2)))
        assert [r.status_code for r in again] == [200] * 4
        assert all(r.headers["x-gateway-served-by"] == "owned" for r in again)
        assert replica.in_flight == 0


async def test_one_of_two_replicas_going_down_keeps_the_waiters_for_the_other(standin):
    rented_url, log, _ = standin
    async with proxied_backends(2) as proxies, \
            running_gateway(policy([{"url": p.url, "cap": 1, "name": n} for p, n in zip(proxies, "ab")],
                                   rented_url)) as gw, \
            httpx.AsyncClient(timeout=MAX_WAIT + 30, limits=httpx.Limits(max_connections=20)) as http:
        c = Client(gw, http)
        private, renter = await issue(gw, "private_only"), await issue(gw, "allow_rented")
        await until(lambda: all(r.routable for r in c.replicas), "both replicas pass their first probe")
        proxy_of = {r.name: p for r, p in zip(c.replicas, proxies)}
        long, first = await c.hold_slot(private, "long")
        medium = c.send(private, "medium", body(100))  # ~2 s on the other replica
        await until(lambda: all(r.in_flight for r in c.replicas), "the other replica is busy too")
        other = next(r for r in c.replicas if r is not first)
        waiting = await c.queue_both(private, renter, "1")

        await proxy_of[first.name].down()
        served = await asyncio.wait_for(asyncio.gather(*waiting), MAX_WAIT)
        assert [r.status_code for r in served] == [200, 200]
        assert all(r.headers["x-gateway-served-by"] == "owned" for r in served)  # by the other replica
        assert (await medium).status_code == 200
        retried = await long  # its replica went down before its answer's head: tried again on the other one
        assert retried.status_code == 200 and retried.headers["x-gateway-attempts"] == "2"
        assert not first.routable and other.routable and other.in_flight == 0
        assert read_log(log) == []

        # the last one going down fails the waiters at once
        long, _ = await c.hold_slot(private, "long-2")
        waiting = await c.queue_both(private, renter, "2")
        await c.fail_fast(waiting, proxy_of[other.name].down, log, "2")
        assert (await long).status_code >= 500
        assert other.in_flight == 0 and first.in_flight == 0


async def test_with_autoscaling_private_waiters_wait_for_a_replica_and_renters_rent(standin):
    """Scale from zero: a request that cannot rent waits for a replica to (re)start rather than fail, as it does
    when none runs when it arrives; one that may rent rents at once, as it would then."""
    rented_url, log, _ = standin
    rules = policy([{"url": "", "cap": 1}], rented_url,
                   autoscaling={"cold_start_wait": MAX_WAIT, "replica_cap": 1})
    async with proxied_backends(1) as (proxy,):
        rules["models"][0]["backends"][0]["url"] = proxy.url
        async with running_gateway(rules) as gw, \
                httpx.AsyncClient(timeout=MAX_WAIT + 30, limits=httpx.Limits(max_connections=20)) as http:
            c = Client(gw, http)
            private, renter = await issue(gw, "private_only"), await issue(gw, "allow_rented")
            await until(lambda: c.replicas[0].routable, "the replica passes its first probe")
            long, replica = await c.hold_slot(private, "long")
            waiting_private, waiting_renter = await c.queue_both(private, renter, "1")

            start = time.monotonic()
            await proxy.down()
            rented = await asyncio.wait_for(waiting_renter, MAX_WAIT)
            assert rented.status_code == 200 and rented.headers["x-gateway-served-by"] == "rented"
            assert time.monotonic() - start < FAST
            assert (await long).status_code >= 500
            assert not waiting_private.done() and c.depth == 1  # still waiting for a replica

            await proxy.up()
            served = await asyncio.wait_for(waiting_private, MAX_WAIT)
            assert served.status_code == 200 and served.headers["x-gateway-served-by"] == "owned"
            assert {e["request_id"] for e in read_log(log)} == {"rent-1"}
            assert c.depth == 0 and replica.in_flight == 0
