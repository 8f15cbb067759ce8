"""What the gateway forwards and how it reports failures, against a recording upstream on a real socket."""

import asyncio

import httpx
import openai
import pytest

from tests.support.gateway import AUTH, TEST_KEY, one_model, running_gateway
from tests.support.probes import eventually
from tests.support.recorder import Recorder
from tests.support.servers import free_port, serve_app


@pytest.fixture
async def http():
    # async only: the servers under test run in this same event loop
    async with httpx.AsyncClient(timeout=10, headers=AUTH) as client:
        yield client


async def chunks(piece: bytes, count: int):
    for _ in range(count):
        yield piece


def sdk(gw, **kw):
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, **kw)


async def test_body_forwarded_untouched_except_model(http):
    rec = Recorder()
    async with serve_app(rec) as up, running_gateway(one_model(up)) as gw:
        body = {
            "model": "m-alias",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "response_format": {"type": "json_object"},
            "logprobs": True, "top_logprobs": 2, "n": 2, "stop": ["\n", "END"],
            "ignore_eos": True, "guided_json": {"type": "object"}, "temperature": 0.25, "seed": 7,
        }
        r = await http.post(f"{gw.url}/v1/chat/completions", json=body)
        assert r.status_code == 200
        sent = rec.requests[0]
        assert sent["path"] == "/v1/chat/completions"
        assert sent["body"] == {**body, "model": "served-m"}
        # the response names the public model, not the backend's served name
        assert r.json()["model"] == "m" and r.json()["served_by"] == "recorder"
        assert "authorization" not in sent["headers"]


@pytest.mark.parametrize("endpoint", ["completions", "embeddings"])
async def test_other_endpoints_reach_their_upstream_path(http, endpoint):
    rec = Recorder()
    async with serve_app(rec) as up, running_gateway(one_model(up)) as gw:
        r = await http.post(f"{gw.url}/v1/{endpoint}", json={"model": "m", "input": "x", "prompt": "y"})
        assert r.status_code == 200
        assert rec.requests[0]["path"] == f"/v1/{endpoint}"


async def test_stream_asks_upstream_for_usage_and_strips_it_unless_requested(http):
    rec = Recorder()
    async with serve_app(rec) as up, running_gateway(one_model(up)) as gw:
        client = sdk(gw)
        chunks = [c async for c in await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True)]
        assert rec.requests[-1]["body"]["stream_options"] == {"include_usage": True}
        assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "abc"
        assert {c.model for c in chunks} == {"m"}

        chunks = [c async for c in await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True,
            stream_options={"include_usage": True})]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
        assert await gw.metric("llm_gateway_completion_tokens_total", model="m") == 6
        assert await gw.metric("llm_gateway_prompt_tokens_total", model="m") == 14


async def test_request_id_accepted_generated_and_forwarded(http):
    rec = Recorder()
    async with serve_app(rec) as up, running_gateway(one_model(up)) as gw:
        r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"}, headers={"x-request-id": "abc-123"})
        assert r.headers["x-request-id"] == "abc-123"
        assert rec.requests[-1]["headers"]["x-request-id"] == "abc-123"
        r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"}, headers={"x-request-id": "bad id with spaces"})
        generated = r.headers["x-request-id"]
        assert generated != "bad id with spaces" and len(generated) == 32
        assert rec.requests[-1]["headers"]["x-request-id"] == generated
        r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "nope"})
        assert r.status_code == 404 and len(r.headers["x-request-id"]) == 32


async def test_client_errors_are_openai_errors(http):
    rec = Recorder()
    policy = one_model("http://127.0.0.1:9", server={"max_body_bytes": 2048})
    async with serve_app(rec), running_gateway(policy) as gw:
        url = f"{gw.url}/v1/chat/completions"
        cases = [
            (await http.post(url, content=b"{nope"), 400, "invalid_json"),
            (await http.post(url, content=b"[1,2]"), 400, "invalid_json"),
            (await http.post(url, json={"messages": []}), 400, "missing_model"),
            (await http.post(url, json={"model": "x" * 5000}), 413, "request_too_large"),
            (await http.post(url, content=chunks(b"x" * 3000, 2)), 413, "request_too_large"),  # chunked
            (await http.post(url, json={"model": "gpt-99"}), 404, "model_not_found"),
            (await http.get(url), 405, "method_not_allowed"),
            (await http.get(f"{gw.url}/v1/nothing"), 404, "unknown_url"),
            (await http.get(f"{gw.url}/nothing"), 404, "unknown_url"),
        ]
        for response, status, code in cases:
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["code"] == code and error["message"] and "type" in error and "param" in error
        assert rec.requests == []
        with pytest.raises(openai.NotFoundError, match="gpt-99"):
            await sdk(gw).chat.completions.create(model="gpt-99", messages=[])


async def test_upstream_4xx_passes_through_and_5xx_becomes_502(http):
    rec = Recorder()
    async with serve_app(rec) as up, running_gateway(one_model(up)) as gw:
        rec.mode = "status:400"
        with pytest.raises(openai.BadRequestError, match="scripted failure 400"):
            await sdk(gw).chat.completions.create(model="m", messages=[])
        with pytest.raises(openai.BadRequestError, match="scripted failure 400"):
            await sdk(gw).chat.completions.create(model="m", messages=[], stream=True)
        rec.mode = "status:500"
        with pytest.raises(openai.APIStatusError) as info:
            await sdk(gw).chat.completions.create(model="m", messages=[])
        assert info.value.status_code == 502 and "scripted failure 500" in info.value.message
        assert await gw.metric("llm_gateway_upstream_errors_total", kind="status_5xx") == 1
        assert await gw.metric("llm_gateway_requests_total", model="m", status="502") == 1
        assert await gw.metric("llm_gateway_requests_total", model="m", status="400") == 2


async def test_connect_failure_retries_once_on_another_replica(http):
    rec, doomed = Recorder("alive"), Recorder("doomed")
    async with serve_app(rec) as up:
        async with serve_app(doomed) as doomed_url:
            policy = one_model(doomed_url, up)
            policy["health"]["interval"] = 60  # only the request path may notice the death
            gateway = running_gateway(policy)
            gw = await gateway.__aenter__()
        try:
            # doomed is gone now; requests picking it must be retried on the live replica, invisibly
            for sent in range(1, 51):  # noqa: B007 - read after the loop: how many went out
                r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"})
                assert r.status_code == 200 and r.json()["served_by"] == "alive"
                if await gw.metric("llm_gateway_retries_total") > 0:
                    break
            assert len(rec.requests) == sent and doomed.requests == []
            assert await gw.metric("llm_gateway_upstream_errors_total", backend="m-0", kind="connect") == 1
            assert await gw.metric("llm_gateway_backend_up", backend="m-0") == 0
            assert await gw.metric("llm_gateway_backend_up", backend="m-1") == 1
            assert await gw.metric("llm_gateway_backend_in_flight_requests") == 0
        finally:
            await gateway.__aexit__(None, None, None)


async def test_no_reachable_backend_is_503(http):
    policy = one_model(f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}")
    async with running_gateway(policy) as gw:
        with pytest.raises(openai.APIStatusError) as info:
            await sdk(gw).chat.completions.create(model="m", messages=[])
        assert info.value.status_code == 503
        assert info.value.body["code"] == "no_backend_available"
        assert info.value.response.headers["retry-after"] == "1"  # every 503 says when to try again
        # one model down does not take the gateway pod out of its Service: its healthy models must stay reachable
        r = await http.get(f"{gw.url}/ready")
        # the pod stays in its Service (other models may be healthy); the model is reported not ready
        assert r.status_code == 200 and r.json() == {"status": "degraded", "models": {"m": False}}


async def test_one_model_without_a_backend_keeps_the_gateway_ready_for_the_others(http):
    """/ready stays 200 (the pod stays in its Service) while a model has no healthy backend: it is reported
    false, the healthy model keeps serving, the dead one's requests get a 503 with Retry-After."""
    rec = Recorder()
    async with serve_app(rec) as up:
        policy = one_model(up)
        policy["models"].append({"name": "dead", "backends": [{"url": f"http://127.0.0.1:{free_port()}"}]})
        async with running_gateway(policy) as gw:
            body = None
            for _ in range(200):  # bounded: until both models have had their first health check
                body = (await http.get(f"{gw.url}/ready")).json()
                if body["models"] == {"m": True, "dead": False}:
                    break
                await asyncio.sleep(0.05)
            r = await http.get(f"{gw.url}/ready")
            assert r.status_code == 200 and r.json() == {"status": "degraded", "models": {"m": True, "dead": False}}
            assert (await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"})).status_code == 200
            dead = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "dead"})
            assert dead.status_code == 503 and int(dead.headers["retry-after"]) >= 1
            gw.state.start_drain()  # shutting down: now the pod leaves its Service
            assert (await http.get(f"{gw.url}/ready")).status_code == 503


async def test_stream_broken_mid_way_ends_with_an_error_event(http):
    rec = Recorder()
    rec.mode = "break"
    async with serve_app(rec) as up, running_gateway(one_model(up)) as gw:
        stream = await sdk(gw).chat.completions.create(model="m", messages=[], stream=True)
        got = []
        with pytest.raises(openai.APIError, match="broke off the stream"):
            async for chunk in stream:
                got.append(chunk)
        assert got  # the first chunks arrived before the failure
        for _ in range(100):  # bounded: the request is counted once the gateway has finished it
            if await gw.metric("llm_gateway_requests_total", model="m", status="502") == 1:
                break
            await asyncio.sleep(0.02)
        assert await gw.metric("llm_gateway_requests_total", model="m", status="502") == 1
        assert await gw.metric("llm_gateway_backend_in_flight_requests") == 0


async def test_down_replica_returns_after_health_check_passes(http):
    rec = Recorder()
    async with serve_app(rec) as up, running_gateway(one_model(up)) as gw:
        await ready_is(http, gw, True)
        rec.mode = "status:503"  # the replica's own 5xx reaches the client as a 502
        r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"})
        assert r.status_code == 502
        rec.health = 503  # its health check fails too: the gateway takes it out
        await ready_is(http, gw, False)
        r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"})
        assert r.status_code == 503  # taken out: the only replica is down
        rec.mode, rec.health = "ok", 200
        await ready_is(http, gw, True)
        r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"})
        assert r.status_code == 200


async def ready_is(http, gw, up: bool) -> None:
    """Until (bounded, 10 s) /ready reports model m as `up`; the health checks run every 0.2 s."""
    async def reported() -> bool:
        return (await http.get(f"{gw.url}/ready")).json()["models"] == {"m": up}

    await eventually(reported, timeout=10)



async def test_each_backend_gets_its_own_served_name(http):
    one, two = Recorder("one"), Recorder("two")
    async with serve_app(one) as u1, serve_app(two) as u2:
        policy = one_model(u1, u2)
        policy["models"][0]["backends"] = [{"url": u1, "served_name": "name-one"}, {"url": u2}]
        async with running_gateway(policy) as gw:
            for _ in range(40):
                r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"})
                assert r.json()["model"] == "m"
                if one.requests and two.requests:
                    break
        assert {r["body"]["model"] for r in one.requests} == {"name-one"}
        assert {r["body"]["model"] for r in two.requests} == {"served-m"}


async def test_a_backend_silent_past_the_read_timeout_is_a_504_and_stays_routable(http):
    rec = Recorder()
    async with serve_app(rec) as up, running_gateway(one_model(up, timeouts={"read": 0.3})) as gw:
        rec.mode = "slow:3"
        started = asyncio.get_running_loop().time()
        r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"})
        assert r.status_code == 504 and asyncio.get_running_loop().time() - started < 2.5
        assert r.json()["error"]["message"] == "the backend for model m timed out"
        assert await gw.metric("llm_gateway_upstream_errors_total", kind="timeout") == 1
        rec.mode = "ok"  # a timeout is the request's, not the replica's: it is not taken out
        r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"})
        assert r.status_code == 200
