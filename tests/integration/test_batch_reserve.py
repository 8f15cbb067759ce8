"""A batch fills only what interactive work leaves: on the vLLM simulator behind a real gateway (and behind two
gateways sharing a real redis-server), a batch whose runner would send 8 lines at once to a backend with a cap of
4 and `queue.reserve: 1` never holds more than 3 slots, uses those 3 when nobody else calls, and an interactive
call arriving mid-batch is admitted at once (its queue wait ~0) instead of waiting for a batch line to end. The
reserve holds too while that Redis is down and the caps fail open (counted in each process alone). The batch
object it ends as is OpenAI's, checked through the openai SDK's own type: the lines' model, their token
usage summed, request counts and every timestamp of its way."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections import Counter

import httpx
import openai
import pytest
from openai.types import Batch

from tools.simulator import SimConfig, create_app
from gateway.app import create_app as gateway_app
from policies.config import Policy
from policies.keys import KeyRecord, hash_key, key_id_of, new_key, new_key_id
from tests.support.gateway import TEST_KEY, default_key_record, running_gateway
from tests.support.redis_fixtures import redis_prefix, redis_server, redis_standalone  # noqa: F401
from tests.support.probes import metric_sum
from tests.support.redis_server import RedisServer
from tests.support.servers import serve_app

# a batch line answers in about 30 steps of 40 ms (1.2 s): a call that had to wait for one to end would wait
# for a good part of that, far past the bound below
SIM = SimConfig(model="served-m", step_base_ms=40, step_ms_per_seq=0)
LINE_TOKENS = 30
AT_ONCE = 0.25  # seconds: no wait for a slot (lines of 1.2 s on 3 slots: one ends every ~0.4 s), yet room for
# a loop stall on a loaded machine; peak["batch"] == 3 is what tells the reserve held
DEADLINE = 120  # seconds for a batch of tens of lines on a loaded 2-core machine


class Counting:
    """The backend (an ASGI app) counting the chat requests it answers at once, batch lines apart (their prompt
    says "batch line"): now and the most at once."""

    def __init__(self, app) -> None:
        self.app = app
        self.now: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            await self.app(scope, receive, send)
            return
        messages = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        body = b"".join(m.get("body", b"") for m in messages)
        kind = "batch" if b"batch line" in body else "interactive"
        replay = iter(messages)

        async def again():
            return next(replay, None) or await receive()

        self.now[kind] += 1
        self.peak[kind] = max(self.peak[kind], self.now[kind])
        self.peak["all"] = max(self.peak["all"], sum(self.now[k] for k in ("batch", "interactive")))
        try:
            await self.app(scope, again, send)
        finally:
            self.now[kind] -= 1


def lines(count: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "m", "max_tokens": LINE_TOKENS,
                                         "messages": [{"role": "user", "content": f"batch line {n}"}]}}).encode()
                    + b"\n" for n in range(count))


def policy(backend: str, tmp_path, **extra) -> dict:
    return {"models": [{"name": "m", "served_name": "served-m", "queue": {"reserve": 1},
                        "backends": [{"url": backend, "cap": 4}]}],
            "health": {"interval": 0.2, "backoff_initial": 0.2, "backoff_max": 1},
            "batch": {"files_dir": str(tmp_path / "files"), "poll_seconds": 0.1, "concurrency": 8,
                      "max_in_flight": 8},
            **extra}


async def submitted(sdk: openai.AsyncOpenAI, count: int) -> Batch:
    uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(lines(count))), purpose="batch")
    return await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def finished(sdk: openai.AsyncOpenAI, batch_id: str) -> Batch:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        batch = await sdk.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {DEADLINE} s")


async def interactive_waits(sdks: list[openai.AsyncOpenAI], backend: Counting, count: int) -> list[float]:
    """`count` interactive calls one after another, each while the batch holds its 3 slots: their queue waits."""
    waits = []
    for n in range(count):
        await until(lambda: backend.now["batch"] == 3, 30, "the batch did not hold its 3 slots")
        raw = await sdks[n % len(sdks)].chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": f"now {n}"}], max_tokens=2)
        waits.append(float(raw.headers["x-gateway-queue-ms"]) / 1000)
    return waits


async def test_a_batch_leaves_the_reserve_free_and_an_interactive_call_takes_it_at_once(tmp_path):
    backend = Counting(create_app(SIM))
    async with serve_app(backend) as url, running_gateway(policy(url, tmp_path)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=60) as sdk:
        batch = await submitted(sdk, 16)
        await until(lambda: backend.now["batch"] == 3, 30, "the batch alone never used the 3 slots")
        waits = await interactive_waits([sdk], backend, 4)
        done = await finished(sdk, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 16, done
    assert backend.peak["batch"] == 3, backend.peak  # never the 4th slot, and all 3 with nobody else calling
    assert backend.peak["all"] <= 4
    assert max(waits) < AT_ONCE, waits


async def test_on_a_shared_redis_the_reserve_holds_across_gateway_replicas(tmp_path, redis_server,  # noqa: F811
                                                                          redis_prefix):  # noqa: F811
    """Two gateways, both running the batch's lines (8 each at most), one cap of 4 counted in Redis."""
    backend = Counting(create_app(SIM))
    async with serve_app(backend) as url:
        shared = Policy.model_validate(policy(url, tmp_path, store={"kind": "redis", "url": redis_server.url,
                                                                    "prefix": redis_prefix}))
        apps = [gateway_app(shared), gateway_app(shared)]
        await apps[0].state.store.create_key(default_key_record())
        async with serve_app(apps[0]) as url_a, serve_app(apps[1]) as url_b, \
                openai.AsyncOpenAI(base_url=f"{url_a}/v1", api_key=TEST_KEY, max_retries=0, timeout=60) as a, \
                openai.AsyncOpenAI(base_url=f"{url_b}/v1", api_key=TEST_KEY, max_retries=0, timeout=60) as b:
            batch = await submitted(a, 16)
            await until(lambda: backend.now["batch"] == 3, 30, "the batch alone never used the 3 slots")
            waits = await interactive_waits([a, b], backend, 4)
            done = await finished(a, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 16, done
    assert backend.peak["batch"] == 3, backend.peak
    assert backend.peak["all"] <= 4
    assert max(waits) < AT_ONCE, waits


async def test_while_redis_is_down_caps_fail_open_and_still_keep_the_reserve(tmp_path):
    """A key of the batch class sends 6 calls at once to a backend of cap 4 with `queue.reserve: 1` while the
    shared store is unreachable (`on_store_failure.concurrency: fail_open`): the local count admits 3 of them,
    not 4, and an interactive call arriving beside them is admitted at once. (Redis of the test's own: it stops.)"""
    backend = Counting(create_app(SIM))
    batch_key = new_key(new_key_id())
    with RedisServer() as redis:
        async with serve_app(backend) as url:
            app = gateway_app(Policy.model_validate(policy(
                url, tmp_path, store={"kind": "redis", "url": redis.url, "prefix": "reserve-down:"},
                auth={"cache_seconds": 120}, rate_limits={"on_store_failure": {"concurrency": "fail_open"}})))
            await app.state.store.create_key(default_key_record())
            await app.state.store.create_key(KeyRecord(id=key_id_of(batch_key), name="bulk", created_at=time.time(),
                                                       hash=hash_key(batch_key), priority_class="batch"))
            async with serve_app(app) as gw, \
                    openai.AsyncOpenAI(base_url=f"{gw}/v1", api_key=TEST_KEY, max_retries=0, timeout=60) as sdk, \
                    openai.AsyncOpenAI(base_url=f"{gw}/v1", api_key=batch_key, max_retries=0, timeout=60) as bulk:
                for client in (sdk, bulk):  # both keys verified (and cached) while the store is up
                    await client.chat.completions.create(model="m", max_tokens=1,
                                                         messages=[{"role": "user", "content": "hello"}])
                redis.stop()
                calls = [asyncio.create_task(bulk.chat.completions.create(
                    model="m", max_tokens=LINE_TOKENS, messages=[{"role": "user", "content": f"batch line {n}"}]))
                    for n in range(6)]
                waits = await interactive_waits([sdk], backend, 3)
                answers = await asyncio.gather(*calls)
                async with httpx.AsyncClient(timeout=30) as http:
                    metrics = (await http.get(f"{gw}/metrics")).text
    assert all(a.usage is not None and a.usage.completion_tokens == LINE_TOKENS for a in answers)
    assert backend.peak["batch"] == 3, backend.peak  # without the reserve the local count lets a 4th in
    assert backend.peak["all"] <= 4
    assert max(waits) < AT_ONCE, waits
    # every one of them was admitted by the local count (the store's failure counted, the mode named)
    assert metric_sum(metrics, "llm_gateway_cap_store_failures_total", mode="fail_open") >= 6 + 3


@pytest.mark.parametrize("ending", ["completed", "cancelled"])
async def test_the_batch_object_is_openais_with_model_usage_counts_and_timestamps(tmp_path, ending):
    backend = Counting(create_app(SIM))
    async with serve_app(backend) as url, running_gateway(policy(url, tmp_path)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=60) as sdk:
        batch = await submitted(sdk, 6)
        assert batch.model == "m" and batch.usage is not None and batch.usage.total_tokens == 0
        if ending == "cancelled":
            await until(lambda: backend.now["batch"] > 0, 30, "no line started")
            await sdk.batches.cancel(batch.id)
        done = await finished(sdk, batch.id)
        raw = (await sdk.batches.with_raw_response.retrieve(batch.id)).http_response.json()
        output = [] if done.output_file_id is None else \
            [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).text.splitlines()]
    checked = Batch.model_validate(raw)  # the SDK's own type, from the JSON as the gateway sent it
    assert checked.status == ending and checked.model == "m", raw
    counts = checked.request_counts
    assert counts is not None and counts.total == 6 and counts.completed == len(output) and counts.failed == 0
    usage = checked.usage
    assert usage is not None, raw
    sent = [o["response"]["body"]["usage"] for o in output]
    assert usage.input_tokens == sum(u["prompt_tokens"] for u in sent)
    assert usage.output_tokens == sum(u["completion_tokens"] for u in sent)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
    if ending == "completed":
        assert usage.output_tokens == 6 * LINE_TOKENS
        stamps = [checked.created_at, checked.in_progress_at, checked.finalizing_at, checked.completed_at]
    else:
        stamps = [checked.created_at, checked.in_progress_at, checked.cancelling_at, checked.cancelled_at]
    assert all(isinstance(s, int) for s in stamps) and stamps == sorted(stamps), raw
    assert checked.expires_at > checked.created_at
