"""Precise prefix routing from vLLM's own KV cache events, end to end: the session's two vLLM servers publish
their events (conftest.py), a gateway binds both addresses, and its precise-prefix scorer routes by the blocks
each server reports. Prompts are primed straight on one server (never through the gateway, so only the events
can tell it), and where a request lands is read from vLLM's own counters.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time

import httpx
import pytest

from tests.e2e.conftest import e2e_policy, gateway_process
from tests.e2e.test_routing_vllm import SUCCESS, WORDS, counters, served_by, system_prompt, wait_for
from tests.e2e.vllm_procs import VLLMServer, free_port

CACHE_TOKENS = 65536  # the session servers' KV cache (vllm_procs.BASE_ARGS): 512 blocks of 128 tokens on CPU


@pytest.fixture(scope="module")
def kv_gateway(vllm_servers, tmp_path_factory):
    policy = e2e_policy(vllm_servers, free_port())
    policy["models"] = [{"name": "kv", "routing": "precise", "backends": [
        {"url": srv.base_url, "name": f"kv-{key}", "served_name": srv.served_model_name,
         "kv_events": {"bind": f"tcp://127.0.0.1:{srv.kv_events_port}"}}
        for key, srv in vllm_servers.items()]}]
    tokenizer = str(vllm_servers["a"].model_dir)
    policy["routing"] = {"profiles": {"precise": {"scorers": [
        # (the servers published before this gateway subscribed: their indexes start blind, and would tie for
        # blind_seconds, the default 60 s; this test primes every prefix it routes after subscribing)
        {"name": "precise-prefix", "weight": 4, "params": {"tokenizer": tokenizer, "blind_seconds": 0}},
        {"name": "vllm-queue", "weight": 2}, {"name": "least-in-flight", "weight": 1}]}}}
    with gateway_process(policy, tmp_path_factory.mktemp("kv-gateway")) as gw:
        yield gw


def chat(tag: str) -> list[dict]:
    """~420 tokens: three of the CPU build's 128-token blocks."""
    return [{"role": "system", "content": system_prompt(tag, 4000)}, {"role": "user", "content": f"question of {tag}"}]


def direct(server: VLLMServer, messages: list[dict]) -> None:
    r = httpx.post(f"{server.api_base}/chat/completions", timeout=60, trust_env=False,
                   json={"model": server.served_model_name, "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text


def via_gateway(gw, servers: dict[str, VLLMServer], messages: list[dict]) -> str:
    before = counters(servers, SUCCESS)
    r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=60, headers={"authorization": f"Bearer {gw.key}"},
                   json={"model": "kv", "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    delta = served_by(servers, before)
    return next(key for key, n in delta.items() if n == 1)


def indexed(gw, key: str, what: str = "stored") -> float:
    return gw.metric(f"llm_gateway_kv_blocks_{what}_total", backend=f"kv-{key}")


def prime(gw, server: VLLMServer, key: str, messages: list[dict], blocks: int = 3) -> None:
    """Send `messages` straight to the server, once the gateway's subscription is live (events sent before it
    reached vLLM are lost: distinct prompts are sent until one shows), and wait until its blocks are indexed."""
    def live() -> bool:
        before = indexed(gw, key)
        direct(server, chat(f"probe {secrets.token_hex(4)}"))
        return wait_until(lambda: indexed(gw, key) > before, 2)

    wait_for(live, 60, f"the gateway's subscription to {key}'s events")
    before = indexed(gw, key)
    direct(server, messages)
    wait_for(lambda: indexed(gw, key) - before >= blocks, 30, f"the gateway to index {blocks} blocks of {key}")


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def flood(server: VLLMServer, tokens: int) -> None:
    """Distinct prompts of ~440 tokens straight to the server, `tokens` in all: more than its cache holds."""
    rng = random.Random(secrets.token_hex(4))
    prompts = [" ".join(rng.choice(WORDS) for _ in range(440)) for _ in range(tokens // 440 + 1)]
    limit = asyncio.Semaphore(8)
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        async def one(prompt: str) -> None:
            async with limit:
                r = await client.post(f"{server.api_base}/completions",
                                      json={"model": server.served_model_name, "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
        await asyncio.gather(*(one(p) for p in prompts))


def test_the_index_sees_real_blocks_and_the_scorer_follows_them_through_an_eviction(kv_gateway, vllm_servers):
    gw, servers, run = kv_gateway, vllm_servers, secrets.token_hex(3)

    def hits() -> float:
        return gw.metric("llm_gateway_routing_decisions_total", scorer="precise-prefix", outcome="hit")

    for key in ("a", "b"):  # a prompt only `key` has seen: the gateway sends it there
        messages = chat(f"primed on {key} in run {run}")
        prime(gw, servers[key], key, messages)
        before = hits()
        assert via_gateway(gw, servers, messages) == key
        assert hits() == before + 1
    # a prompt on b, then b's cache overflows (b evicts it) and the prompt is served on a: the gateway follows
    messages = chat(f"evicted from b in run {run}")
    prime(gw, servers["b"], "b", messages)
    removed = indexed(gw, "b", "removed")
    # 1.2x its cache in tokens: 179 prompts of 3 full blocks and a partial one (not cached, but taken from the
    # free queue too), 716 blocks through a queue of 512: every block freed before the flood is reused
    asyncio.run(flood(servers["b"], int(CACHE_TOKENS * 1.2)))
    wait_for(lambda: indexed(gw, "b", "removed") - removed >= 3, 30, "b's evictions in the index")
    prime(gw, servers["a"], "a", messages)
    assert via_gateway(gw, servers, messages) == "a"
    # vLLM agrees: b no longer holds that prefix
    hits_b = servers["b"].metric("vllm:prefix_cache_hits_total")
    direct(servers["b"], messages)
    assert servers["b"].metric("vllm:prefix_cache_hits_total") - hits_b < 128
