"""Retries before the first byte (gateway/attempts.py), against simulated vLLM replicas made to fail
(tests/support/faulty.py), through the real openai SDK (its own retries off): a replica's 5xx storm or hang
never reaches the client, the backends together get at most ~1.2x the client's requests, the retry budget
holds when every replica fails, and nothing is retried once a byte of the answer went to the client."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
import openai
import pytest

from tests.support.faulty import Faulty
from tests.support.gateway import TEST_KEY, one_model, running_gateway
from tests.support.servers import serve_app

CHAT = {"model": "m", "max_tokens": 4}


def sdk(gw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=30)


@contextlib.asynccontextmanager
async def replicas(n: int, **sim):
    """n faulty simulators, served; yields [(Faulty, url)]."""
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for _ in range(n):
            faulty = Faulty(**sim)
            out.append((faulty, await stack.enter_async_context(serve_app(faulty))))
        yield out


def policy(urls, **extra) -> dict:
    p = one_model(*urls, **extra)
    p["models"][0]["routing"] = "least-in-flight"  # ties drawn at random: every replica gets its share
    return p


def no_migrations(urls) -> dict:
    p = policy(urls)
    p["models"][0]["retries"] = {"migrations": 0}
    return p


async def ask(client: openai.AsyncOpenAI, i: int, stream: bool) -> str:
    messages = [{"role": "user", "content": f"question {i}"}]
    if not stream:
        answer = await client.chat.completions.create(messages=messages, **CHAT)
        return answer.choices[0].message.content or ""
    parts = []
    async for chunk in await client.chat.completions.create(messages=messages, stream=True, **CHAT):
        parts.extend(c.delta.content or "" for c in chunk.choices)
    return "".join(parts)


async def test_a_5xx_storm_on_one_of_three_replicas_never_reaches_the_client():
    async with replicas(3) as sims, running_gateway(policy([u for _, u in sims])) as gw:
        bad = sims[0][0]
        bad.mode = "5xx"
        client, sent = sdk(gw), 0
        for wave in range(10):  # 60 calls, 6 at a time, streamed and not
            answers = await asyncio.gather(*(ask(client, wave * 6 + j, stream=j % 2 == 1) for j in range(6)))
            sent += len(answers)
            assert all(answers)
        reached = sum(f.requests for f, _ in sims)
        assert bad.requests >= 1  # the storm did hit the gateway
        assert sent <= reached <= 1.2 * sent, (sent, reached, [f.requests for f, _ in sims])
        assert await gw.metric("llm_gateway_retries_total", model="m", reason="status_5xx") == bad.requests
        assert await gw.metric("llm_gateway_requests_total", model="m", status="200") == sent


async def test_a_hung_replica_is_retried_on_another_after_the_read_timeout():
    async with replicas(2) as sims, running_gateway(policy([u for _, u in sims], timeouts={"read": 1.0})) as gw:
        hung = sims[0][0]
        hung.mode = "hang"
        client = sdk(gw)
        for i in range(12):  # bounded: until a call was sent to the hung replica (half of them, at random)
            with_header = await client.chat.completions.with_raw_response.create(
                messages=[{"role": "user", "content": f"q{i}"}], **CHAT)
            assert with_header.parse().choices[0].message.content
            if hung.requests:
                assert with_header.headers["x-gateway-attempts"] == "2"
                break
        assert hung.requests == 1
        assert await gw.metric("llm_gateway_retries_total", model="m", reason="timeout") == 1
        assert await gw.metric("llm_gateway_requests_total", model="m", status="504") == 0


async def test_no_retry_once_the_clients_own_timeout_has_passed():
    """A client that said it waits 0.5 s (the SDKs' x-stainless-read-timeout) is not retried on another replica
    after the hung one's 1 s read timeout: nobody waits for that answer."""
    async with replicas(2) as sims, running_gateway(policy([u for _, u in sims], timeouts={"read": 1.0})) as gw:
        hung = sims[0][0]
        hung.mode = "hang"
        healthy = sims[1][0]
        async with httpx.AsyncClient(timeout=10) as client:
            statuses = []
            for i in range(12):  # bounded: until a call was sent to the hung replica (half of them, at random)
                before = healthy.requests
                answer = await client.post(f"{gw.url}/v1/chat/completions", json={
                    **CHAT, "messages": [{"role": "user", "content": f"q{i}"}]}, headers={
                    "authorization": f"Bearer {TEST_KEY}", "x-stainless-read-timeout": "0.5"})
                statuses.append(answer.status_code)
                if hung.requests:
                    assert answer.status_code == 504, answer.text  # the read timeout, not retried
                    assert healthy.requests == before  # the healthy replica never heard of it
                    break
            assert hung.requests == 1, statuses
            assert await gw.metric("llm_gateway_retries_total", model="m", reason="timeout") == 0
            answer = await client.post(f"{gw.url}/v1/chat/completions", json={
                **CHAT, "messages": [{"role": "user", "content": "again"}]}, headers={
                "authorization": f"Bearer {TEST_KEY}", "x-stainless-read-timeout": "30"})
            assert answer.status_code == 200


async def test_the_budget_stops_retries_when_every_replica_fails(caplog):
    caplog.set_level(logging.INFO, "gateway.access")
    async with replicas(3) as sims:
        p = policy([u for _, u in sims])
        p["health"] = {"interval": 60, "failure_threshold": 100}  # the replicas stay routable: every call fails
        p["models"][0]["retries"] = {"attempts": 2, "budget": 0.2, "min_retries": 3}
        p["models"][0]["ejection"] = {"enabled": False}
        async with running_gateway(p) as gw:
            for faulty, _ in sims:
                faulty.mode = "5xx"
            client, errors = sdk(gw), 0
            for i in range(50):
                with pytest.raises(openai.APIStatusError) as info:
                    await ask(client, i, stream=i % 2 == 1)
                assert info.value.status_code == 502
                errors += 1
            reached = sum(f.requests for f, _ in sims)
            assert errors == 50
            assert 50 < reached <= 1.2 * 50 + 3, reached  # the budget's share, plus its minimum
            assert await gw.metric("llm_gateway_retry_budget_exhausted_total", model="m") >= 1
            retried = await gw.metric("llm_gateway_retries_total", model="m", reason="status_5xx")
            assert retried == reached - 50
    assert any("attempts=2" in r.getMessage() or "attempts=3" in r.getMessage() for r in caplog.records)


async def test_streams_are_retried_before_their_first_byte_and_never_after():
    # stream migrations (which go on after the first byte from the text so far: test_stream_migration.py) off
    async with replicas(2, step_base_ms=20) as sims, running_gateway(no_migrations([u for _, u in sims])) as gw:
        (first, _), (second, _) = sims
        client = sdk(gw)
        # before the first byte: a 429 goes to the other replica, unseen
        first.mode = "429"
        for i in range(12):  # bounded: until a stream was sent to the 429 replica
            chunks = [c async for c in await client.chat.completions.create(
                model="m", max_tokens=4, stream=True, messages=[{"role": "user", "content": f"q{i}"}])]
            assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
            # the usage chunk the gateway asks every attempt for stays its own: this client did not ask
            assert all(chunk.usage is None for chunk in chunks)
            if first.requests:
                break
        assert first.requests == 1
        assert await gw.metric("llm_gateway_retries_total", model="m", reason="status_429") == 1
        # after the first byte: the replica dies mid-stream; the client gets the error, no other replica a retry
        first.mode = second.mode = "break_after_first_chunk"
        before = first.requests + second.requests
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": "x"}], stream=True,
                                                      extra_body={"ignore_eos": True}, max_tokens=30, model="m")
        got = []
        with pytest.raises(openai.APIError, match="broke off the stream"):
            async for chunk in stream:
                got.append(chunk)
        assert got  # the client had the first event before the replica died
        assert first.requests + second.requests == before + 1
        assert await gw.metric("llm_gateway_retries_total", model="m") == 1  # still only the 429's
