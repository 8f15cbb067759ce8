"""The gateway over simulated vLLM replicas: disconnects abort upstream work, load spreads over replicas.

The simulator counts client aborts in vllm:request_success_total{finished_reason="abort"} (real vLLM 0.32
does not; tests/e2e checks real vLLM through its log instead).
"""

import asyncio

import httpx

from tools.simulator import SimConfig, create_app
from tests.support.gateway import AUTH, one_model, running_gateway
from tests.support.probes import metric_sum
from tests.support.servers import serve_app

SLOW = SimConfig(model="served-m", step_base_ms=20, step_ms_per_seq=0)  # ~50 tokens/s per request


async def sim_metric(client: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    return metric_sum((await client.get(f"{url}/metrics")).text, name, **labels)


async def wait_until(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def test_disconnect_aborts_upstream_for_streams_and_plain_requests():
    async with serve_app(create_app(SLOW)) as sim, running_gateway(one_model(sim)) as gw, \
            httpx.AsyncClient(timeout=10, headers=AUTH) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": True}

        async with http.stream("POST", f"{gw.url}/v1/chat/completions", json={**body, "stream": True}) as r:
            async for _ in r.aiter_lines():
                break  # the first event arrived: the request is running in the engine; now hang up

        async def aborted(n):
            return await sim_metric(http, sim, "vllm:request_success_total", finished_reason="abort") == n

        await wait_until(lambda: aborted(1))

        plain = asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=body))
        await wait_until(lambda: sim_metric_running(http, sim))
        plain.cancel()  # the client gives up on a non-streamed request while the backend generates
        await wait_until(lambda: aborted(2))
        assert await sim_metric(http, sim, "vllm:num_requests_running") == 0
        assert await gw.metric("llm_gateway_backend_in_flight_requests") == 0
        assert await gw.metric("llm_gateway_requests_total", model="m", status="499") == 2


async def sim_metric_running(http, sim) -> bool:
    return await sim_metric(http, sim, "vllm:num_requests_running") == 1


async def test_concurrent_load_spreads_over_replicas_and_leaves_nothing_in_flight():
    async with serve_app(create_app(SLOW)) as s1, serve_app(create_app(SLOW)) as s2, \
            running_gateway(one_model(s1, s2)) as gw, httpx.AsyncClient(timeout=30, headers=AUTH) as http:
        body = {"model": "m", "prompt": "x", "max_tokens": 10, "ignore_eos": True, "stream": True}

        async def one():
            async with http.stream("POST", f"{gw.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                return [line async for line in r.aiter_lines() if line.startswith("data: ")]

        results = await asyncio.gather(*(one() for _ in range(20)))
        assert all(lines[-1] == "data: [DONE]" for lines in results)
        served = [await sim_metric(http, s, "vllm:request_success_total") for s in (s1, s2)]
        assert sum(served) == 20 and min(served) >= 8  # least-in-flight keeps the two replicas even
        assert await gw.metric("llm_gateway_backend_in_flight_requests") == 0
        assert await gw.metric("llm_gateway_completion_tokens_total", model="m") == 200
