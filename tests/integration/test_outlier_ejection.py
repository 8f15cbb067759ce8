"""Outlier ejection (policies/ejection.py) against simulated vLLM replicas made to fail (tests/support/faulty.py):
a replica that answers 5xx again and again, or whose first tokens come far slower than its peers', is taken out
of routing, /admin/replicas names the rule and until when, and never more than the allowed share of a model's
replicas is out. (The backoff's end and growth are tested on a clock of the test's own:
tests/unit/test_ejection.py.)"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from gateway.admin.auth import mint_token
from policies.config import Admin
from tests.support.faulty import Faulty
from tests.support.gateway import TEST_KEY, one_model, running_gateway
from tests.support.servers import serve_app


def sdk(gw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=30)


async def ejected(http: httpx.AsyncClient, gw) -> dict[str, tuple[str, float]]:
    """Replica name -> (rule, until) for each ejected replica of model m, from /admin/replicas."""
    view = (await http.get(f"{gw.url}/admin/replicas")).json()["m"]
    return {r["name"]: (r["ejected_by"], r["ejected_until"]) for r in view if r["ejected_by"] is not None}


async def test_a_replica_failing_again_and_again_is_ejected_and_named_in_admin_within_the_share(monkeypatch):
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", "s" * 40)
    viewer = {"authorization": f"Bearer {mint_token(Admin(), 600, role='viewer')}"}
    sims = [Faulty() for _ in range(3)]
    async with serve_app(sims[0]) as u0, serve_app(sims[1]) as u1, serve_app(sims[2]) as u2:
        policy = one_model(u0, u1, u2)
        policy["health"] = {"interval": 60, "failure_threshold": 100}  # only ejection may take a replica out
        policy["models"][0]["routing"] = "least-in-flight"
        policy["models"][0]["ejection"] = {"consecutive_failures": 3, "base_seconds": 60}
        policy["models"][0]["retries"] = {"budget": 1.0}  # here the budget is not what is tested: every retry may go
        async with running_gateway(policy) as gw, httpx.AsyncClient(headers=viewer, timeout=30) as http:
            client = sdk(gw)
            sims[0].mode = "5xx"
            assert await ejected(http, gw) == {}
            for i in range(60):  # bounded: until the failing replica had its third 5xx in a row
                answer = await client.chat.completions.create(
                    model="m", max_tokens=2, messages=[{"role": "user", "content": f"q{i}"}])
                assert answer.choices[0].message.content  # retried elsewhere: the client sees no error
                if sims[0].requests >= 3:
                    break
            now = time.time()
            out = await ejected(http, gw)
            assert list(out) == ["m-0"] and out["m-0"][0] == "consecutive_failures"
            assert now < out["m-0"][1] <= now + 60.5
            assert await gw.metric("llm_gateway_replica_ejections_total", backend="m-0",
                                   rule="consecutive_failures") == 1
            # out: it gets no request while its backoff lasts
            for i in range(10):
                await client.chat.completions.create(model="m", max_tokens=2,
                                                     messages=[{"role": "user", "content": f"r{i}"}])
            assert sims[0].requests == 3
            # a second failing replica stays in: at most int(0.5 x 3) = 1 of three may be out at once
            sims[1].mode = "5xx"
            for i in range(30):  # bounded: until the second one failed past the rule
                await client.chat.completions.create(model="m", max_tokens=2,
                                                     messages=[{"role": "user", "content": f"s{i}"}])
                if sims[1].requests >= 4:
                    break
            assert sims[1].requests >= 4 and list(await ejected(http, gw)) == ["m-0"]
            view = {r["name"]: r for r in (await http.get(f"{gw.url}/admin/replicas")).json()["m"]}
            assert view["m-0"]["ejections"] == 1 and view["m-1"]["ejections"] == 0


async def test_a_replica_whose_first_tokens_come_far_slower_than_its_peers_is_ejected_by_ttft(monkeypatch):
    """Three replicas under streaming load (three streams at once, least-in-flight: one to each); one takes a
    second longer to prefill (its first token ~1 s, its peers' a few ms, far past `ttft_ratio` 3 even on a loaded
    machine). Once it and a peer have `ttft_min_samples` streams, it is ejected by the TTFT rule, named so in
    /admin/replicas and the metric, and gets no stream while out; every client stream ends whole."""
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", "s" * 40)
    viewer = {"authorization": f"Bearer {mint_token(Admin(), 600, role='viewer')}"}
    slow, *peers = sims = [Faulty(prefill_base_ms=1000), Faulty(), Faulty()]
    async with serve_app(sims[0]) as u0, serve_app(sims[1]) as u1, serve_app(sims[2]) as u2:
        policy = one_model(u0, u1, u2)
        policy["health"] = {"interval": 60, "failure_threshold": 100}  # only ejection may take a replica out
        policy["models"][0]["routing"] = "least-in-flight"
        policy["models"][0]["ejection"] = {"ttft_ratio": 3, "ttft_min_samples": 4, "base_seconds": 60}
        async with running_gateway(policy) as gw, httpx.AsyncClient(headers=viewer, timeout=30) as http:
            client = sdk(gw)

            async def stream(tag: str) -> str:
                chunks = await client.chat.completions.create(
                    model="m", max_tokens=3, stream=True, messages=[{"role": "user", "content": tag}])
                text = [c.choices[0].delta.content or "" async for c in chunks if c.choices]
                return "".join(text)

            for i in range(12):  # bounded: rounds of three streams, until the slow one is out
                assert all(await asyncio.gather(*(stream(f"q{i}-{n}") for n in range(3))))
                if await ejected(http, gw):
                    break
            out = await ejected(http, gw)
            assert list(out) == ["m-0"] and out["m-0"][0] == "ttft", (out, [s.requests for s in sims])
            assert await gw.metric("llm_gateway_replica_ejections_total", backend="m-0", rule="ttft") == 1
            served = slow.requests
            assert served >= 4  # it had the samples the rule needs before it was judged
            for i in range(3):  # out: no stream reaches it while its backoff lasts
                assert all(await asyncio.gather(*(stream(f"r{i}-{n}") for n in range(3))))
            assert slow.requests == served and sum(p.requests for p in peers) >= 2 * 4 + 9
