"""Fallback chains (gateway/fallbacks.py) through the real openai SDK: model m's only replica fails (a simulator
made to answer 5xx, tests/support/faulty.py), its chain names owned model b and then the rented stand-in
(tests/support/rented_standin.py, its own process logging every request it gets, by request id).

A key allowed everything is served by b, and by the stand-in once b fails too; the answer's header, its `model`
field and the usage record name what served it. A `private_only` key stops before the rented step (the stand-in
never hears of it) and a key not allowed model b stops before b; both get m's own error. The call's server span
names both models; settings that do not resolve, and cycles, are refused at load.
"""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
import yaml

from policies.config import PolicyError, parse_policy
from policies.keys import KeyRecord, hash_key, new_key, new_key_id
from tests.support.faulty import Faulty
from tests.support.gateway import running_gateway
from tests.support.otlp_receiver import Receiver
from tests.support.rented_standin import read_log, running_standin
from tests.support.servers import free_port, serve_app


@pytest.fixture
def standin(tmp_path, monkeypatch):
    log = str(tmp_path / "rented.jsonl")
    with running_standin(monkeypatch, log) as (url, _key):
        yield url, log


def policy(url_m: str, url_b: str, rented: str) -> dict:
    quiet = {"retries": {"attempts": 0}, "ejection": {"enabled": False}}  # one replica each: nothing to retry
    return {
        "health": {"interval": 60, "failure_threshold": 100},  # a 5xx marks no replica down here: the chain acts
        "providers": [{"name": "standin", "base_url": rented, "api_key_env": "STANDIN_KEY",
                       "models": {"m": "rented-m"}, "allow_private_address": True,
                       "price_per_million_tokens": {"input": 1.0, "output": 2.0}}],
        "models": [
            {"name": "m", "served_name": "served-m", "backends": [{"url": url_m}], **quiet,
             "fallbacks": ["b", {"provider": "standin"}]},
            {"name": "b", "served_name": "served-b", "backends": [{"url": url_b}], **quiet},
        ],
    }


async def issue(gw, data_policy: str, models: list[str] | None = None) -> tuple[str, str]:
    key_id = new_key_id()
    key = new_key(key_id)
    await gw.state.store.create_key(KeyRecord(id=key_id, name=data_policy, created_at=time.time(),
                                              hash=hash_key(key), data_policy=data_policy, models=models))
    return key, key_id


def sdk(gw, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=30)


async def usage_of(gw, key_id: str, model: str) -> dict[str, int]:
    """The key's usage row for `model` once the usage observer has flushed it (every 0.25 s)."""
    for _ in range(100):  # bounded: 10 s
        row = (await gw.state.store.usage(key_id)).get(model)
        if row and row.get("requests"):
            return row
        await asyncio.sleep(0.1)
    return {}


ASK = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_chain_goes_through_a_second_owned_model_then_the_rented_standin(standin):
    rented_url, log = standin
    sim_m, sim_b = Faulty("served-m"), Faulty("served-b")
    async with serve_app(sim_m) as url_m, serve_app(sim_b) as url_b, \
            running_gateway(policy(url_m, url_b, rented_url)) as gw:
        key, key_id = await issue(gw, "allow_rented")
        client = sdk(gw, key)
        sim_m.mode = "5xx"

        raw = await client.chat.completions.with_raw_response.create(**ASK, extra_headers={"x-request-id": "own-1"})
        answer = raw.parse()
        assert raw.headers["x-gateway-served-model"] == "b" and raw.headers["x-gateway-fallback-from"] == "m"
        assert raw.headers["x-gateway-served-by"] == "owned"
        assert answer.model == "b" and answer.choices[0].message.content
        assert sim_m.requests == 1 and sim_b.requests == 1
        assert await gw.metric("llm_gateway_fallbacks_total", model="m", to="b", reason="failed") == 1
        row = await usage_of(gw, key_id, "b")
        assert row["requests"] == 1 and row["prompt_tokens"] > 0  # recorded under the model that served
        assert "m" not in await gw.state.store.usage(key_id)

        stream = await client.chat.completions.create(**ASK, stream=True)  # the stream's chunks name b as well
        models = {chunk.model async for chunk in stream}
        assert models == {"b"}

        sim_b.mode = "5xx"  # b fails too: the rented step serves
        raw = await client.chat.completions.with_raw_response.create(**ASK, extra_headers={"x-request-id": "rent-1"})
        assert raw.parse().model == "m" and raw.headers["x-gateway-served-by"] == "rented"
        assert raw.headers["x-gateway-served-model"] == "m"  # the provider's mapping of m served it
        assert [(e["request_id"], e["model"]) for e in read_log(log)] == [("rent-1", "rented-m")]
        assert await gw.metric("llm_gateway_fallbacks_total", model="m", to="rented:standin", reason="failed") == 1
        assert (await usage_of(gw, key_id, "m"))["rented_requests"] == 1


async def test_a_private_key_stops_before_the_rented_step_and_a_key_stops_before_a_model_it_may_not_use(standin):
    rented_url, log = standin
    sim_m, sim_b = Faulty("served-m"), Faulty("served-b")
    async with serve_app(sim_m) as url_m, serve_app(sim_b) as url_b, \
            running_gateway(policy(url_m, url_b, rented_url)) as gw:
        private, _ = await issue(gw, "private_only")
        only_m, _ = await issue(gw, "allow_rented", models=["m"])
        sim_m.mode = "5xx"

        with pytest.raises(openai.InternalServerError) as refused:  # not allowed b: m's own error, b never asked
            await sdk(gw, only_m).chat.completions.create(**ASK, extra_headers={"x-request-id": "only-m-1"})
        assert refused.value.status_code == 502 and "model m" in refused.value.message
        assert "x-gateway-served-model" not in refused.value.response.headers
        assert sim_b.requests == 0

        raw = await sdk(gw, private).chat.completions.with_raw_response.create(**ASK)  # b is owned: it may go there
        assert raw.parse().model == "b" and raw.headers["x-gateway-served-model"] == "b"

        sim_b.mode = "5xx"
        for i in range(3):
            with pytest.raises(openai.InternalServerError) as refused:
                await sdk(gw, private).chat.completions.create(**ASK, extra_headers={"x-request-id": f"priv-{i}"})
            assert refused.value.status_code == 502 and "model m" in refused.value.message
        assert read_log(log) == []  # the stand-in never heard of the private key's prompts
        assert await gw.metric("llm_gateway_fallbacks_total", to="rented:standin") == 0
        assert sim_b.requests == 4  # the private key's one served and three failed calls reached b; only_m's none


@pytest.mark.parametrize(("fallbacks", "error"), [
    (["nope"], "fallback 'nope' is not a model of this policy"),
    (["m"], "a model cannot be its own fallback"),
    ([{"provider": "elsewhere"}], "fallback provider 'elsewhere' is not declared"),
    ([{"provider": "standin"}, "b"], "owned models come first"),
])
def test_settings_that_do_not_resolve_are_refused_at_load_naming_them(fallbacks, error):
    raw = policy("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://127.0.0.1:9/v1")
    raw["models"][0]["fallbacks"] = fallbacks
    with pytest.raises(PolicyError) as refused:
        parse_policy(yaml.safe_dump(raw))
    assert error in str(refused.value)


def test_a_cycle_of_fallbacks_is_refused():
    raw = policy("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://127.0.0.1:9/v1")
    raw["models"][1]["fallbacks"] = ["m"]
    with pytest.raises(PolicyError) as refused:
        parse_policy(yaml.safe_dump(raw))
    assert "fallbacks form a cycle: m -> b -> m" in str(refused.value)
    raw["models"][1]["fallbacks"] = []
    assert [step for step in parse_policy(yaml.safe_dump(raw)).models[0].fallbacks if isinstance(step, str)] == ["b"]


async def test_a_model_with_no_replica_up_falls_back_at_once(standin):
    rented_url, log = standin
    sim_b = Faulty("served-b")
    async with serve_app(sim_b) as url_b, \
            running_gateway(policy(f"http://127.0.0.1:{free_port()}", url_b, rented_url)) as gw:
        key, _ = await issue(gw, "private_only")
        raw = await sdk(gw, key).chat.completions.with_raw_response.create(**ASK)
        assert raw.parse().model == "b" and raw.headers["x-gateway-served-model"] == "b"
        assert await gw.metric("llm_gateway_fallbacks_total", model="m", to="b", reason="unavailable") == 1
        assert read_log(log) == []


async def test_the_trace_names_the_model_that_served_and_the_one_that_could_not(standin):
    rented_url, _log = standin
    sim_m, sim_b = Faulty("served-m"), Faulty("served-b")
    with Receiver() as receiver:
        async with serve_app(sim_m) as url_m, serve_app(sim_b) as url_b:
            raw = policy(url_m, url_b, rented_url)
            raw["tracing"] = {"enabled": True, "endpoint": receiver.url, "schedule_delay": 0.1}
            async with running_gateway(raw) as gw:
                key, _ = await issue(gw, "private_only")
                sim_m.mode = "5xx"
                await sdk(gw, key).chat.completions.create(**ASK, extra_headers={"x-request-id": "traced-1"})
                # off the event loop: the gateway in this process writes its spans on it (gateway/tracing/tracer.py)
                root = (await asyncio.to_thread(
                    receiver.wait_for, lambda s: s.attributes.get("llm_gateway.request_id") == "traced-1"))[0]
                assert root.attributes["llm_gateway.fallback_from"] == "m"
                assert root.attributes["llm_gateway.served_model"] == "b"
                assert root.attributes["gen_ai.response.model"] == "b"


async def test_a_model_full_past_its_queue_bound_falls_back():
    sim_m, sim_b = Faulty("served-m", step_base_ms=20, step_ms_per_seq=0), Faulty("served-b")
    async with serve_app(sim_m) as url_m, serve_app(sim_b) as url_b:
        raw = policy(url_m, url_b, "http://127.0.0.1:9/v1")
        raw["models"][0]["backends"][0]["cap"] = 1
        raw["models"][0]["queue"] = {"max_depth": 0}  # one in flight, none waiting: the second is past the bound
        async with running_gateway(raw) as gw:
            key, _ = await issue(gw, "private_only")
            client = sdk(gw, key)
            long = {**ASK, "max_tokens": 100, "extra_body": {"ignore_eos": True}}
            first = asyncio.create_task(client.chat.completions.with_raw_response.create(**long))
            for _ in range(200):  # bounded: until the first holds m's only slot
                if sim_m.requests:
                    break
                await asyncio.sleep(0.01)
            second = await client.chat.completions.with_raw_response.create(**ASK)
            assert second.parse().model == "b" and second.headers["x-gateway-served-model"] == "b"
            assert (await first).parse().model == "m"
            assert await gw.metric("llm_gateway_fallbacks_total", model="m", to="b", reason="full") == 1
