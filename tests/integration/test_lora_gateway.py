"""LoRA adapters as models, through a real gateway in front of simulated vLLM replicas that load adapters at run
time (tools/simulator/lora.py): listing, routing to the holder, loads on demand (one at a time), the least
recently used unloaded, a restarted replica, failed loads, and an adapter as a model for keys and limits."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import httpx
import openai
import pytest

from tools.simulator import SimConfig, create_app
from policies.keys import hash_key, key_id_of, new_key, new_key_id
from tests.support.gateway import AUTH, TEST_KEY, default_key_record, running_gateway
from tests.support.otlp_receiver import Receiver
from tests.support.probes import eventually
from tests.support.servers import serve_app

ADAPTERS = ("ft-a", "ft-b", "ft-c")


@pytest.fixture
def adapter_dirs(tmp_path: Path) -> Path:
    for name in ADAPTERS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return tmp_path


def sim(**fields) -> object:
    return create_app(SimConfig(model="served-m", enable_lora=True, **fields))


def lora_policy(dirs: Path, *urls: str, max_loras: int = 1, routing: str | None = None, **lora) -> dict:
    adapters = [{"name": n, "path": str(dirs / n)} for n in ADAPTERS]
    adapters[0]["aliases"] = ["ft-a-latest"]
    adapters.append({"name": "ft-missing", "path": str(dirs / "nowhere")})
    adapters.append({"name": "ft-limited", "served_name": "ft-a", "path": str(dirs / "ft-a"),
                     "limits": {"requests_per_minute": 1}})
    model = {"name": "m", "served_name": "served-m", "backends": [{"url": u} for u in urls],
             "lora": {"adapters": adapters, "max_loras": max_loras, **lora}}
    if routing:
        model["routing"] = routing
    return {"models": [model], "health": {"interval": 0.2, "backoff_initial": 0.2, "backoff_max": 1}}


def chat(model: str) -> dict:
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}


def loads(*sims) -> int:
    return sum(s.lora.loads for s in sims)


async def test_an_adapter_is_a_model_loaded_on_demand_and_then_routed_to_its_holder(adapter_dirs):
    a, b = sim(), sim()
    async with serve_app(a) as url_a, serve_app(b) as url_b, \
            running_gateway(lora_policy(adapter_dirs, url_a, url_b)) as gw, contextlib.AsyncExitStack() as stack:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0)
        await stack.enter_async_context(client)
        listed = {m.id: m for m in (await client.models.list()).data}
        assert {"m", *ADAPTERS} <= set(listed) and listed["ft-b"].parent == "m"
        assert (await client.models.retrieve("ft-a-latest")).id == "ft-a"

        answer = await client.chat.completions.create(**chat("ft-a"))
        assert answer.model == "ft-a"  # vLLM's own answer, from the adapter
        assert loads(a, b) == 1
        holder = a if a.lora.holds("ft-a") else b
        for _ in range(6):  # every later call goes where the adapter is, with no further load
            assert (await client.chat.completions.create(**chat("ft-a-latest"))).model == "ft-a"
        assert loads(a, b) == 1 and holder.lora.holds("ft-a")
        base = await client.chat.completions.create(**chat("m"))
        assert base.model == "m"
        assert await gw.metric("llm_gateway_requests_total", model="ft-a") == 7
        assert await gw.metric("llm_gateway_lora_events_total", adapter="ft-a", event="load") == 1


async def test_one_load_for_many_waiting_calls_and_the_least_recently_used_is_unloaded(adapter_dirs):
    a, b = sim(lora_load_ms=300), sim(lora_load_ms=300)
    async with serve_app(a) as url_a, serve_app(b) as url_b, \
            running_gateway(lora_policy(adapter_dirs, url_a, url_b)) as gw, \
            httpx.AsyncClient(timeout=60, headers=AUTH) as http:
        answers = await asyncio.gather(*(http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-a"))
                                         for _ in range(8)))
        assert [r.status_code for r in answers] == [200] * 8
        assert loads(a, b) == 1  # single flight: eight calls, one load
        # ft-b goes to the replica with a free slot, not over ft-a
        assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-b"))).status_code == 200
        assert {tuple(a.lora.loaded), tuple(b.lora.loaded)} == {("ft-a",), ("ft-b",)}
        await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-a"))  # ft-b is now the least recently used
        assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-c"))).status_code == 200
        assert sorted([*a.lora.loaded, *b.lora.loaded]) == ["ft-a", "ft-c"]  # max_loras 1 per replica
        assert a.lora.unloads + b.lora.unloads == 1
        assert await gw.metric("llm_gateway_lora_events_total", event="unload", adapter="ft-b") == 1


async def test_a_restarted_replica_is_noticed_and_its_adapter_loaded_again(adapter_dirs):
    a = sim()
    async with serve_app(a) as url_a, running_gateway(lora_policy(adapter_dirs, url_a, refresh_seconds=60)) as gw, \
            httpx.AsyncClient(timeout=30, headers=AUTH) as http:
        assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-a"))).status_code == 200
        a.lora.loaded.clear()  # as a restarted vLLM: no adapter; the gateway has not read its /v1/models since
        reply = await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-a"))
        assert reply.status_code == 200 and reply.json()["model"] == "ft-a"
        assert a.lora.loads == 2


async def test_what_a_replica_holds_is_read_from_vllm(adapter_dirs):
    a, b = sim(), sim()
    async with serve_app(a) as url_a, serve_app(b) as url_b, \
            running_gateway(lora_policy(adapter_dirs, url_a, url_b, refresh_seconds=0.1)) as gw, \
            httpx.AsyncClient(timeout=30, headers=AUTH) as http:
        async with httpx.AsyncClient() as direct:  # loaded by someone else, straight on replica b
            loaded = await direct.post(f"{url_b}/v1/load_lora_adapter",
                                       json={"lora_name": "ft-b", "lora_path": str(adapter_dirs / "ft-b")})
            assert loaded.status_code == 200
        rb = gw.state.replicas.by_model["m"][1]
        await eventually(lambda: _true(rb.lora is not None and rb.lora.holds("ft-b")))
        for _ in range(4):
            assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-b"))).status_code == 200
        assert loads(a, b) == 1  # only the direct one: every call went to b
        b.lora.loaded.clear()  # b restarts: the next read of its /v1/models says so
        await eventually(lambda: _true(not rb.lora.holds("ft-b")))


async def test_unknown_adapters_and_failed_loads_are_clear_errors_and_the_replica_stays_up(adapter_dirs):
    a = sim()
    async with serve_app(a) as url_a, running_gateway(lora_policy(adapter_dirs, url_a)) as gw, \
            httpx.AsyncClient(timeout=30, headers=AUTH) as http:
        unknown = await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-z"))
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        failed = await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-missing"))
        assert failed.status_code == 502
        error = failed.json()["error"]
        assert error["code"] == "adapter_load_failed" and "ft-missing" in error["message"]
        assert "No adapter found" in error["message"]
        assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat("m"))).status_code == 200
        assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-a"))).status_code == 200
        assert await gw.metric("llm_gateway_backend_up", model="m") == 1
        assert await gw.metric("llm_gateway_lora_events_total", event="load_failed") == 1


async def test_an_adapter_is_a_model_for_keys_and_limits(adapter_dirs):
    a = sim()
    async with serve_app(a) as url_a, running_gateway(lora_policy(adapter_dirs, url_a)) as gw, \
            httpx.AsyncClient(timeout=30) as http, contextlib.AsyncExitStack() as stack:

        only_a = new_key(new_key_id())
        record = default_key_record(models=["ft-a"])
        record = record.__class__(**{**record.__dict__, "id": key_id_of(only_a), "hash": hash_key(only_a)})
        await gw.state.store.create_key(record)
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=only_a, max_retries=0)
        await stack.enter_async_context(client)
        assert [m.id for m in (await client.models.list()).data] == ["ft-a"]
        assert (await client.chat.completions.create(**chat("ft-a"))).model == "ft-a"
        with pytest.raises(openai.PermissionDeniedError):
            await client.chat.completions.create(**chat("ft-b"))
        with pytest.raises(openai.PermissionDeniedError):
            await client.chat.completions.create(**chat("m"))
        # its own limit (1 a minute), served by vLLM's ft-a under another public name
        first = await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-limited"), headers=AUTH)
        assert first.status_code == 200 and first.json()["model"] == "ft-limited"
        again = await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-limited"), headers=AUTH)
        assert again.status_code == 429
        assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-a"), headers=AUTH)).status_code == 200
        report = await gw.state.report(3600)
        assert report["models"]["ft-a"]["owned"]["requests"] == 2


async def _true(value: bool) -> bool:
    return value


async def test_a_slow_load_is_bounded_and_the_next_call_loads_again(adapter_dirs):
    a = sim(lora_load_ms=3000)
    async with serve_app(a) as url_a, running_gateway(lora_policy(adapter_dirs, url_a, load_timeout=0.5)) as gw, \
            httpx.AsyncClient(timeout=30, headers=AUTH) as http:
        slow = await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-a"))
        assert slow.status_code == 504
        error = slow.json()["error"]
        assert error["code"] == "adapter_load_failed" and "ft-a" in error["message"]
        assert "lora.load_timeout" in error["message"]
        assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat("m"))).status_code == 200
        assert gw.state.replicas.by_model["m"][0].in_flight == 0  # the slot the load held is back


async def test_adapters_the_replicas_hold_are_models_with_discover(adapter_dirs):
    a, b = sim(), sim()
    async with serve_app(a) as url_a, serve_app(b) as url_b:
        policy = lora_policy(adapter_dirs, url_a, url_b, refresh_seconds=0.1, discover=True)
        async with running_gateway(policy) as gw, httpx.AsyncClient(timeout=30, headers=AUTH) as http:
            async with httpx.AsyncClient() as direct:  # loaded by hand on b, under a name the policy does not know
                loaded = await direct.post(f"{url_b}/v1/load_lora_adapter",
                                           json={"lora_name": "by-hand", "lora_path": str(adapter_dirs / "ft-c")})
                assert loaded.status_code == 200

            async def listed() -> bool:
                models = (await http.get(f"{gw.url}/v1/models")).json()["data"]
                return any(m["id"] == "by-hand" and m.get("parent") == "m" for m in models)

            await eventually(listed)
            for _ in range(3):
                reply = await http.post(f"{gw.url}/v1/chat/completions", json=chat("by-hand"))
                assert reply.status_code == 200 and reply.json()["model"] == "by-hand"
            assert b.lora.loads == 1 and a.lora.loads == 0  # served where it is
            assert await gw.metric("llm_gateway_requests_total", model="by-hand") == 3
            report = await gw.state.report(3600)  # a model in the own-or-rent report too, priced as its base
            assert report["models"]["by-hand"]["owned"]["requests"] == 3
            b.lora.loaded.clear()  # gone from b: no longer a model once the gateway has read b again

            async def gone() -> bool:
                return not await listed()

            await eventually(gone)
            assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat("by-hand"))).status_code == 404
            report = await gw.state.report(3600)  # served in the window, since unloaded: its calls still count
            assert report["models"]["by-hand"]["owned"]["requests"] == 3


async def test_an_adapter_as_a_variant_of_its_base(adapter_dirs):
    """A fine-tune canaried against its base on the same replica: a sticky session of the candidate is served by
    the adapter (loaded on demand), the other variant by the base, both answering as the model."""
    a = sim()
    async with serve_app(a) as url_a:
        policy = {"models": [{"name": "m", "served_name": "served-m", "sticky": {"header": "x-session-id"},
                              "variants": [
                                  {"name": "base", "weight": 50, "backends": [{"url": url_a, "name": "m-base"}]},
                                  {"name": "ft", "weight": 50, "backends": [{"url": url_a, "name": "m-ft"}],
                                   "adapter": {"name": "ft-a", "path": str(adapter_dirs / "ft-a")}}]}],
                  "health": {"interval": 0.2, "backoff_initial": 0.2, "backoff_max": 1}}
        async with running_gateway(policy) as gw, httpx.AsyncClient(timeout=30, headers=AUTH) as http:
            seen = {}
            for session in range(16):
                reply = await http.post(f"{gw.url}/v1/chat/completions", json=chat("m"),
                                        headers={"x-session-id": f"s{session}"})
                assert reply.status_code == 200 and reply.json()["model"] == "m"
                seen.setdefault(reply.headers["x-gateway-variant"], 0)
                seen[reply.headers["x-gateway-variant"]] += 1
            assert set(seen) == {"base", "ft"}
            assert a.lora.loads == 1 and a.lora.holds("ft-a")
            assert await gw.metric("llm_gateway_lora_events_total", adapter="ft-a", event="load") == 1


async def test_a_caller_that_leaves_during_the_load_does_not_fail_the_others(adapter_dirs):
    a = sim(lora_load_ms=1500)
    async with serve_app(a) as url_a, running_gateway(lora_policy(adapter_dirs, url_a)) as gw, \
            httpx.AsyncClient(timeout=30, headers=AUTH) as http:
        first = asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-a")))
        await asyncio.sleep(0.3)
        second = asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-a")))
        await asyncio.sleep(0.3)
        first.cancel()  # its client leaves while the load it started is under way
        reply = await second
        assert reply.status_code == 200 and reply.json()["model"] == "ft-a"
        assert a.lora.loads == 1


async def test_loads_of_different_adapters_on_one_replica_keep_to_max_loras(adapter_dirs):
    (adapter_dirs / "ft-d").mkdir()
    (adapter_dirs / "ft-d" / "adapter_config.json").write_text("{}")
    a = sim(lora_load_ms=300)
    async with serve_app(a) as url_a:
        policy = lora_policy(adapter_dirs, url_a, max_loras=2)
        policy["models"][0]["lora"]["adapters"].append({"name": "ft-d", "path": str(adapter_dirs / "ft-d")})
        async with running_gateway(policy) as gw, httpx.AsyncClient(timeout=30, headers=AUTH) as http:
            for name in ("ft-a", "ft-b"):  # both held, both idle
                assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat(name))).status_code == 200
            replies = await asyncio.gather(*(http.post(f"{gw.url}/v1/chat/completions", json=chat(name))
                                             for name in ("ft-c", "ft-d")))
            assert [r.status_code for r in replies] == [200, 200]
            assert sorted(a.lora.loaded) == ["ft-c", "ft-d"]  # each load unloaded one: never three held
            assert a.lora.unloads == 2


async def test_an_adapters_call_is_traced_under_its_name(adapter_dirs):
    a = sim()
    with Receiver() as receiver:
        async with serve_app(a) as url_a:
            policy = {**lora_policy(adapter_dirs, url_a),
                      "tracing": {"enabled": True, "endpoint": receiver.url, "schedule_delay": 0.1}}
            async with running_gateway(policy) as gw, httpx.AsyncClient(timeout=30, headers=AUTH) as http:
                assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat("ft-a-latest"))).status_code == 200
                (root,) = await asyncio.to_thread(receiver.wait_for, lambda s: s.kind == 2 and s.name == "chat ft-a")
    assert root.attributes["llm_gateway.lora_adapter"] == "ft-a"


async def test_an_adapter_shares_its_bases_cap_and_queue(adapter_dirs):
    a = sim(step_base_ms=20, step_ms_per_seq=0)
    async with serve_app(a) as url_a:
        policy = lora_policy(adapter_dirs, url_a)
        policy["models"][0]["backends"][0]["cap"] = 1
        async with running_gateway(policy) as gw, httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            long = {**chat("ft-a"), "max_tokens": 40, "ignore_eos": True}  # ~0.8 s of decoding
            first = asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=long))
            replica = gw.state.replicas.by_model["m"][0]
            await eventually(lambda: _true(replica.in_flight == 1))
            base = await http.post(f"{gw.url}/v1/chat/completions", json=chat("m"))
            assert base.status_code == 200 and (await first).status_code == 200
            assert float(base.headers["x-gateway-queue-ms"]) > 200  # it waited for the adapter's call to end
            assert await gw.metric("llm_gateway_queue_wait_seconds_count", model="m") >= 1  # the base's queue
