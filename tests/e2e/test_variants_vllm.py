"""Variants of one model on two real vLLM servers: `a` (tiny-a, weight 80) and `b` (tiny-b, weight 20).

Where requests land is read from each vLLM's OWN counter (vllm:request_success_total), never from the
gateway. Requests are kept short (max_tokens 1-4) and their concurrency bounded, so the module takes seconds.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import gateway_process, started
from tests.e2e.test_routing_vllm import SUCCESS, counters, served_by
from tests.e2e.vllm_procs import VLLMServer, default_model_dir, free_port

HEADER = "x-gateway-variant"


@pytest.fixture(scope="module")
def canary(vllm_servers, tmp_path_factory):
    a, b = vllm_servers["a"], vllm_servers["b"]
    policy = canary_policy({
        "sticky": {"header": "x-session-id"},
        "variants": [
            {"name": "a", "weight": 80, "served_name": "tiny-a", "backends": [{"url": a.base_url, "cap": 8}]},
            {"name": "b", "weight": 20, "served_name": "tiny-b", "backends": [{"url": b.base_url, "cap": 8}]},
        ],
    })
    with gateway_process(policy, tmp_path_factory.mktemp("variants-gateway")) as gw:
        yield gw


def canary_policy(model: dict) -> dict:
    """A gateway policy with one model, `canary`, made of `model`'s variants (and guard, stickiness)."""
    return {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "health": {"interval": 1, "backoff_initial": 0.5, "backoff_max": 2},
        "timeouts": {"connect": 2, "read": 120},
        "models": [{"name": "canary", **model}],
    }


def weights_of(weights: dict[str, float]) -> dict:
    return {"weights": [{"name": name, "weight": weight} for name, weight in weights.items()]}


def canary_guard(gw, variant: str) -> dict:
    """The guard's view of one variant of the model `canary`, as the admin API gives it to a viewer."""
    view = httpx.get(f"{gw.url}/admin/models/canary/variants", timeout=10,
                     headers={"authorization": f"Bearer {gw.admin_token('viewer')}"}).json()
    return next(v for v in view["variants"] if v["name"] == variant)["guard"]


def servers_of(vllm_servers) -> dict:
    return {"a": vllm_servers["a"], "b": vllm_servers["b"]}


async def send_many(gw, n: int, concurrency: int, **extra) -> list[str]:
    """`n` short chat requests, at most `concurrency` at once; the variant each reply names."""
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.key, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> str:
        async with gate:
            raw = await client.chat.completions.with_raw_response.create(
                model="canary", messages=[{"role": "user", "content": f"count {i}"}], max_tokens=1, **extra)
            raw.parse()
            return raw.headers[HEADER]

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


async def stream_load(gw, n: int, concurrency: int, max_tokens: int = 12) -> None:
    """`n` streamed chat requests of `max_tokens` tokens each (ignore_eos), at most `concurrency` at once."""
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.key, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            stream = await client.chat.completions.create(
                model="canary", messages=[{"role": "user", "content": f"tell {i}"}], max_tokens=max_tokens,
                stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                pass

    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


def test_500_requests_split_80_20_at_the_servers_own_counters(canary, vllm_servers):
    servers = servers_of(vllm_servers)
    before = counters(servers, SUCCESS)
    named = asyncio.run(send_many(canary, 500, concurrency=8))
    done = served_by(servers, before, expected=500)
    assert sum(done.values()) == 500, done  # nothing else ran on them meanwhile, nothing was lost
    share_b = done["b"] / 500
    assert abs(share_b - 0.20) <= 0.03, done
    assert named.count("b") == done["b"]  # the response header names the variant that really served it
    # the variant is in the gateway's metrics and its access log
    assert canary.metric("llm_gateway_variant_requests_total", model="canary", variant="b", status="200") >= done["b"]
    log = canary.log.read_text()
    assert "model=canary" in log and "variant=b" in log and "variant=a" in log


def test_every_turn_of_a_conversation_stays_on_one_variant(canary, vllm_servers):
    servers = servers_of(vllm_servers)
    client = openai.OpenAI(base_url=f"{canary.url}/v1", api_key=canary.key, max_retries=0)
    seen: dict[str, set[str]] = {}
    for c in range(12):
        session = f"conversation-{c}-{random.random()}"
        messages = [{"role": "system", "content": f"conversation {c}"}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"turn {turn}"})
            before = counters(servers, SUCCESS)
            raw = client.chat.completions.with_raw_response.create(
                model="canary", messages=messages, max_tokens=2, extra_headers={"x-session-id": session})
            reply = raw.parse()
            done = served_by(servers, before)
            landed = {k for k, v in done.items() if v}
            assert landed == {raw.headers[HEADER]}, (session, done)
            seen.setdefault(session, set()).update(landed)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or "."})
    assert all(len(variants) == 1 for variants in seen.values()), seen
    assert {v for variants in seen.values() for v in variants} <= {"a", "b"}


def test_weight_changes_under_streaming_load_fail_nothing(canary, vllm_servers):
    servers = servers_of(vllm_servers)
    operator = canary.admin_token("operator")
    viewer = canary.admin_token("viewer")
    admin = httpx.Client(base_url=f"{canary.url}/admin", timeout=10)
    url = "/models/canary/variants"
    assert admin.put(url, json=weights_of({"a": 1}), headers={"authorization": f"Bearer {viewer}"}).status_code == 403
    bad = admin.put(url, json=weights_of({"c": 1}), headers={"authorization": f"Bearer {operator}"})
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "variant_not_found"
    none = admin.put(url, json=weights_of({"a": 0, "b": 0}), headers={"authorization": f"Bearer {operator}"})
    assert none.status_code == 409 and none.json()["error"]["code"] == "no_live_weight"

    async def streams(n: int, concurrency: int) -> list[tuple[str | None, int]]:
        client = openai.AsyncOpenAI(base_url=f"{canary.url}/v1", api_key=canary.key, max_retries=0)
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int):
            async with gate:
                stream = await client.chat.completions.create(
                    model="canary", messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=4,
                    stream=True)
                finish, chunks = None, 0
                async for chunk in stream:
                    chunks += 1
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                return finish, chunks

        try:
            return await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            await client.close()

    async def flip() -> list[int]:
        codes = []
        for weights in ({"a": 20, "b": 80}, {"a": 50, "b": 50}, {"a": 0, "b": 1}, {"a": 1, "b": 0},
                        {"a": 80, "b": 20}):
            await asyncio.sleep(0.2)
            r = await asyncio.to_thread(admin.put, url, json=weights_of(weights),
                                        headers={"authorization": f"Bearer {operator}"})
            codes.append(r.status_code)
        return codes

    async def both():
        return await asyncio.gather(streams(120, concurrency=6), flip())

    results, codes = asyncio.run(both())
    assert codes == [200] * 5
    assert all(finish is not None and chunks > 0 for finish, chunks in results), results

    # the last change is in force: all to b, then back
    headers = {"authorization": f"Bearer {operator}"}
    shown = admin.put(url, json=weights_of({"a": 0, "b": 5}), headers=headers).json()
    assert [(v["name"], v["weight"], v["filed_weight"]) for v in shown["variants"]] == [("a", 0, 80), ("b", 5, 20)]
    before = counters(servers, SUCCESS)
    assert set(asyncio.run(send_many(canary, 20, concurrency=4))) == {"b"}
    done = served_by(servers, before, expected=20)
    assert done["a"] == 0 and done["b"] == 20, done
    admin.put(url, json=weights_of({"a": 80, "b": 20}), headers=headers)
    assert admin.get(url, headers={"authorization": f"Bearer {viewer}"}).json()["variants"][0]["weight"] == 80


@pytest.fixture(scope="module")
def one_seq_vllm(vllm_servers, tmp_path_factory):
    """The tiny model again, started with a worse flag: `--max-num-seqs 1` (one sequence at a time), on the
    baseline's core (0): beside each other, both meet whatever else that core runs. On core 1, beside the idle
    tiny-b, it once met less than tiny-a on core 0 did, and its first tokens came at 0.76x the baseline's
    however it queued."""
    with started(VLLMServer(default_model_dir(), "tiny-one-seq", core=0, extra_args=("--max-num-seqs", "1"),
                            log_dir=tmp_path_factory.mktemp("vllm-one-seq-logs"), log_requests=False)) as server:
        yield server


def test_a_canary_with_a_worse_flag_is_pulled_back_on_latency_at_comparable_load(vllm_servers, one_seq_vllm,
                                                                                 tmp_path_factory):
    a = vllm_servers["a"]
    policy = canary_policy({
        "guard": {"min_samples": 12, "max_ttft_ratio": 2.0, "max_itl_ratio": None, "window_seconds": 900},
        "variants": [
            {"name": "base", "weight": 80, "served_name": "tiny-a", "backends": [{"url": a.base_url}]},
            {"name": "one-seq", "weight": 20, "served_name": "tiny-one-seq",
             "backends": [{"url": one_seq_vllm.base_url}]},
        ],
    })
    with gateway_process(policy, tmp_path_factory.mktemp("one-seq-gateway")) as gw:
        viewer = {"authorization": f"Bearer {gw.admin_token('viewer')}"}

        verdict = None
        for _ in range(6):  # bounded: at most 540 requests
            # light, then heavier: the baseline meets every load level the 20% canary meets, at some point
            asyncio.run(stream_load(gw, 30, concurrency=2, max_tokens=16))
            asyncio.run(stream_load(gw, 60, concurrency=10, max_tokens=16))
            verdict = httpx.get(f"{gw.url}/admin/variants", headers=viewer, timeout=10).json()["models"]["canary"]
            if verdict["variants"][1]["guard"]["state"] == "rolled_back":
                break
        base, one_seq = verdict["variants"]
        assert one_seq["guard"]["state"] == "rolled_back" and one_seq["weight"] == 0, json.dumps(verdict, indent=1)
        assert one_seq["guard"]["reason"].startswith("TTFT p50"), one_seq["guard"]
        shared = sorted(set(base["by_load"]) & set(one_seq["by_load"]))
        assert shared, verdict  # it was judged where both ran at the same load
        worse = [lvl for lvl in shared if one_seq["by_load"][lvl]["ttft_p50"] > base["by_load"][lvl]["ttft_p50"]]
        assert worse, verdict
        assert "rolled back (weight 20 -> 0): TTFT p50" in gw.log.read_text()


def test_a_default_guard_holds_an_identical_candidate_and_pulls_back_a_one_seq_one(vllm_servers, one_seq_vllm,
                                                                                   tmp_path_factory):
    """`guard: {}` on real vLLM. `same` is the baseline's own server under another variant's name, identical by
    construction (a second server is identical in flags, not in what else its core carries: README), at 50/50
    so that both meet the same loads and fill a level quickly; then `one-seq` (the tiny model with
    --max-num-seqs 1) takes its place. The first is judged at matched load, light (2 clients) and heavier (8),
    and held; the second, at 4 clients, is pulled back: about 2 in flight on each side, so each of its calls
    waits for the one before it. (At 2 clients, 50/50 sends the two sides their calls in turn, so it queued only
    now and then: its first tokens came at 1.7x the baseline's on a quiet machine, at 1.0x on a busy one.)"""
    a = vllm_servers["a"]
    policy = canary_policy({
        "guard": {},
        "variants": [
            {"name": "base", "weight": 50, "served_name": "tiny-a", "backends": [{"url": a.base_url}]},
            {"name": "same", "weight": 50, "served_name": "tiny-a", "backends": [{"url": a.base_url}]},
            {"name": "one-seq", "weight": 0, "served_name": "tiny-one-seq",
             "backends": [{"url": one_seq_vllm.base_url}]},
        ],
    })
    with gateway_process(policy, tmp_path_factory.mktemp("default-guard-gateway")) as gw:
        operator = {"authorization": f"Bearer {gw.admin_token('operator')}"}
        guard_of = functools.partial(canary_guard, gw)

        began = time.monotonic()
        same = guard_of("same")
        for _ in range(4):  # bounded: until both latency signals were judged at matched load
            asyncio.run(stream_load(gw, 100, concurrency=2))
            asyncio.run(stream_load(gw, 100, concurrency=8))
            same = guard_of("same")
            if same["state"] != "watching" or (same["undecided"] is None and {"itl", "ttft"} <= set(same["ratios"])):
                break
        print("identical candidate on real vLLM:", same, round(time.monotonic() - began, 1), "s")
        assert same["state"] == "watching" and same["undecided"] is None, same
        assert {"itl", "ttft"} <= set(same["ratios"]), same
        assert same["ratios"]["itl"] <= 1.2 and same["ratios"]["ttft"] <= 1.5, same

        moved = httpx.put(f"{gw.url}/admin/models/canary/variants", headers=operator, timeout=10,
                          json=weights_of({"same": 0, "one-seq": 50}))
        assert moved.status_code == 200, moved.text
        one_seq = guard_of("one-seq")
        for _ in range(4):  # bounded
            asyncio.run(stream_load(gw, 120, concurrency=4))
            one_seq = guard_of("one-seq")
            if one_seq["state"] == "rolled_back":
                break
        print("one-seq candidate on real vLLM:", one_seq, round(time.monotonic() - began, 1), "s")
        assert one_seq["state"] == "rolled_back", one_seq
        assert one_seq["reason"].startswith(("TTFT p50", "ITL p50")), one_seq
        assert guard_of("same")["state"] == "watching"


def test_a_steady_light_canary_is_load_matched_judged_and_an_identical_one_held(vllm_servers, tmp_path_factory):
    """`guard: {}` on real vLLM under a steady 16 clients at 80/20: the candidate (the baseline's own server
    under another variant's name, identical by construction) has near 3 calls in flight, the baseline near 13.
    Both meet the same server, and a call's load level counts every call in flight to it (Replica.server_in_flight),
    so the two are judged at the levels both met; were they counted by variant, the candidate's calls at "4"
    (some 17 on the server) would be set against the baseline's at 4 (a quiet server) and an identical candidate
    rolled back, as one was on a quick machine (ITL 1.30x). Where the levels still do not meet, the guard matches
    their load for a while and judges the calls sent meanwhile. Either way it is judged and held."""
    a = vllm_servers["a"]
    policy = canary_policy({
        "guard": {},
        "variants": [
            {"name": "base", "weight": 80, "served_name": "tiny-a", "backends": [{"url": a.base_url}]},
            {"name": "same", "weight": 20, "served_name": "tiny-a", "backends": [{"url": a.base_url}]},
        ],
    })
    with gateway_process(policy, tmp_path_factory.mktemp("load-matching-gateway")) as gw:
        guard = functools.partial(canary_guard, gw, "same")

        began = time.monotonic()
        same = guard()
        for _ in range(8):  # bounded: 1,600 requests at most; until a load matching began and ended judged
            asyncio.run(stream_load(gw, 200, concurrency=16))
            same = guard()
            if same["state"] != "watching" or (not same["load_matching"] and not same["undecided"] and same["ratios"]):
                break
        print("steady light canary on real vLLM:", same, round(time.monotonic() - began, 1), "s")
        assert same["state"] == "watching", same
        assert same["load_matching"] is None and same["undecided"] is None, same  # judged, load-matched or not
        assert same["ratios"]["itl"] <= 1.2 and same["ratios"]["ttft"] <= 1.5, same
        if same["load_matched_at"] is not None:
            log = gw.log.read_text()
            assert "matching their load" in log and "ended (judged at a load both met)" in log, log[-2000:]
