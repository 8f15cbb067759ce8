"""The simulator over a real socket: vLLM 0.32's response shapes, errors, metrics and client-disconnect aborts."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import httpx
import openai
import orjson
import pytest

from tools.simulator import SimConfig, create_app
from tests.support.servers import serve_app

MODEL = "sim-test"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say something about batching."}]}


@contextlib.asynccontextmanager
async def simulator(**overrides):
    cfg = SimConfig(model=MODEL, step_base_ms=1.0, step_ms_per_seq=0.05, **overrides)
    async with serve_app(create_app(cfg)) as url, httpx.AsyncClient(base_url=url, timeout=5.0) as http:
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=5.0)
        try:
            yield http, sdk
        finally:
            await sdk.close()


@pytest.fixture
async def sim():
    async with simulator() as pair:
        yield pair


def sse_events(body: str) -> list[str]:
    """The data payloads of an SSE body, checking vLLM's `data: ...\\n\\n` framing."""
    assert body.endswith("\n\n")
    frames = body[:-2].split("\n\n")
    assert all(frame.startswith("data: ") for frame in frames), frames
    return [frame[len("data: "):] for frame in frames]


async def sample_value(http: httpx.AsyncClient, line_prefix: str) -> float:
    text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_prefix} not in /metrics")


def labels(reason: str | None = None) -> str:
    if reason is None:
        return f'{{engine="0",model_name="{MODEL}"}}'
    return f'{{engine="0",finished_reason="{reason}",model_name="{MODEL}"}}'


async def wait_for_metric(http: httpx.AsyncClient, line_prefix: str, expected: float, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while (value := await sample_value(http, line_prefix)) != expected:
        assert time.monotonic() < deadline, f"{line_prefix} stayed {value}, expected {expected}"
        await asyncio.sleep(0.02)


# ---- streams ---------------------------------------------------------------------------------------------

async def test_chat_stream_shape_with_usage(sim):
    http, _ = sim
    resp = await http.post("/v1/chat/completions", json={
        **CHAT, "max_tokens": 7, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)

    role, *content, usage = chunks
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]
    assert len(content) == 7
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert "stop_reason" not in content[0]["choices"][0]
    last = content[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("length", None)
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 7
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 7
    assert usage["system_fingerprint"].startswith("vllm-")

    # The same prompt without streaming gives the same text.
    plain = (await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 7, "ignore_eos": True})).json()
    streamed = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert plain["choices"][0]["message"]["content"] == streamed


async def test_chat_stream_without_usage_has_no_usage_chunk(sim):
    http, _ = sim
    resp = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "stream": True})
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert len(chunks) == 1 + 3
    assert all(c["choices"] and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_completions_stream_shape(sim):
    http, _ = sim
    resp = await http.post("/v1/completions", json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    *content, usage = [orjson.loads(e) for e in events[:-1]]
    assert len(content) == 4 and content[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" for c in content)
    assert set(content[0]["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "stop_reason",
                                             "prompt_token_ids", "token_ids"}
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, None, "length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


async def test_sdk_streams_and_stop_strings(sim):
    _, sdk = sim
    stream = await sdk.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=5, stream=True,
                                               stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5

    full = await sdk.completions.create(model=MODEL, prompt="abc", max_tokens=12, extra_body={"ignore_eos": True})
    word = full.choices[0].text.split()[4]
    cut = await sdk.completions.create(model=MODEL, prompt="abc", max_tokens=12, stop=[word],
                                       extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full.choices[0].text[:full.choices[0].text.index(word)]


# ---- non-stream shapes -----------------------------------------------------------------------------------

async def test_non_stream_shapes_through_the_sdk(sim):
    _, sdk = sim
    chat = await sdk.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=6)
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion" and chat.model == MODEL
    assert chat.system_fingerprint.startswith("vllm-")
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].message.content.split()) == 6
    assert chat.usage.completion_tokens == 6 and chat.usage.total_tokens == chat.usage.prompt_tokens + 6

    # No max_tokens: the model stops at its natural EOS point.
    natural = await sdk.chat.completions.create(model=MODEL, messages=CHAT["messages"])
    assert natural.choices[0].finish_reason == "stop"
    assert natural.usage.completion_tokens == SimConfig().natural_output_tokens

    # Completions default to 16 tokens, as in vLLM and OpenAI.
    completion = await sdk.completions.create(model=MODEL, prompt="Hello", extra_body={"ignore_eos": True})
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert completion.usage.completion_tokens == 16 and completion.choices[0].finish_reason == "length"


async def test_embeddings_are_deterministic_unit_vectors(sim):
    _, sdk = sim
    result = await sdk.embeddings.create(model=MODEL, input=["alpha", "beta", "alpha"])  # SDK asks for base64
    vectors = [d.embedding for d in result.data]
    assert [len(v) for v in vectors] == [SimConfig().embedding_dim] * 3
    assert all(math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, rel_tol=1e-4) for v in vectors)
    assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
    assert result.usage.prompt_tokens == 2 + 1 + 2  # one token per 4 characters, rounded up

    floats = await sdk.embeddings.create(model=MODEL, input="alpha", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(vectors[0], abs=1e-6)


async def test_models_health_version_and_request_id(sim):
    http, _ = sim
    models = (await http.get("/v1/models")).json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (MODEL, "model", "vllm", 2048)
    assert card["permission"][0]["object"] == "model_permission"

    health = await http.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert (await http.get("/version")).json()["version"].startswith("0.32.0")

    resp = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}, headers={"x-request-id": "req-42"})
    assert resp.headers["x-request-id"] == "req-42"
    assert "x-request-id" not in (await http.get("/health")).headers
    assert (await http.get("/nope")).status_code == 404
    assert (await http.get("/v1/chat/completions")).status_code == 405


# ---- errors ----------------------------------------------------------------------------------------------

async def test_errors_in_vllm_shape(sim):
    http, sdk = sim
    with pytest.raises(openai.NotFoundError) as not_found:
        await sdk.chat.completions.create(model="nope", messages=CHAT["messages"])
    assert not_found.value.body == {"message": "The model `nope` does not exist. Valid aliases: sim-test.",
                                    "type": "NotFoundError", "param": "model", "code": 404}

    with pytest.raises(openai.BadRequestError) as too_many:
        await sdk.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=100000)
    assert too_many.value.body["message"] == (
        "max_tokens=100000 cannot be greater than max_model_len=2048. Please request fewer output tokens. "
        "(parameter=max_tokens, value=100000)")
    assert too_many.value.body["param"] == "max_tokens"

    with pytest.raises(openai.BadRequestError) as too_long:
        await sdk.completions.create(model=MODEL, prompt="x" * 4000, max_tokens=1100)  # 1000 + 1100 > 2048
    assert too_long.value.body["type"] == "BadRequestError"
    assert "maximum context length is 2048 tokens" in too_long.value.body["message"]
    assert "1100 output tokens" in too_long.value.body["message"]
    assert "1000 input tokens" in too_long.value.body["message"]

    with pytest.raises(openai.BadRequestError):
        await sdk.chat.completions.create(model=MODEL, messages=CHAT["messages"], n=2)

    for body in (b'{"model": "sim-test", "messages": [', b'{"model": "sim-test"}', b"[1, 2]",
                 b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}',
                 b'{"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}'):
        resp = await http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 400, body
        assert resp.json()["error"]["type"] == "BadRequestError" and resp.json()["error"]["code"] == 400


# ---- metrics and aborts ----------------------------------------------------------------------------------

async def test_metrics_exposes_vllm_families(sim):
    http, sdk = sim
    await sdk.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=4)
    resp = await http.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    types = dict(line.split(" ")[2:4] for line in resp.text.splitlines() if line.startswith("# TYPE "))
    expected = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
        "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
        "vllm:prompt_tokens_total": "counter", "vllm:generation_tokens_total": "counter",
        "vllm:request_success_total": "counter", "vllm:prefix_cache_hits_total": "counter",
        "vllm:prefix_cache_queries_total": "counter",
    }
    assert {name: types.get(name) for name in expected} == expected
    assert await sample_value(http, "vllm:generation_tokens_total" + labels()) == 4
    assert await sample_value(http, "vllm:request_success_total" + labels("length")) == 1
    assert await sample_value(http, "vllm:time_to_first_token_seconds_count" + labels()) == 1
    assert await sample_value(http, "vllm:inter_token_latency_seconds_count" + labels()) == 3


async def test_closing_a_stream_aborts_the_request(sim):
    http, _ = sim
    line_prefix = "vllm:request_success_total" + labels("abort")
    assert await sample_value(http, line_prefix) == 0
    body = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}  # ~2 s if left alone
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        lines = 0
        async for line in resp.aiter_lines():
            lines += bool(line)
            if lines == 3:
                break
    await wait_for_metric(http, line_prefix, 1)
    assert await sample_value(http, "vllm:num_requests_running" + labels()) == 0
    generated = await sample_value(http, "vllm:generation_tokens_total" + labels())
    assert generated < 1000


async def test_client_leaving_the_queue_aborts_the_request():
    async with simulator(max_num_seqs=1) as (http, _):
        hog = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=hog) as resp:
            hog_lines = resp.aiter_lines()  # keep a reference: dropping it would close the stream
            await anext(hog_lines)  # the hog holds the only slot
            await wait_for_metric(http, "vllm:num_requests_running" + labels(), 1)
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5}, timeout=0.3)
            await wait_for_metric(http, "vllm:request_success_total" + labels("abort"), 1)
            assert await sample_value(http, "vllm:num_requests_waiting" + labels()) == 0
            assert await sample_value(http, "vllm:num_requests_running" + labels()) == 1
            assert await sample_value(http, "vllm:request_success_total" + labels("length")) == 0
            line = await anext(hog_lines)
            while not line:
                line = await anext(hog_lines)
            assert line.startswith("data: {")  # the hog is still streaming
        await wait_for_metric(http, "vllm:request_success_total" + labels("abort"), 2)
