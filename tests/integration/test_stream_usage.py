"""A rented stream is metered whatever the provider's JSON looks like, so a budget holds on streams as on plain calls.

The stand-in provider writes `"usage": {` and `"choices": []` with json.dumps's spaces, usage first with an
unknown field in it (`--usage spaced`), or sends no usage at all (`--usage omitted`: the gateway then charges
its estimate, marked as estimated in the ledger). The owned backend is down, so every call the
budget allows is rented; past the budget the key gets 503 and the provider sees no more calls.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from gateway.admin.auth import mint_token
from policies.budget import period_bounds
from policies.config import Admin
from policies.keys import KeyBudget, KeyRecord, hash_key, new_key, new_key_id
from policies.ledger.sums import COMPLETION, COST, ESTIMATED, PROMPT, REQUESTS
from tests.support.gateway import running_gateway
from tests.support.rented_standin import read_log, running_standin
from tests.support.servers import free_port

BUDGET = 3e-5  # a call with the stand-in's usage (11 prompt, 5 completion) costs 2.1e-5: two calls spend it
CALLS = 10


@pytest.fixture
def provider(request, tmp_path, monkeypatch):
    log = str(tmp_path / "rented.jsonl")
    with running_standin(monkeypatch, log, "--usage", request.param) as (url, _key):
        yield url, log, request.param


def policy(rented: str) -> dict:
    return {
        "providers": [{"name": "standin", "base_url": rented, "api_key_env": "STANDIN_KEY",
                       "models": {"m": "rented-model"}, "allow_private_address": True,
                       "price_per_million_tokens": {"input": 1.0, "output": 2.0}}],
        "models": [{"name": "m", "backends": [{"url": f"http://127.0.0.1:{free_port()}"}],  # nothing listens
                    "overflow": {"provider": "standin", "when_unavailable": True}}],
        "health": {"interval": 0.2, "backoff_initial": 30, "backoff_max": 30},
    }


async def budgeted_key(gw, name: str) -> tuple[str, str]:
    key_id = new_key_id()
    await gw.state.store.create_key(KeyRecord(id=key_id, name=name, created_at=time.time(), hash=hash_key(
        key := new_key(key_id)), data_policy="allow_rented", budget=KeyBudget(max_rented_spend=BUDGET)))
    return key_id, key


async def calls(url: str, key: str, tag: str, stream: bool) -> int:
    """CALLS chat calls with the OpenAI SDK; how many were answered (the others: 503, the budget is spent)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
    answered = 0
    for i in range(CALLS):
        try:
            if stream:
                chunks = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
                    extra_headers={"x-request-id": f"{tag}-{i}"})
                text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            else:
                answer = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                    extra_headers={"x-request-id": f"{tag}-{i}"})
                text = answer.choices[0].message.content
            assert text == "rented"
            answered += 1
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc
    await client.close()
    return answered


@pytest.mark.parametrize("provider", ["spaced", "omitted"], indirect=True)
async def test_a_rented_budget_holds_on_streams_whatever_the_usage_looks_like(provider, monkeypatch):
    rented_url, log, style = provider
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", "stream-usage-secret-0123456789abcdef")
    async with running_gateway(policy(rented_url)) as gw:
        answered = {}
        for tag, stream in (("plain", False), ("streamed", True)):
            key_id, key = await budgeted_key(gw, tag)
            answered[tag] = n = await calls(gw.url, key, tag, stream)
            assert len([e for e in read_log(log) if (e["request_id"] or "").startswith(f"{tag}-")]) == n
            if style == "spaced":  # usage read: two calls spend the budget, streamed as plain
                assert n == 2
            else:  # estimated: the prompt's estimate plus one token per event, or per 4 bytes of the answer
                assert 1 <= n <= 5

            start, end = period_bounds("month", time.time())
            spent, _ = await gw.state.budgets.status(key_id, start, end)
            assert spent >= BUDGET
            await gw.state.record_ledger.flush()
            rows = await gw.state.ledger.read(start, time.time() + 3600, key_id=key_id)
            totals = [sum(values[i] for _, values in rows) for i in (REQUESTS, PROMPT, COMPLETION, COST, ESTIMATED)]
            requests, prompt, completion, cost, estimated = totals
            assert requests == n and prompt > 0 and completion > 0 and cost >= BUDGET
            assert estimated == (n if style == "omitted" else 0)
        assert await gw.metric("llm_gateway_rented_cost_total") >= 2 * BUDGET
        # the own-or-rent report says how many rented calls were charged an estimate
        viewer = {"authorization": f"Bearer {mint_token(Admin(), 600, role='viewer')}"}
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.get(f"{gw.url}/admin/report", params={"window": 3600}, headers=viewer)
        assert r.status_code == 200, r.text
        rented = r.json()["models"]["m"]["rented"]
        assert rented["requests"] == sum(answered.values())
        assert rented["estimated_requests"] == (sum(answered.values()) if style == "omitted" else 0)
        assert await gw.metric("llm_gateway_completion_tokens_total", backend="rented:standin") > 0
