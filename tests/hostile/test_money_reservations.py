"""Money a budget may spend, against what could make it escape: a crash between the ledger's writes, and a
prompt whose tokens the gateway's chars-per-token estimate far under-counts.

1. A real `llm-gateway serve` process on the embedded SQLite store rents calls for a key with a rented budget,
   is SIGKILLed well inside the ledger's flush interval, and is started again on the same file: across both
   lives the provider serves no more than the budget plus one call's cost, and the ledger (the report) still
   holds the first life's calls.
2. A burst of prompts made of characters that cost several tokens each (a byte-level tokenizer's worst case: a
   token per UTF-8 byte), sent at once to a provider that bills what it really counted: the rented spend, or the
   tokens, stay within the key's budget plus one call's worth.

Every call rents: the owned backend is a closed port, and the model overflows to the provider when no owned
replica is healthy.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from gateway.admin.auth import mint_token
from policies.config import Admin
from policies.keys import KeyBudget, KeyRecord, hash_key, new_key, new_key_id
from tests.support.asgi import lifespan, read_body
from tests.support.gateway import running_gateway
from tests.support.probes import wait_http_ok
from tests.support.redis_fixtures import redis_prefix, redis_standalone  # noqa: F401 - the Redis store case
from tests.integration.test_overflow import standin  # noqa: F401 - the stand-in provider fixture
from tests.support.rented_standin import read_log
from tests.support.servers import free_port, serve_app, stop_processes

CLI = str(Path(sys.executable).with_name("llm-gateway"))

# the stand-in provider (tests/support/rented_standin.py) reports 11 prompt + 5 completion tokens for every call
STANDIN_PRICE = {"input": 200.0, "output": 400.0}  # per million tokens
PER_STANDIN_CALL = (11 * 200.0 + 5 * 400.0) / 1e6  # 0.0042
CRASH_BUDGET = 4.5 * PER_STANDIN_CALL  # room for 5 calls: the fifth starts below the budget


class Served:
    """A gateway process (`llm-gateway serve`) on a SQLite file, restartable on the same file and port."""

    def __init__(self, tmp: Path, rented_url: str) -> None:
        self.secret = secrets.token_urlsafe(32)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = tmp / "policy.yaml"
        self.db = tmp / "gateway.db"
        self.tmp = tmp
        self.lives = 0
        self.config.write_text(yaml.safe_dump({
            "listen": {"host": "127.0.0.1", "port": self.port},
            "store": {"kind": "sqlite", "path": str(self.db)},
            "health": {"interval": 0.5},
            # far longer than the test: every kill lands inside the interval
            "ledger": {"flush_seconds": 60},
            "providers": [{"name": "standin", "base_url": rented_url, "api_key_env": "STANDIN_KEY",
                           "models": {"m": "r"}, "allow_private_address": True,
                           "price_per_million_tokens": STANDIN_PRICE}],
            "models": [{"name": "m", "backends": [{"url": f"http://127.0.0.1:{free_port()}"}],  # nothing there
                        "overflow": {"provider": "standin"}}],
        }))
        self.admin = {"authorization": f"Bearer {mint_token(Admin(), 600, secret=self.secret)}"}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.lives += 1
        env = {**os.environ, "LLM_GATEWAY_ADMIN_SECRET": self.secret, "PYTHONUNBUFFERED": "1"}
        with open(self.tmp / f"gateway-{self.lives}.log", "wb") as log:
            self.proc = subprocess.Popen([CLI, "serve", "--config", str(self.config)], env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        wait_http_ok(f"{self.url}/health", self.proc, 90, "the gateway")  # never /ready: no owned replica is up

    def wait_until_calls_rent(self, probe_key: str) -> None:
        """Until the health check has found the owned replica down, calls fail there instead of renting: send
        the probe key's (no budget) until one rents (bounded)."""
        deadline = time.monotonic() + 60
        while (r := self.chat(probe_key)).status_code != 200:
            assert r.status_code == 503 and time.monotonic() < deadline, r.text
            time.sleep(0.2)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_processes([self.proc])

    def chat(self, key: str) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", timeout=30, headers={"authorization": f"Bearer {key}"},
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})

    def rent_until_refused(self, key: str, most: int) -> int:
        """Calls one after another until one is not rented (its budget is spent); how many were rented."""
        rented, deadline = 0, time.monotonic() + 60
        for _ in range(most):
            while (r := self.chat(key)).status_code == 503 and "budget" not in r.text:
                assert time.monotonic() < deadline, r.text  # the owned replica between health checks: not rented
                time.sleep(0.2)
            if r.status_code != 200:
                assert r.status_code in (429, 503) and "budget" in r.text, r.text
                return rented
            assert r.headers["x-gateway-served-by"] == "rented"
            rented += 1
        return rented


@pytest.mark.parametrize("when_spent", ["owned_only", "reject"])
def test_a_crash_inside_the_ledgers_interval_cannot_spend_the_budget_twice(tmp_path, standin, when_spent):  # noqa: F811
    rented_url, provider_log, _ = standin
    gateway = Served(tmp_path, rented_url)
    try:
        gateway.start()
        keys = [httpx.post(f"{gateway.url}/admin/keys", headers=gateway.admin, timeout=30, json={
            "name": name, "data_policy": "allow_rented", **fields}).json() for name, fields in (
                ("spender", {"budget": {"max_rented_spend": CRASH_BUDGET, "when_spent": when_spent}}), ("probe", {}))]
        (key, key_id), probe = (keys[0]["key"], keys[0]["record"]["id"]), keys[1]["key"]

        gateway.wait_until_calls_rent(probe)
        before = len(read_log(provider_log))
        first = gateway.rent_until_refused(key, 20)
        assert first == 5, first  # the budget's own bound, in one life
        assert len(read_log(provider_log)) == before + first
        gateway.kill()  # the ledger has written nothing yet: its interval is 60 s

        gateway.start()
        gateway.wait_until_calls_rent(probe)
        before_second = len(read_log(provider_log))
        second = gateway.rent_until_refused(key, 20)
        assert len(read_log(provider_log)) == before_second + second
        served = first + second
        assert served * PER_STANDIN_CALL <= CRASH_BUDGET + PER_STANDIN_CALL, (first, second)

        # what the first life rented is still there: in the budget and in the ledger (at its reserved bound)
        status = httpx.get(f"{gateway.url}/admin/keys/{key_id}/budget", headers=gateway.admin, timeout=30).json()
        assert status["rented_spend"] >= first * PER_STANDIN_CALL - 1e-9, status
        report = httpx.get(f"{gateway.url}/admin/report", params={"window": 3600}, headers=gateway.admin,
                           timeout=30).json()
        figures = report["keys"][key_id]
        assert figures["rented_requests"] == served, figures
        assert figures["rented_cost"] >= served * PER_STANDIN_CALL - 1e-9, figures
    finally:
        gateway.stop()


# ---- 2. prompts the chars-per-token estimate under-counts ----------------------------------------------------

SNOWMEN = "\u2603" * 1000  # 1,000 characters, 3,000 UTF-8 bytes: 251 tokens at 4 characters a token
PER_MESSAGE = 4  # the provider's template tokens around one message
MAX_TOKENS = 10
PRICE = {"input": 10.0, "output": 10.0}  # per million tokens
TRUE_TOKENS = len(SNOWMEN.encode()) + PER_MESSAGE + MAX_TOKENS
TRUE_COST = TRUE_TOKENS * 10.0 / 1e6
CALLS = 3  # the budget covers this many calls at their true price
BURST = 16


def byte_billing_provider(billed: list[dict], in_flight: asyncio.Event):
    """A rented OpenAI-compatible API whose tokenizer makes a token of every UTF-8 byte (a byte-level BPE with no
    merge for these characters), plus PER_MESSAGE per message, and that always writes max_tokens tokens. It
    answers only once BURST requests have arrived (or after 5 s), so the whole burst is in flight together."""
    arrived: list[int] = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        body = orjson.loads(await read_body(receive) or b"{}")
        if scope["path"] != "/v1/chat/completions":
            await respond(send, 200, {})
            return
        prompt = sum(len(str(m.get("content", "")).encode()) + PER_MESSAGE for m in body.get("messages", []))
        usage = {"prompt_tokens": prompt, "completion_tokens": body.get("max_tokens", 16)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        arrived.append(1)
        if len(arrived) >= BURST:
            in_flight.set()
        try:
            await asyncio.wait_for(in_flight.wait(), 5)
        except TimeoutError:
            pass
        billed.append(usage)
        await respond(send, 200, {"id": "x", "object": "chat.completion", "model": body.get("model"), "usage": usage,
                                  "choices": [{"index": 0, "finish_reason": "length",
                                               "message": {"role": "assistant", "content": "snow"}}]})

    return app


async def respond(send, status: int, body: dict) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": orjson.dumps(body)})


@pytest.mark.parametrize("store", ["sqlite", "redis"])
@pytest.mark.parametrize("budget", ["rented_spend", "tokens"])
async def test_a_burst_of_prompts_the_estimate_undercounts_stays_within_the_budget(request, monkeypatch, budget,
                                                                                    store):
    monkeypatch.setenv("BYTES_KEY", "bk-" + secrets.token_urlsafe(16))
    billed: list[dict] = []
    if budget == "rented_spend":
        limit = KeyBudget(max_rented_spend=CALLS * TRUE_COST)
    else:
        limit = KeyBudget(max_tokens_per_period=CALLS * TRUE_TOKENS + 100)
    async with serve_app(byte_billing_provider(billed, asyncio.Event())) as provider:
        policy = {
            "providers": [{"name": "bytes", "base_url": f"{provider}/v1", "api_key_env": "BYTES_KEY",
                           "models": {"m": "r"}, "allow_private_address": True, "price_per_million_tokens": PRICE}],
            "models": [{"name": "m", "backends": [{"url": f"http://127.0.0.1:{free_port()}"}],  # nothing there
                        "overflow": {"provider": "bytes"}}],
            "health": {"interval": 0.2},
        }
        if store == "redis":  # the budget's Lua reservation on a real redis-server
            policy["store"] = {"kind": "redis", "url": request.getfixturevalue("redis_standalone").url,
                               "prefix": request.getfixturevalue("redis_prefix")}
        async with running_gateway(policy) as gw, \
                httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=BURST)) as http:
            key_id = new_key_id()
            key = new_key(key_id)
            await gw.state.store.create_key(KeyRecord(id=key_id, name="snow", created_at=time.time(),
                                                      hash=hash_key(key), data_policy="allow_rented", budget=limit))
            body = {"model": "m", "messages": [{"role": "user", "content": SNOWMEN}], "max_tokens": MAX_TOKENS}
            replies = await asyncio.gather(*(http.post(f"{gw.url}/v1/chat/completions", json=body,
                                                       headers={"authorization": f"Bearer {key}"})
                                             for _ in range(BURST)))
            assert all(r.status_code in (200, 429, 503) for r in replies), [r.text for r in replies]
            served = [r for r in replies if r.status_code == 200]
            assert served and all(r.headers["x-gateway-served-by"] == "rented" for r in served)
            assert len(billed) == len(served)
            if budget == "rented_spend":
                spent = sum(u["prompt_tokens"] * PRICE["input"] + u["completion_tokens"] * PRICE["output"]
                            for u in billed) / 1e6
                assert spent <= limit.max_rented_spend + TRUE_COST + 1e-12, (len(billed), spent)
            else:
                used = sum(u["total_tokens"] for u in billed)
                assert used <= limit.max_tokens_per_period, (len(billed), used)  # admits only what fits
            assert len(billed) == CALLS  # and the bound is not so loose that the budget buys less than it covers
