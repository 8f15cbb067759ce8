"""The gateway in front of two real vLLM servers, driven by the real openai SDK."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

HELLO = [{"role": "user", "content": "Tell me about the weather in the mountains."}]


@pytest.fixture(scope="module")
def client(gateway):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.key, max_retries=0, timeout=60) as c:
        yield c


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_lists_the_public_models(client):
    assert sorted(m.id for m in client.models.list()) == ["alpha", "beta", "duo"]


def test_chat_non_stream(client):
    reply = client.chat.completions.create(model="alpha", messages=HELLO, max_tokens=12, temperature=0)
    assert reply.model == "alpha"
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 12


def test_chat_stream_without_usage_requested(client, gateway):
    before = gateway.metric("llm_gateway_completion_tokens_total", model="beta")
    chunks = list(client.chat.completions.create(model="beta", messages=HELLO, max_tokens=10, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    # the gateway still counted the tokens from the usage chunk it asked for and stripped
    assert gateway.metric("llm_gateway_completion_tokens_total", model="beta") - before == 10


def test_chat_stream_with_usage_requested(client):
    chunks = list(client.chat.completions.create(model="alpha", messages=HELLO, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert {c.model for c in chunks} == {"alpha"}


def test_completions_stream(client):
    chunks = list(client.completions.create(model="beta", prompt="Once upon a time", max_tokens=6, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks and all(c.choices for c in chunks)
    assert "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_end_the_output(client):
    free = client.completions.create(model="alpha", prompt="The river", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(free) > 6
    # a stop string that first occurs after the start, so the cut is visible
    start = next((i for i in range(1, len(free) - 2) if free[i:i + 2] not in free[:i + 1]), 1)
    stop = free[start:start + 2]
    stopped = client.completions.create(model="alpha", prompt="The river", max_tokens=40, temperature=0,
                                        stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[:free.index(stop)]


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-5", messages=HELLO)
    assert info.value.body["code"] == "model_not_found"


def test_prompt_longer_than_context_is_vllms_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "lorem ipsum " * 800}],
                                       max_tokens=8)
    message = info.value.message
    assert "512" in message  # vLLM's own words about its max_model_len reach the client
    assert info.value.status_code == 400


def test_client_closing_a_stream_aborts_it_in_vllm(client, gateway, vllm_servers):
    # vLLM 0.32 does not count client aborts in request_success_total (upstream bug): the evidence is its own
    # "Request chatcmpl-<x-request-id> aborted." line, running back to 0, and far fewer tokens than asked.
    a = vllm_servers["a"]
    generated_before = a.metric("vllm:generation_tokens_total")
    request_id = f"e2e-abort-{time.monotonic_ns()}"
    stream = client.chat.completions.create(model="alpha", messages=HELLO, max_tokens=480, stream=True,
                                            extra_body={"ignore_eos": True},
                                            extra_headers={"x-request-id": request_id})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert gateway.metric("llm_gateway_backend_in_flight_requests", backend="vllm-a") == 1
    stream.close()
    assert a.wait_aborted(request_id, timeout=10) is not None, "vLLM never logged the request as aborted"
    wait_for(lambda: a.metric("vllm:num_requests_running") == 0, 10, "vLLM to stop running it")
    assert a.metric("vllm:generation_tokens_total") - generated_before < 480
    wait_for(lambda: gateway.metric("llm_gateway_backend_in_flight_requests") == 0, 10, "in-flight gauge at 0")
    assert gateway.metric("llm_gateway_requests_total", model="alpha", status="499") >= 1


def test_killed_replica_is_routed_around_and_rejoins_after_restart(client, gateway, vllm_servers):
    b = vllm_servers["b"]
    b.kill()
    try:
        for _ in range(8):
            reply = client.chat.completions.create(model="duo", messages=HELLO, max_tokens=4)
            assert reply.choices[0].message.content is not None
        # taken down by a request that picked it (refused, retried on duo-a) or by its next health check (1 s):
        # the 8 requests may all have gone to duo-a (a tie broken at random) within less than one check
        wait_for(lambda: gateway.metric("llm_gateway_backend_up", backend="duo-b") == 0, 10, "duo-b to be down")
    finally:
        b.restart()
    wait_for(lambda: gateway.metric("llm_gateway_backend_up", backend="duo-b") == 1, 60, "duo-b to rejoin")
    served_before = sum(b.request_success_by_reason().values())
    for _ in range(30):
        client.chat.completions.create(model="duo", messages=HELLO, max_tokens=2)
        if sum(b.request_success_by_reason().values()) > served_before:
            break
    assert sum(b.request_success_by_reason().values()) > served_before, "the restarted replica never got traffic"
    # beta's own replica of the same server comes back on its next probe (backoff_max is 2 s)
    wait_for(lambda: httpx.get(f"{gateway.url}/ready").json()["status"] == "ready", 10, "the gateway to be ready again")
