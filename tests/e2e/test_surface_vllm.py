"""The wider surface through the gateway in front of real vLLM servers: model lookup, the Responses API (plain,
streamed, a stored response retrieved, a background one streamed again), tokenize round trip, tool calls passed
through, Anthropic's Messages API through the anthropic SDK, and the pooling routes against the tiny model served
as a pooling model."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from policies.keys import key_id_of

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
HELLO = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def sdk(gateway):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.key, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {gateway.key}"}, timeout=60) as c:
        yield c


def test_models_retrieve_is_answered_by_the_gateway(sdk):
    assert sdk.models.retrieve("alpha").id == "alpha"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("tiny-a")  # the served name is not a public one


def key_usage(gateway, model: str) -> dict[str, int]:
    """The e2e key's usage of `model`, as the admin API reports it."""
    key_id = key_id_of(gateway.key)
    answer = httpx.get(f"{gateway.url}/admin/keys/{key_id}/usage", timeout=30,
                       headers={"authorization": f"Bearer {gateway.admin_token('viewer')}"})
    assert answer.status_code == 200, answer.text
    return answer.json()["models"].get(model, {})


def test_responses_plain_stored_and_streamed(sdk, gateway):
    before = gateway.metric("llm_gateway_completion_tokens_total", model="alpha")
    used_before = key_usage(gateway, "alpha")
    made = sdk.responses.create(model="alpha", input="Tell me about rivers.", max_output_tokens=8, temperature=0)
    assert made.model == "alpha" and made.output_text and made.usage.output_tokens == 8
    stored = sdk.responses.retrieve(made.id)  # vLLM A runs with its store enabled
    assert stored.id == made.id and stored.output_text == made.output_text

    events = list(sdk.responses.create(model="alpha", input="Hello", max_output_tokens=5, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.usage.output_tokens == 5
    # both answers' tokens are counted from the usage vLLM reported
    assert gateway.metric("llm_gateway_completion_tokens_total", model="alpha") - before == 8 + 5
    assert gateway.metric("llm_gateway_requests_total", endpoint="responses", status="200") >= 2
    # and in the key's usage: the prompts and outputs vLLM reported
    deadline = time.monotonic() + 30  # written off the request path, after the stream's last frame went out
    while (used := key_usage(gateway, "alpha")).get("completion_tokens", 0) \
            - used_before.get("completion_tokens", 0) < 8 + 5:
        assert time.monotonic() < deadline, used
        time.sleep(0.05)
    assert used["completion_tokens"] - used_before.get("completion_tokens", 0) == 8 + 5
    prompts = made.usage.input_tokens + events[-1].response.usage.input_tokens
    assert used["prompt_tokens"] - used_before.get("prompt_tokens", 0) == prompts


def test_a_background_response_is_streamed_again_by_retrieve(sdk, gateway):
    before = gateway.metric("llm_gateway_completion_tokens_total", model="alpha")
    made = list(sdk.responses.create(model="alpha", input="Tell me about lakes.", max_output_tokens=6,
                                     temperature=0, background=True, stream=True))
    assert made[0].response.background is True and made[-1].type == "response.completed"
    response_id = made[-1].response.id
    counted = gateway.metric("llm_gateway_completion_tokens_total", model="alpha")
    assert counted - before == made[-1].response.usage.output_tokens == 6
    # vLLM streams the events it kept of a background response again, all or those after `starting_after`
    again = list(sdk.responses.retrieve(response_id, stream=True))
    assert [(e.type, e.sequence_number) for e in again] == [(e.type, e.sequence_number) for e in made]
    assert again[0].response.model == "alpha"  # vLLM's served name is not the public one
    later = list(sdk.responses.retrieve(response_id, stream=True, starting_after=2))
    assert [e.sequence_number for e in later] == [e.sequence_number for e in made[3:]]
    plain = sdk.responses.retrieve(response_id, include=["message.output_text.logprobs"])
    assert plain.id == response_id and plain.output_text == made[-1].response.output_text
    # its tokens were counted when it was made, not again for each replay
    assert gateway.metric("llm_gateway_completion_tokens_total", model="alpha") == counted


def test_tokenize_detokenize_round_trip(http):
    tokens = http.post("/tokenize", json={"model": "beta", "prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert http.post("/detokenize", json={"model": "beta", "tokens": tokens["tokens"]}).json()["prompt"] \
        == "hello world"


def test_tool_calls_pass_through(sdk):
    # vLLM A runs with --enable-auto-tool-choice --tool-call-parser hermes: it takes the request (the tiny model
    # cannot write a real call); vLLM B runs without them and refuses it with its own 400
    reply = sdk.chat.completions.create(model="alpha", messages=HELLO, tools=TOOLS, tool_choice="auto",
                                        max_tokens=8)
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model="beta", messages=HELLO, tools=TOOLS, tool_choice="auto", max_tokens=8)
    assert "tool" in refused.value.message


def test_anthropic_sdk_messages_plain_and_streamed(gateway):
    with anthropic.Anthropic(base_url=gateway.url, api_key=gateway.key, max_retries=0, timeout=60) as client:
        message = client.messages.create(model="beta", max_tokens=6, messages=[{"role": "user", "content": "Hi"}])
        assert message.model == "beta" and message.usage.output_tokens == 6 and message.content[0].text
        with client.messages.stream(model="beta", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert text and final.usage.output_tokens == 5
        with pytest.raises(anthropic.NotFoundError):
            client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    with anthropic.Anthropic(base_url=gateway.url, api_key="sk-not-a-key", max_retries=0) as stranger:
        with pytest.raises(anthropic.AuthenticationError):
            stranger.messages.create(model="beta", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])


def assert_refused(client: httpx.Client, cases: list[tuple[str, dict]]) -> None:
    """Each body gets a 4xx (from the gateway or the backend), never a 5xx, in its route's error shape."""
    for path, body in cases:
        answer = client.post(path, json=body)
        assert 400 <= answer.status_code < 500, (path, body, answer.status_code, answer.text)
        error = answer.json()
        if path.startswith("/v1/messages"):  # Anthropic's shape there
            assert error["type"] == "error" and isinstance(error["error"]["message"], str), (path, answer.text)
        else:
            assert isinstance(error["error"]["message"], str), (path, body, answer.text)


def server_errors(gateway) -> float:
    return sum(gateway.metric("llm_gateway_requests_total", status=str(s)) for s in (500, 502, 503, 504))


def test_malformed_bodies_get_4xx_from_gateway_or_vllm(http, gateway):
    before = server_errors(gateway)  # the session's gateway: other tests kill replicas (their 502s count there)
    chat = [
        {"model": "alpha", "messages": HELLO, "stream": "yes"},  # vLLM would coerce and stream: refused first
        {"model": "alpha", "messages": "hi"},
        {"model": "alpha", "messages": HELLO, "max_tokens": 100000},
        {"model": "alpha", "messages": HELLO, "temperature": "hot"},
        {"model": "alpha", "messages": HELLO, "n": 0},
    ]
    assert_refused(http, [("/v1/chat/completions", body) for body in chat] + [
        ("/v1/completions", {"model": "alpha", "prompt": [[-1, 99999999]]}),
        ("/v1/responses", {"model": "alpha", "input": 12}),
        ("/v1/responses", {"model": "alpha", "input": [{"type": "function_call_output", "call_id": 1}]}),
        ("/v1/responses", {"model": "alpha", "input": "x", "tools": "nope"}),
        ("/v1/responses", {"model": "alpha", "input": "x", "stream": "yes"}),
        ("/v1/responses", {"model": "alpha", "input": "x", "max_output_tokens": 10**9}),
        ("/v1/responses", {"model": "alpha", "input": "x", "previous_response_id": "resp_not_made_here"}),
        ("/tokenize", {"model": "alpha", "prompt": 5}),
        ("/detokenize", {"model": "alpha", "tokens": ["a"]}),
        ("/rerank", {"model": "alpha", "query": "q", "documents": ["d"]}),  # a generating model: vLLM's 404
    ])
    with httpx.Client(base_url=gateway.url, headers={"x-api-key": gateway.key}, timeout=60) as anthropic_client:
        assert_refused(anthropic_client, [
            ("/v1/messages", {"model": "alpha", "max_tokens": 5, "messages": "x"}),
            ("/v1/messages", {"model": "alpha", "max_tokens": 5, "messages": [{"role": "bogus", "content": "x"}]}),
            ("/v1/messages", {"model": "alpha", "messages": HELLO}),
            ("/v1/messages", {"model": "alpha", "max_tokens": 5, "messages": HELLO, "stream": "yes"}),
            ("/v1/messages/count_tokens", {"model": "alpha"}),
        ])
    assert server_errors(gateway) == before
    on_generate = http.post("/v1/embeddings", json={"model": "alpha", "input": "x"})  # vLLM: {"detail":...}
    assert on_generate.status_code == 404 and on_generate.json()["error"]["message"] == "Not Found"


def test_pooling_model_embeds_scores_and_reranks(pooling):
    with openai.OpenAI(base_url=f"{pooling.url}/v1", api_key=pooling.key, max_retries=0, timeout=60) as sdk:
        vectors = sdk.embeddings.create(model="pool", input=["a river", "a mountain"])
        assert len(vectors.data) == 2 and len(vectors.data[0].embedding) > 1 and vectors.usage.prompt_tokens > 0
    with httpx.Client(base_url=pooling.url, headers={"authorization": f"Bearer {pooling.key}"}, timeout=60) as c:
        ranked = c.post("/rerank", json={"model": "pool", "query": "river", "documents": ["water", "rock", "sky"]})
        assert ranked.status_code == 200 and sorted(r["index"] for r in ranked.json()["results"]) == [0, 1, 2]
        assert c.post("/v1/rerank", json={"model": "pool", "query": "q", "documents": ["d"]}).status_code == 200
        v2 = c.post("/v2/rerank", json={"model": "pool", "query": "river", "documents": ["water", "rock"],
                                        "top_n": 1})  # Cohere's v2 shape, which vLLM serves too
        assert v2.status_code == 200 and len(v2.json()["results"]) == 1, v2.text
        assert v2.json()["results"][0]["index"] in (0, 1) and v2.json()["usage"]["total_tokens"] > 0
        scored = c.post("/score", json={"model": "pool", "text_1": "river", "text_2": ["water", "rock"]})
        assert scored.status_code == 200 and len(scored.json()["data"]) == 2
        pooled = c.post("/pooling", json={"model": "pool", "input": "a river"})
        assert pooled.status_code == 200 and pooled.json()["data"]
        assert_refused(c, [
            ("/v1/embeddings", {"model": "pool", "input": []}),
            ("/v1/embeddings", {"model": "pool", "input": [[99999999]]}),
            ("/rerank", {"model": "pool", "query": 5, "documents": [5]}),
            ("/v2/rerank", {"model": "pool", "query": "q", "documents": ["a"], "top_n": -1}),
            ("/score", {"model": "pool", "text_1": "a", "text_2": 5}),
            ("/pooling", {"model": "pool"}),
            ("/classify", {"model": "pool", "input": "x"}),  # an embedding model has no /classify: vLLM's 404
            ("/v1/responses", {"model": "pool", "input": "x"}),
        ])
    assert pooling.metric("llm_gateway_requests_total", endpoint="rerank", status="200") == 3
    assert pooling.metric("llm_gateway_prompt_tokens_total", model="pool") > 0
