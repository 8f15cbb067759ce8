"""Routing through a real gateway: vLLM stats scraped from simulated replicas, affinity, and its metrics."""

import asyncio

import httpx

from tools.simulator import SimConfig, create_app
from tests.support.gateway import AUTH, one_model, running_gateway
from tests.support.probes import eventually
from tests.support.servers import serve_app

SLOW = SimConfig(model="served-m", step_base_ms=20, step_ms_per_seq=0)


def chat(system: str, user: str = "go on") -> dict:
    return {"model": "m", "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


async def test_scraper_reads_each_replicas_vllm_load():
    async with serve_app(create_app(SLOW)) as a, serve_app(create_app(SLOW)) as b, \
            running_gateway(one_model(a, b, routing={"scrape": {"interval": 0.05}})) as gw, \
            httpx.AsyncClient(timeout=30, headers=AUTH) as http:
        scraper, (ra, rb) = gw.state.scraper, gw.state.replicas.by_model["m"]
        await eventually(lambda: _true(scraper.stats(ra) is not None and scraper.stats(rb) is not None))
        body = {**chat("s"), "max_tokens": 200, "ignore_eos": True}
        sent = asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=body))

        async def one_running():
            s1, s2 = scraper.stats(ra), scraper.stats(rb)
            return s1 is not None and s2 is not None and (s1.running, s2.running) in ((1, 0), (0, 1))

        await eventually(one_running)  # the scrape saw the request running on exactly the replica it went to
        busy = ra if scraper.stats(ra).running == 1 else rb
        assert busy.in_flight == 1
        sent.cancel()
        assert await gw.metric("llm_gateway_vllm_scrape_errors_total") == 0


async def _true(value: bool) -> bool:
    return value


async def test_a_replica_without_metrics_is_stale_not_fatal():
    async def no_metrics(scope, receive, send):  # a backend that answers everything with 404
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async with serve_app(no_metrics) as dead, serve_app(create_app(SLOW)) as live, \
            running_gateway(one_model(dead, live, routing={"scrape": {"interval": 0.05}})) as gw:
        dead_replica = gw.state.replicas.by_model["m"][0]
        await eventually(lambda: gw.metric("llm_gateway_vllm_scrape_errors_total", backend=dead_replica.name))
        assert gw.state.scraper.stats(dead_replica) is None
        assert gw.state.scraper.stats(gw.state.replicas.by_model["m"][1]) is not None


async def test_a_conversation_stays_on_one_replica_and_decisions_are_counted():
    async with serve_app(create_app(SLOW)) as a, serve_app(create_app(SLOW)) as b, \
            running_gateway(one_model(a, b)) as gw, httpx.AsyncClient(timeout=30, headers=AUTH) as http:
        system = "You are a build agent. Follow the plan. " * 30
        seen = set()
        body = chat(system, "turn 0: " + "list what the plan needs " * 4)
        for turn in range(6):
            if turn:  # each turn resends the history and adds to it, as an agent does
                body["messages"] += [{"role": "assistant", "content": f"done with step {turn}"},
                                     {"role": "user", "content": f"turn {turn}: " + "now the next step " * 5}]
            r = await http.post(f"{gw.url}/v1/chat/completions", json=body)
            assert r.status_code == 200
            counts = {rep.name: await gw.metric("llm_gateway_requests_total", backend=rep.name, status="200")
                      for rep in gw.state.replicas.by_model["m"]}
            seen |= {name for name, n in counts.items() if n}
        assert len(seen) == 1  # every turn went to the replica that served the first
        assert await gw.metric("llm_gateway_routing_decisions_total", scorer="prefix-affinity", outcome="hit") == 5
        assert await gw.metric("llm_gateway_routing_prefix_match_ratio_count") == 6
