"""Per-key budgets across three gateway replicas on one real Redis: a rented budget of a few cents spills
until it is spent and then stays owned (or answers 429 with the reset time), spending no more than the budget
plus one request's cost."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.integration.test_overflow import standin  # noqa: F401 - the stand-in provider fixture
from tests.support.cluster import cluster
from tests.support.rented_standin import read_log

PROMPT_PRICE, COMPLETION_PRICE = 200.0, 400.0  # per million tokens: dear, so cents go quickly
PER_RENTED = (11 * PROMPT_PRICE + 5 * COMPLETION_PRICE) / 1e6  # the stand-in reports 11 + 5 tokens: 0.0042
BUDGET = 0.03
BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 60}], "max_tokens": 10, "ignore_eos": True}


@pytest.fixture
def three(tmp_path, standin):  # noqa: F811
    rented_url, log, _ = standin
    provider = {"name": "standin", "base_url": rented_url, "api_key_env": "STANDIN_KEY", "models": {"m": "r"},
                "allow_private_address": True,
                "price_per_million_tokens": {"input": PROMPT_PRICE, "output": COMPLETION_PRICE}}
    with cluster(tmp_path, replicas=3, slow=True, providers=[provider], auth={"cache_seconds": 30},
                 model={"overflow": {"provider": "standin", "when_wait_exceeds": 0.1}},
                 backend={"cap": 1}) as c:
        yield c, log


async def burst(urls: list[str], key: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {key}"}, timeout=60,
                                 limits=httpx.Limits(max_connections=count)) as http:
        return await asyncio.gather(*(http.post(f"{urls[i % len(urls)]}/v1/chat/completions", json=BODY)
                                      for i in range(count)))


def test_rented_budget_spills_until_spent_then_stays_owned(three):
    c, log = three
    key = c.issue_key(data_policy="allow_rented", budget={"max_rented_spend": BUDGET})
    rented = 0
    for _ in range(15):  # bursts until one no longer spills
        replies = asyncio.run(burst(c.urls, key, 12))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
        spilled = sum(r.headers["x-gateway-served-by"] == "rented" for r in replies)
        rented += spilled
        if spilled == 0 and rented * PER_RENTED >= BUDGET:
            break
    assert len(read_log(log)) == rented  # the provider saw exactly what the gateway says it rented
    spent = rented * PER_RENTED
    assert BUDGET <= spent <= BUDGET + PER_RENTED, (rented, spent)
    replies = asyncio.run(burst(c.urls, key, 12))  # spent: everything stays at home now
    assert [r.headers["x-gateway-served-by"] for r in replies] == ["owned"] * 12

    key_id = key.split("-")[1]
    admin = {"authorization": f"Bearer {c.admin_token}"}
    deadline = time.monotonic() + 10
    while True:  # settling runs off the request path: wait for the last one
        status = httpx.get(f"{c.urls[1]}/admin/keys/{key_id}/budget", headers=admin, timeout=10).json()
        if status["rented_spend"] == pytest.approx(spent) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status["rented_spend"] == pytest.approx(spent) and status["max_rented_spend"] == BUDGET
    assert status["resets_at"] > time.time() and status["when_spent"] == "owned_only"

    # the ledger in Redis saw every replica's traffic; each replica writes its sums every ledger.flush_seconds (1 s)
    # and the report writes only its own first: wait for the others' last write
    deadline = time.monotonic() + 10
    while True:  # bounded: 10 s
        report = httpx.get(f"{c.urls[2]}/admin/report", params={"window": 600}, headers=admin, timeout=10).json()
        if report["keys"].get(key_id, {}).get("rented_requests") == rented or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert report["keys"][key_id]["rented_requests"] == rented
    assert report["keys"][key_id]["rented_cost"] == pytest.approx(spent)
    assert report["models"]["m"]["rented"]["requests"] == rented


def test_spent_budget_can_refuse_with_the_reset_time(three):
    """The budget set with the CLI: created owned-only, then switched to reject by that flag alone."""
    c, log = three
    created = c.cli("keys", "--url", c.urls[1], "--json", "create", "--name", "capped", "--data-policy",
                    "allow_rented", "--max-rented-spend", "0.001", "--budget-period", "day")
    assert created.returncode == 0, created.stderr
    key, key_id = json.loads(created.stdout)["key"], json.loads(created.stdout)["record"]["id"]
    changed = c.cli("keys", "--url", c.urls[2], "--json", "update", key_id, "--when-spent", "reject")
    assert changed.returncode == 0, changed.stderr
    assert json.loads(changed.stdout)["budget"] == {"max_rented_spend": 0.001, "max_tokens_per_period": None,
                                                    "period": "day", "when_spent": "reject"}
    admin = {"authorization": f"Bearer {c.admin_token}"}
    deadline = time.monotonic() + 60
    while httpx.get(f"{c.urls[0]}/admin/keys/{key.split('-')[1]}/budget", headers=admin,
                    timeout=10).json()["rented_spend"] < 0.001:
        assert time.monotonic() < deadline, "the budget was never spent"
        asyncio.run(burst(c.urls, key, 6))  # some of them spill (and a few may see 429 while others hold)
    assert len(read_log(log)) == 1  # one request's cost past a budget smaller than one request
    sdk = openai.OpenAI(base_url=f"{c.urls[0]}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.RateLimitError) as info:
        sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    error = info.value
    assert error.code == "budget_exceeded" and "resets at" in error.message and "T00:00:00Z" in error.message
    assert 0 < int(error.response.headers["retry-after"]) <= 86400
    shown = c.cli("keys", "--url", c.urls[0], "budget", key_id)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split("\n")[1].split()[:6] == [key_id, "day", "0.0042", "of", "0.001", "-"], shown.stdout
    removed = c.cli("keys", "--url", c.urls[0], "--json", "update", key_id, "--no-budget")
    assert removed.returncode == 0 and json.loads(removed.stdout)["budget"] is None, removed.stderr

    # each request reserves at most 61 + 8 + 10 tokens (its prompt's UTF-8 bytes, the template's, max_tokens): 3 fit
    tokens_key = c.issue_key(budget={"max_tokens_per_period": 240})
    replies = asyncio.run(burst(c.urls, tokens_key, 6))
    codes = [r.status_code for r in replies]
    assert codes.count(200) == 3 and codes.count(429) == 3
    used = sum(r.json()["usage"]["total_tokens"] for r in replies if r.status_code == 200)
    tokens_id = tokens_key.split("-")[1]
    deadline = time.monotonic() + 10
    while (shown := c.cli("keys", "--url", c.urls[1], "budget", tokens_id)).stdout.split("\n")[1].split()[3:6] \
            != [str(used), "of", "240"]:  # what the three answers used, settled off the request path
        assert time.monotonic() < deadline, shown.stdout + shown.stderr
        time.sleep(0.1)
