"""The whole surface through the gateway over two simulated vLLM replicas, driven by the real openai SDK (and raw
HTTP where the SDK has no method): model lookup, the Responses API (ids that lead back to their replica),
tokenize, pooling, Anthropic's Messages API, and a battery of malformed bodies that must all get a 4xx."""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import openai
import pytest

from tools.simulator import SimConfig, create_app
from policies.keys import KeyRecord, hash_key, key_id_of, new_key, new_key_id
from tests.support.gateway import AUTH, TEST_KEY, one_model, running_gateway
from tests.support.servers import serve_app

FAST = SimConfig(model="served-m", step_base_ms=2, step_ms_per_seq=0)


@pytest.fixture
async def surface():
    async with serve_app(create_app(FAST)) as s1, serve_app(create_app(FAST)) as s2, \
            running_gateway(one_model(s1, s2)) as gw, \
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=20) as sdk, \
            httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=20) as http:
        yield gw, sdk, http


async def test_models_are_looked_up_by_name_or_alias_within_the_keys_models(surface):
    gw, sdk, _ = surface
    assert (await sdk.models.retrieve("m")).id == "m"
    assert (await sdk.models.retrieve("m-alias")).id == "m"
    with pytest.raises(openai.NotFoundError):
        await sdk.models.retrieve("nope")
    other = new_key(new_key_id())
    await gw.state.store.create_key(KeyRecord(id=key_id_of(other), name="other", created_at=time.time(),
                                              hash=hash_key(other), models=["x"]))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=other, max_retries=0) as limited:
        with pytest.raises(openai.NotFoundError):
            await limited.models.retrieve("m")
        assert [m.id async for m in limited.models.list()] == []
    # answered by the gateway itself, and metered like every other route
    assert await gw.metric("llm_gateway_requests_total", endpoint="models/retrieve", status="200") == 2
    assert await gw.metric("llm_gateway_requests_total", endpoint="models/retrieve", status="404") == 2
    assert await gw.metric("llm_gateway_requests_total", endpoint="models", status="200") == 1


async def test_responses_plain_streamed_retrieved_and_continued_on_their_replica(surface):
    gw, sdk, _ = surface
    before = await gw.metric("llm_gateway_completion_tokens_total", model="m")
    made = await sdk.responses.create(model="m", input="Tell me a story", max_output_tokens=6)
    assert made.model == "m" and made.output_text and made.usage.output_tokens == 6
    # every replica serves a retrieve only of its own responses: each id must lead back to its maker
    for _ in range(4):
        again = await sdk.responses.retrieve(made.id)
        assert again.id == made.id and again.output_text == made.output_text
    follow = await sdk.responses.create(model="m", input="and then?", previous_response_id=made.id,
                                        max_output_tokens=3)
    assert follow.previous_response_id == made.id

    events = [e async for e in await sdk.responses.create(model="m", input="Hi", max_output_tokens=5, stream=True)]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    done = events[-1].response
    assert done.usage.output_tokens == 5 and "".join(e.delta for e in events if e.type.endswith(".delta"))
    assert (await sdk.responses.retrieve(done.id)).id == done.id

    assert await gw.metric("llm_gateway_completion_tokens_total", model="m") - before == 6 + 3 + 5
    assert await gw.metric("llm_gateway_requests_total", endpoint="responses/retrieve", status="200") == 5
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve("resp_notmadehere")
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.create(model="m", input="x", previous_response_id="resp_nope")


async def test_a_background_response_streams_again_from_its_replica_with_no_tokens_counted(surface):
    gw, sdk, _ = surface
    made = [e async for e in await sdk.responses.create(model="m", input="Tell me a story", max_output_tokens=6,
                                                          background=True, stream=True)]
    assert made[0].response.background is True and made[-1].type == "response.completed"
    response_id = made[-1].response.id
    tokens = await gw.metric("llm_gateway_completion_tokens_total", model="m")
    first_tokens = await gw.metric("llm_gateway_time_to_first_token_seconds_count", model="m")
    for _ in range(2):  # two replicas: the id leads the query to its own
        again = [e async for e in await sdk.responses.retrieve(response_id, stream=True)]
        assert [(e.type, e.sequence_number) for e in again] == [(e.type, e.sequence_number) for e in made]
        assert again[0].response.model == "m" and again[-1].response.usage.output_tokens == 6
    later = [e async for e in await sdk.responses.retrieve(response_id, stream=True, starting_after=2)]
    assert [e.sequence_number for e in later] == [e.sequence_number for e in made[3:]]
    plain = await sdk.responses.retrieve(response_id, include=["message.output_text.logprobs"])
    assert plain.id == response_id and plain.output_text == made[-1].response.output_text
    # the tokens were counted when it was made: a replay adds none, and no first-token time either
    assert await gw.metric("llm_gateway_completion_tokens_total", model="m") == tokens
    assert await gw.metric("llm_gateway_time_to_first_token_seconds_count", model="m") == first_tokens
    assert await gw.metric("llm_gateway_requests_total", endpoint="responses/retrieve", status="200") == 4


async def test_a_retrieve_query_is_checked_and_a_replay_vllm_cannot_serve_ends_in_an_error_event(surface):
    gw, sdk, http = surface
    made = await sdk.responses.create(model="m", input="not in the background", max_output_tokens=3)
    path = f"/v1/responses/{made.id}"
    for query in ("stream=maybe", "stream", "starting_after=-1", "stream=true&stream=false", "colour=red",
                  "include=%ff", "a=1&&b=2", "include=" + "x" * 3000):
        answer = await http.get(f"{path}?{query}")
        assert answer.status_code == 400, (query, answer.text)
        assert answer.json()["error"]["code"] == "invalid_query", query
    # vLLM keeps no events of a response made in the foreground: it breaks off such a stream, which says nothing
    # about its health
    answer = await http.get(f"{path}?stream=true")
    assert answer.status_code == 200 and answer.text.startswith("event: error\n"), answer.text
    assert "made with background and stream" in answer.text
    assert await gw.metric("llm_gateway_upstream_errors_total") == 0
    assert (await sdk.responses.retrieve(made.id)).id == made.id


async def test_usage_of_responses_reaches_the_keys_usage(surface):
    gw, sdk, _ = surface
    made = await sdk.responses.create(model="m", input="count me", max_output_tokens=4)
    events = [e async for e in await sdk.responses.create(model="m", input="and me", max_output_tokens=3,
                                                            stream=True)]
    streamed = events[-1].response.usage  # from `response.completed`, the frame the gateway accounts from
    await gw.state.record_usage.flush()
    usage = (await gw.state.store.usage(key_id_of(TEST_KEY)))["m"]
    assert usage["requests"] == 2
    assert usage["prompt_tokens"] == made.usage.input_tokens + streamed.input_tokens
    assert usage["completion_tokens"] == 4 + 3 == made.usage.output_tokens + streamed.output_tokens


async def test_tokenize_round_trip_and_pooling_routes(surface):
    _, _, http = surface
    tokens = (await http.post("/tokenize", json={"model": "m", "prompt": "hello world"})).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    back = await http.post("/detokenize", json={"model": "m", "tokens": tokens["tokens"]})
    assert back.json() == {"prompt": "hello world"}
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = await http.post(path, json={"model": "m", "query": "q", "documents": ["a", "b", "c"]})
        assert ranked.status_code == 200 and len(ranked.json()["results"]) == 3 and ranked.json()["model"] == "m"
    scored = await http.post("/score", json={"model": "m", "text_1": "q", "text_2": ["a", "b"]})
    assert [d["index"] for d in scored.json()["data"]] == [0, 1]
    # vLLM's own {"detail": "Not Found"} (a pooling model without /classify) arrives as an OpenAI error object
    refused = await http.post("/classify", json={"model": "m", "input": "q"})
    assert refused.status_code == 404 and refused.json()["error"]["message"] == "Not Found"


async def test_anthropic_messages_take_x_api_key_and_answer_errors_in_anthropics_shape(surface):
    gw, _, _ = surface
    headers = {"x-api-key": TEST_KEY, "anthropic-version": "2023-06-01"}
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=gw.url, headers=headers, timeout=20) as http:
        plain = await http.post("/v1/messages", json=body)
        assert plain.status_code == 200 and plain.json()["usage"]["output_tokens"] == 5
        assert plain.json()["model"] == "m"
        async with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as streamed:
            frames = (await streamed.aread()).decode()
        assert frames.startswith("event: message_start") and "event: message_stop" in frames
        counted = await http.post("/v1/messages/count_tokens", json=body)
        assert counted.json()["input_tokens"] > 0
        unknown = await http.post("/v1/messages", json={**body, "model": "nope"})
        assert unknown.status_code == 404
        assert unknown.json() == {"type": "error", "error": {"type": "not_found_error",
                                                              "message": unknown.json()["error"]["message"]}}
    async with httpx.AsyncClient(base_url=gw.url, timeout=20) as anonymous:
        denied = await anonymous.post("/v1/messages", json=body, headers={"x-api-key": "sk-wrong"})
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"



async def test_anthropic_sdk_with_conflicting_keys_gets_a_401_that_names_x_api_key(surface):
    gw, _, _ = surface
    other = new_key(new_key_id())  # a second valid key
    await gw.state.store.create_key(KeyRecord(id=key_id_of(other), name="other", created_at=time.time(),
                                              hash=hash_key(other)))
    hi = [{"role": "user", "content": "hi"}]

    def sdk(x_api_key: str | None, bearer: str | None) -> anthropic.AsyncAnthropic:
        """Anthropic's SDK (this version) sends `api_key` as Authorization: Bearer, older ones and Anthropic's
        docs as x-api-key: a client may well carry both (one from a default header or a proxy)."""
        extra = {"x-api-key": x_api_key} if x_api_key else None
        return anthropic.AsyncAnthropic(base_url=gw.url, api_key=bearer, default_headers=extra, max_retries=0,
                                        timeout=20)

    for x_api_key, bearer in ((TEST_KEY, None), (TEST_KEY, TEST_KEY), (None, other)):
        async with sdk(x_api_key, bearer) as client:
            assert (await client.messages.create(model="m", max_tokens=3, messages=hi)).usage.output_tokens == 3
    for x_api_key, bearer in (("sk-wrong", TEST_KEY), (other, TEST_KEY), (TEST_KEY, other), ("sk-wrong", None)):
        async with sdk(x_api_key, bearer) as client:
            with pytest.raises(anthropic.AuthenticationError) as refused:
                await client.messages.create(model="m", max_tokens=3, messages=hi)
            assert refused.value.status_code == 401 and "x-api-key" in refused.value.message
            assert refused.value.body["error"]["type"] == "authentication_error"
            assert TEST_KEY not in str(refused.value.body) and other not in str(refused.value.body)
            with pytest.raises(anthropic.AuthenticationError):
                await client.messages.count_tokens(model="m", messages=hi)


BATTERY = [
    ("/v1/chat/completions", b"not json"),
    ("/v1/chat/completions", b"[1, 2]"),
    ("/v1/chat/completions", b'{"model": 5}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": "hi"}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": "2"}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                             b'"stream": true, "stream_options": 7}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": [5, null, {"content": {"a": 1}}]}'),
    ("/v1/completions", b'{"model": "m", "prompt": {"x": 1}, "max_tokens": 1.5}'),
    ("/v1/embeddings", b'{"model": "m", "input": {"nested": [1, {"a": null}]}}'),
    ("/v1/responses", b'{"model": "m", "input": 12, "max_output_tokens": "9"}'),
    ("/v1/responses", b'{"model": "m", "input": [{"role": "user"}], "previous_response_id": 5}'),
    ("/v1/responses", b'{"model": "m", "stream": 1, "input": "x"}'),
    ("/v1/messages", b'{"model": "m", "max_tokens": 5}'),
    ("/v1/messages", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}'),
    ("/tokenize", b'{"model": "m", "prompt": ["a", 1]}'),
    ("/detokenize", b'{"model": "m", "tokens": "abc"}'),
    ("/rerank", b'{"model": "m", "query": null, "documents": 3}'),
    ("/score", b'{"model": "m"}'),
    ("/v1/responses/resp_%0d%0aX/cancel", b""),
    ("/v1/models/m", b"{}"),
]


async def test_a_battery_of_malformed_bodies_gets_only_4xx(surface):
    gw, _, http = surface
    for path, raw in BATTERY:
        answer = await http.post(path, content=raw, headers={"content-type": "application/json"})
        assert 400 <= answer.status_code < 500, (path, raw, answer.status_code, answer.text)
        body = answer.json()
        assert isinstance(body.get("error"), dict), (path, answer.text)
    assert await gw.metric("llm_gateway_requests_total", status="500") == 0
    assert await gw.metric("llm_gateway_requests_total", status="502") == 0


async def test_a_failed_background_response_ends_its_streams_at_its_error_frame():
    """vLLM keeps the stream of a background response that failed open and silent (it ends one only after
    `response.completed`): the gateway ends it after the `error` frame, as it is made and as it is replayed,
    instead of at its read timeout (minutes)."""
    failing = SimConfig(model="served-m", step_base_ms=2, step_ms_per_seq=0, fail_background_after=2)
    # (a generous health check: one that took over the default 2 s on a starved machine once took the only
    # replica down, and the request got a 503 before the behaviour under test began)
    async with serve_app(create_app(failing)) as sim, \
            running_gateway(one_model(sim, timeouts={"health_check": 15})) as gw, \
            httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=120) as http:
        body = {"model": "m", "input": "fail me", "max_output_tokens": 8, "background": True, "stream": True}

        async def events(method: str, path: str, **kw) -> list[tuple[str, dict]]:
            async with http.stream(method, path, **kw) as streamed:
                assert streamed.status_code == 200
                text = (await streamed.aread()).decode()
            return [(frame.split("\n")[0][7:], json.loads(frame.split("\n")[1][6:]))
                    for frame in text.split("\n\n") if frame.startswith("event: ")]

        for attempt in ("made", "replayed", "replayed after 3"):
            started = time.monotonic()
            if attempt == "made":
                got = await asyncio.wait_for(events("POST", "/v1/responses", json=body), 10)
                response_id = got[0][1]["response"]["id"]
            else:
                query = {"stream": "true"} | ({"starting_after": "3"} if attempt.endswith("3") else {})
                got = await asyncio.wait_for(events("GET", f"/v1/responses/{response_id}", params=query), 10)
            assert time.monotonic() - started < 10, attempt
            assert [kind for kind, _ in got].count("response.output_text.delta") == 2 - (attempt.endswith("3"))
            assert got[-1][0] == "error" and "failed" in got[-1][1]["message"], (attempt, got)
        # the backend's own failure, relayed: no verdict on its health, and the gateway logged no error of its own
        assert await gw.metric("llm_gateway_upstream_errors_total") == 0
