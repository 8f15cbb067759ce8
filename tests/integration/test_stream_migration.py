"""Streams that survive (gateway/migration.py), against two simulated vLLM replicas (tests/support/faulty.py)
whose words follow from the text before them (`context_seeded`, as a model at temperature 0), through the real
openai SDK (its own retries off): a replica that resets, sends an error event or stalls mid-stream is replaced by
the other one, and the client reads one uninterrupted stream with the text an uninterrupted run gives, one id,
and the usage of both replicas."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import openai
import orjson
import pytest

from tests.support.faulty import Faulty
from tests.support.gateway import TEST_KEY, one_model, running_gateway
from tests.support.servers import serve_app

MAX = 30  # below the simulator's natural end (48 tokens): every run ends by length, wherever it was cut


def sdk(gw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=30)


@contextlib.asynccontextmanager
async def pair(migrations: int | None = None, n: int = 2, **extra):
    """`n` context-seeded simulators and a gateway in front of them; yields (gateway, [Faulty, ...])."""
    async with contextlib.AsyncExitStack() as stack:
        sims = [Faulty(context_seeded=True, step_base_ms=10) for _ in range(n)]
        urls = [await stack.enter_async_context(serve_app(s)) for s in sims]
        policy = one_model(*urls, **extra)
        policy["models"][0]["routing"] = "least-in-flight"
        policy["models"][0]["ejection"] = {"enabled": False}
        if migrations is not None:
            policy["models"][0]["retries"] = {"migrations": migrations}
        yield await stack.enter_async_context(running_gateway(policy)), sims


async def chat_stream(client: openai.AsyncOpenAI, prompt: str, **extra) -> tuple[str, set[str], list]:
    """(the text, the chunk ids, the chunks) of a streamed chat answer."""
    chunks = [c async for c in await client.chat.completions.create(
        model="m", max_tokens=MAX, stream=True, messages=[{"role": "user", "content": prompt}], **extra)]
    text = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    return text, {chunk.id for chunk in chunks}, chunks


async def until_cut(sims: list[Faulty], mode: str, ask) -> tuple[int, object]:
    """Make the first replica fail in `mode` and ask (`ask(i)`) until a call reached it (least-in-flight draws ties
    at random: bounded, 1 in 4096 to miss). Returns (i, the answer) of the call that did."""
    bad = sims[0]
    bad.mode = mode
    for sim in sims:
        sim.requests = 0
        sim.bodies.clear()
    for i in range(12):
        answer = await ask(i)
        if bad.requests:
            return i, answer
    pytest.fail("no call reached the failing replica")


@pytest.mark.parametrize("mode", ["break_mid_stream", "error_mid_stream"])
async def test_a_chat_stream_whose_replica_fails_mid_body_goes_on_from_the_other(mode, caplog):
    caplog.set_level(logging.INFO, "gateway.access")
    async with pair() as (gw, sims):
        client = sdk(gw)
        prompts = [f"tell me about question {i}" for i in range(12)]
        expected = [await chat_stream(client, p, stream_options={"include_usage": True}) for p in prompts]
        counted = [await gw.metric(f"llm_gateway_{kind}_tokens_total", model="m")
                   for kind in ("prompt", "completion")]
        answers = []

        async def ask(i: int):
            answers.append(await chat_stream(client, prompts[i], stream_options={"include_usage": True}))
            return answers[-1]

        i, (text, ids, chunks) = await until_cut(sims, mode, ask)
        reference = expected[i]
        assert text == reference[0] and len(text) > 40  # word for word what the uninterrupted run said
        assert len(ids) == 1  # one response id throughout
        assert [c.delta.role for chunk in chunks for c in chunk.choices if c.delta.role] == ["assistant"]
        assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]
        # what the other replica was asked: the same conversation with the text so far as a partial answer
        continued = orjson.loads(sims[1].bodies[-1])
        partial = continued["messages"][-1]
        assert partial["role"] == "assistant" and partial["content"] and text.startswith(partial["content"])
        assert continued["continue_final_message"] is True and continued["add_generation_prompt"] is False
        relayed_first = len(partial["content"].split(" "))  # one word a token in the simulator
        assert continued["max_tokens"] == MAX - relayed_first
        # usage: both replicas' output (MAX tokens in all), both prompts (the second holds the first and more)
        usage, ref_usage = chunks[-1].usage, reference[2][-1].usage
        assert usage.completion_tokens == MAX == ref_usage.completion_tokens
        assert usage.prompt_tokens > 2 * ref_usage.prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        # the calls' records count what their clients were told: the cut one's sums included
        for kind, before in zip(("prompt", "completion"), counted):
            told = sum(getattr(a[2][-1].usage, f"{kind}_tokens") for a in answers)
            assert await gw.metric(f"llm_gateway_{kind}_tokens_total", model="m") - before == told
        assert await gw.metric("llm_gateway_stream_migrations_total", model="m", outcome="continued") == 1
        assert await gw.metric("llm_gateway_requests_total", model="m", status="200") == 12 + i + 1
    assert any("migrations=1" in r.getMessage() for r in caplog.records)


async def cmpl_stream(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, set[str]]:
    chunks = [c async for c in await client.completions.create(model="m", prompt=prompt, max_tokens=MAX,
                                                               stream=True)]
    return "".join(c.text for chunk in chunks for c in chunk.choices), {chunk.id for chunk in chunks}


async def test_a_completion_stream_goes_on_with_its_prompt_plus_the_text_so_far():
    async with pair() as (gw, sims):
        client = sdk(gw)
        prompts = [f"Once upon a time {i}" for i in range(12)]
        expected = [await cmpl_stream(client, p) for p in prompts]
        i, (text, ids) = await until_cut(sims, "break_mid_stream", lambda i: cmpl_stream(client, prompts[i]))
        assert text == expected[i][0] and len(ids) == 1
        continued = orjson.loads(sims[1].bodies[-1])
        assert continued["prompt"].startswith(prompts[i]) and len(continued["prompt"]) > len(prompts[i])
        assert (prompts[i] + text).startswith(continued["prompt"])


async def test_a_stalled_replica_is_left_after_the_read_timeout_and_the_stream_goes_on():
    # the read timeout is well above a busy machine's gap between two tokens: only the stall is cut
    async with pair(timeouts={"read": 2.5}) as (gw, sims):
        client = sdk(gw)
        prompts = [f"a slow question {i}" for i in range(12)]
        expected = [(await chat_stream(client, p))[0] for p in prompts]
        before = await gw.metric("llm_gateway_stream_migrations_total", model="m", outcome="continued")
        i, (text, ids, _) = await until_cut(sims, "stall_mid_stream", lambda i: chat_stream(client, prompts[i]))
        assert text == expected[i] and len(ids) == 1
        after = await gw.metric("llm_gateway_stream_migrations_total", model="m", outcome="continued")
        assert after - before == 1


async def test_twenty_concurrent_streams_survive_a_replica_that_dies_under_them():
    async with pair(n=3) as (gw, sims):
        client = sdk(gw)
        prompts = [f"concurrent question {i}" for i in range(20)]
        expected = await asyncio.gather(*(chat_stream(client, p) for p in prompts))
        for sim in sims:
            sim.requests = 0
        sims[0].mode, sims[0].cut_after = "break_mid_stream", 5
        got = await asyncio.gather(*(chat_stream(client, p) for p in prompts))
        assert [g[0] for g in got] == [e[0] for e in expected]  # every text whole, none cut, none repeated
        assert all(len(g[1]) == 1 for g in got)
        cut = sims[0].requests
        assert cut >= 1
        assert await gw.metric("llm_gateway_stream_migrations_total", model="m", outcome="continued") == cut
        assert await gw.metric("llm_gateway_requests_total", model="m", status="200") == 40


async def test_a_stream_that_cannot_be_continued_faithfully_ends_with_the_error_as_before():
    async with pair() as (gw, sims):
        client = sdk(gw)

        async def ask(i: int):
            try:  # vLLM would put the stop string in the text: one could straddle the cut
                return await chat_stream(client, f"q{i}", extra_body={"include_stop_str_in_output": True})
            except openai.APIError as exc:
                return exc

        _, answer = await until_cut(sims, "break_mid_stream", ask)
        assert isinstance(answer, openai.APIError) and "broke off the stream" in str(answer)
        assert sims[1].bodies == [] or all(b"continue_final_message" not in b for b in sims[1].bodies)
        assert await gw.metric("llm_gateway_stream_migrations_total", model="m", outcome="unfaithful") == 1
        assert await gw.metric("llm_gateway_stream_migrations_total", model="m", outcome="continued") == 0


async def test_no_stream_moves_when_the_model_allows_no_migrations():
    async with pair(migrations=0) as (gw, sims):
        client = sdk(gw)

        async def ask(i: int):
            try:
                return await chat_stream(client, f"q{i}")
            except openai.APIError as exc:
                return exc

        _, answer = await until_cut(sims, "break_mid_stream", ask)
        assert isinstance(answer, openai.APIError) and "broke off the stream" in str(answer)
        assert sims[1].bodies == [] or all(b"continue_final_message" not in b for b in sims[1].bodies)
        assert await gw.metric("llm_gateway_stream_migrations_total", model="m") == 0


async def test_an_error_event_with_no_other_replica_to_go_to_reaches_the_client_as_it_came():
    async with pair(n=1) as (gw, sims):
        client = sdk(gw)
        sims[0].mode = "error_mid_stream"
        got = []
        with pytest.raises(openai.APIError, match="the simulated engine died"):
            async for chunk in await client.chat.completions.create(
                    model="m", max_tokens=MAX, stream=True, messages=[{"role": "user", "content": "alone"}]):
                got.append(chunk)
        assert got and len({c.id for c in got}) == 1  # the events before the error, then the replica's own error
        assert sims[0].requests == 1
        assert await gw.metric("llm_gateway_stream_migrations_total", model="m", outcome="failed") == 1
