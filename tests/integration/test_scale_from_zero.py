"""Scale from zero through discovery: the real kubernetes client against kmock, a simulator behind the endpoint.
A model whose Service has no endpoint holds its requests (streams and plain, two priority classes) while GET
/scaling says it needs a replica; an endpoint that appears seconds later serves every one of them, better class
first; with no endpoint past autoscaling.cold_start_wait, a 503 in the route's shape with Retry-After.
"""

import asyncio
import time

import httpx
from kubernetes import client

from tools.simulator import SimConfig
from tools.simulator import create_app as simulator
from gateway.app import create_app
from policies.config import Policy
from tests.integration.test_discovery_kmock import NS, call, cluster, endpoint_slice, endpoints
from tests.integration.test_policy_reload import until
from tests.support.gateway import AUTH, default_key_record
from tests.support.redis_fixtures import redis_prefix, redis_server, redis_standalone  # noqa: F401
from tests.support.servers import free_port, serve_app

SIM = SimConfig(model="served", step_base_ms=25)  # 8-token answers of ~0.2 s


def policy(tmp: str, kubeconfig_path: str, cold_start_wait: float) -> Policy:
    return Policy.model_validate({
        "store": {"kind": "sqlite", "path": f"{tmp}/keys.db"},
        "health": {"interval": 0.5, "backoff_initial": 0.2},
        "kubernetes": {"kubeconfig": kubeconfig_path},
        "priorities": {"classes": [{"name": "interactive"}, {"name": "batch", "max_wait": 1}]},
        "models": [{"name": "m", "served_name": "served", "queue": {"max_wait": 1},
                    "discovery": {"kind": "kubernetes", "namespace": NS, "service": "vllm", "port": "http", "cap": 2},
                    "autoscaling": {"cold_start_wait": cold_start_wait, "headroom": 0, "smoothing_seconds": 0}}],
    })


async def ask(http: httpx.AsyncClient, url: str, stream: bool, klass: str) -> tuple[int, float, str]:
    """(status, the gateway's queue wait in ms, the body) of one chat completion."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream}
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                           headers={**AUTH, "x-priority-class": klass}) as r:
        text = (await r.aread()).decode()
    return r.status_code, float(r.headers.get("x-gateway-queue-ms", "nan")), text


async def test_requests_wait_for_the_first_replica_and_are_all_served_better_class_first():
    port, host = free_port(), "127.0.0.6"
    async with cluster() as (kubeconfig_path, api, tmp), serve_app(simulator(SIM), port=port, host=host):
        slices = client.DiscoveryV1Api(api)
        await call(slices.create_namespaced_endpoint_slice, NS, endpoint_slice("vllm-abc", "vllm", [], port))
        app = create_app(policy(tmp, kubeconfig_path, cold_start_wait=60))
        gw = app.state
        await gw.store.create_key(default_key_record(client_priority=True))
        async with serve_app(app) as url, httpx.AsyncClient(timeout=90) as http:
            assert (await http.get(f"{url}/scaling", params={"model": "m"})).json()["needed"] == 0
            shapes = [(stream, klass) for klass in ("batch", "interactive") for stream in (True, False, True)]
            calls = []
            for stream, klass in shapes:  # the worse class queues first: the better one is still served first
                calls.append(asyncio.create_task(ask(http, url, stream, klass)))
                await asyncio.sleep(0.05)
            await until(lambda: gw.admission.queues["m"].depth == 6, 30)
            await asyncio.sleep(1.5)  # past queue.max_wait and batch's max_wait: the cold start bound holds them

            async def scaling() -> dict:
                return (await http.get(f"{url}/scaling", params={"model": "m"})).json()

            deadline = time.monotonic() + 10
            # 3 interactive waiting at a cap of 2: 2 replicas; the 3 batch lines are batch demand, apart
            while (view := await scaling())["needed"] != 2 or view["batch_demand"] != 3:
                assert time.monotonic() < deadline, view
                await asyncio.sleep(0.1)
            assert view["replicas"] == 0 and view["queued"] == 6 and not any(c.done() for c in calls)
            metrics = (await http.get(f"{url}/metrics")).text
            assert 'llm_gateway_replicas_needed{model="m"} 2.0' in metrics
            assert 'llm_gateway_batch_demand{model="m"} 3.0' in metrics

            await call(slices.patch_namespaced_endpoint_slice, "vllm-abc", NS, {"endpoints": endpoints([host])})
            results = await asyncio.wait_for(asyncio.gather(*calls), 60)
            assert [status for status, _, _ in results] == [200] * 6  # none lost
            for (stream, _), (_, _, text) in zip(shapes, results, strict=True):
                assert ("data: [DONE]" in text) == stream
            waits = {klass: sorted(w for (_, klass_), (_, w, _) in zip(shapes, results, strict=True)
                                   if klass_ == klass) for klass in ("batch", "interactive")}
            assert waits["interactive"][-1] < waits["batch"][0], waits  # better class first, as in any queue
            assert waits["interactive"][0] > 1500, waits  # they did wait for the replica
            await until(lambda: gw.scaling.view("m")["needed"] == 0, 10)


async def test_no_replica_within_the_bound_is_a_503_in_the_routes_shape_with_retry_after():
    async with cluster() as (kubeconfig_path, api, tmp):
        slices = client.DiscoveryV1Api(api)
        await call(slices.create_namespaced_endpoint_slice, NS, endpoint_slice("vllm-abc", "vllm", [], free_port()))
        app = create_app(policy(tmp, kubeconfig_path, cold_start_wait=1.5))
        await app.state.store.create_key(default_key_record())
        async with serve_app(app) as url, httpx.AsyncClient(timeout=30, headers=AUTH) as http:
            started = time.monotonic()
            chat, messages = await asyncio.gather(
                http.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                http.post(f"{url}/v1/messages", json={"model": "m", "max_tokens": 8,
                                                      "messages": [{"role": "user", "content": "hi"}]}))
            assert time.monotonic() - started >= 1.4  # held for the bound, not refused at once
            for r in (chat, messages):
                assert r.status_code == 503 and r.headers["retry-after"] == "30", r.text
            error = chat.json()["error"]
            assert error["code"] == "no_replica_started" and "no replica running" in error["message"]
            anthropic = messages.json()
            assert anthropic["type"] == "error" and "no replica running" in anthropic["error"]["message"]


async def test_on_a_shared_redis_two_gateways_hold_their_requests_until_the_replica_appears(
        redis_server, redis_prefix):  # noqa: F811
    """The chart's autoscaled setup: several gateway replicas on Redis, caps counted across them."""
    port, host = free_port(), "127.0.0.7"
    async with cluster() as (kubeconfig_path, api, tmp), serve_app(simulator(SIM), port=port, host=host):
        slices = client.DiscoveryV1Api(api)
        await call(slices.create_namespaced_endpoint_slice, NS, endpoint_slice("vllm-abc", "vllm", [], port))
        base = policy(tmp, kubeconfig_path, cold_start_wait=60).model_dump(exclude_unset=True)
        shared = Policy.model_validate({**base, "store": {"kind": "redis", "url": redis_server.url,
                                                          "prefix": redis_prefix}})
        apps = [create_app(shared), create_app(shared)]
        await apps[0].state.store.create_key(default_key_record(client_priority=True))
        async with serve_app(apps[0]) as url_a, serve_app(apps[1]) as url_b, httpx.AsyncClient(timeout=90) as http:
            calls = [asyncio.create_task(ask(http, url, stream, "interactive"))
                     for url in (url_a, url_b) for stream in (True, False)]
            await until(lambda: all(a.state.admission.queues["m"].depth == 2 for a in apps), 30)
            deadline = time.monotonic() + 10
            while (await http.get(f"{url_a}/scaling", params={"model": "m"})).json()["demand"] != 4:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            await call(slices.patch_namespaced_endpoint_slice, "vllm-abc", NS, {"endpoints": endpoints([host])})
            results = await asyncio.wait_for(asyncio.gather(*calls), 60)
            assert [status for status, _, _ in results] == [200] * 4, [text[:300] for _, _, text in results]


async def test_on_a_shared_redis_a_replica_that_appears_serves_a_gateway_that_had_no_waiters(
        redis_server, redis_prefix):  # noqa: F811
    """A scale-up seen by a gateway with nobody waiting: its next request takes a slot of the new replica at once
    (the fleet's count of that replica starts at 0 there, not at its first lease renewal)."""
    port, host = free_port(), "127.0.0.8"
    async with cluster() as (kubeconfig_path, api, tmp), serve_app(simulator(SIM), port=port, host=host):
        slices = client.DiscoveryV1Api(api)
        await call(slices.create_namespaced_endpoint_slice, NS, endpoint_slice("vllm-abc", "vllm", [], port))
        base = policy(tmp, kubeconfig_path, cold_start_wait=60).model_dump(exclude_unset=True)
        shared = Policy.model_validate({**base, "caps": {"lease_seconds": 300},  # no renewal during the test
                                        "store": {"kind": "redis", "url": redis_server.url, "prefix": redis_prefix}})
        app = create_app(shared)
        gw = app.state
        await gw.store.create_key(default_key_record())
        async with serve_app(app) as url, httpx.AsyncClient(timeout=30) as http:
            await call(slices.patch_namespaced_endpoint_slice, "vllm-abc", NS, {"endpoints": endpoints([host])})
            await until(lambda: any(r.routable for r in gw.replicas.by_model.get("m", [])), 30)
            status, _, text = await ask(http, url, False, "interactive")
            assert status == 200, text[:300]
