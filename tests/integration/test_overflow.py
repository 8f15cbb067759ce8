"""Own the base load, rent the bursts, never let private data leave.

The owned backend is a slow simulator capped at 2 in flight; the rented provider is a stand-in process on
loopback that needs its own key and logs every request it gets. Request ids tell the two keys apart there.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tools.simulator import SimConfig, create_app
from policies.keys import KeyRecord, hash_key, key_id_of, new_key, new_key_id
from policies.teams import TeamRecord
from tests.support.gateway import running_gateway
from tests.support.rented_standin import read_log, running_standin
from tests.support.servers import free_port, serve_app

SLOW = SimConfig(model="served-m", step_base_ms=20, step_ms_per_seq=0)  # ~50 tokens/s per request


@pytest.fixture
def standin(tmp_path, monkeypatch):
    log = str(tmp_path / "rented.jsonl")
    with running_standin(monkeypatch, log) as (url, key):
        yield url, log, key


def policy(owned: str, rented: str, **overflow) -> dict:
    return {
        "providers": [{"name": "standin", "base_url": rented, "api_key_env": "STANDIN_KEY",
                       "models": {"m": "rented-model"}, "allow_private_address": True,
                       "price_per_million_tokens": {"input": 1.0, "output": 2.0}}],
        "models": [{"name": "m", "served_name": "served-m", "backends": [{"url": owned, "cap": 2}],
                    "queue": {"max_depth": 100, "max_wait": 30},
                    "overflow": {"provider": "standin", "when_wait_exceeds": 0.2, **overflow}}],
    }


async def issue(gw, data_policy: str) -> str:
    key_id = new_key_id()
    key = new_key(key_id)
    await gw.state.store.create_key(KeyRecord(id=key_id, name=data_policy, created_at=time.time(),
                                              hash=hash_key(key), data_policy=data_policy))
    return key


async def test_burst_spills_only_for_keys_that_allow_it(standin):
    rented_url, log, provider_key = standin
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "ignore_eos": True}
    async with serve_app(create_app(SLOW)) as owned, running_gateway(policy(owned, rented_url)) as gw, \
            httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=40)) as http:
        renter, private = await issue(gw, "allow_rented"), await issue(gw, "private_only")

        async def send(key: str, rid: str) -> httpx.Response:
            return await http.post(f"{gw.url}/v1/chat/completions", json=body,
                                   headers={"authorization": f"Bearer {key}", "x-request-id": rid})

        replies = await asyncio.gather(*(send(renter, f"rent-{i}") for i in range(8)),
                                       *(send(private, f"priv-{i}") for i in range(8)))
        by_key = {"rent": replies[:8], "priv": replies[8:]}
        assert all(r.status_code == 200 for r in replies)  # the private ones waited for owned capacity
        rented = [r for r in by_key["rent"] if r.headers["x-gateway-served-by"] == "rented"]
        assert rented and all(r.json()["model"] == "m" for r in rented)
        assert all(r.headers["x-gateway-served-by"] == "owned" for r in by_key["priv"])
        entries = read_log(log)
        assert {e["request_id"] for e in entries} == {r.headers["x-request-id"] for r in rented}
        assert not [e for e in entries if e["request_id"].startswith("priv-")]  # private data never left
        assert all(e["authorized"] and e["model"] == "rented-model" for e in entries)

        # the burst is over: the next request is served at home again
        r = await send(renter, "rent-after")
        assert r.status_code == 200 and r.headers["x-gateway-served-by"] == "owned"
        assert len(read_log(log)) == len(entries)

        assert await gw.metric("llm_gateway_served_requests_total", served_by="rented") == len(rented)
        assert await gw.metric("llm_gateway_served_requests_total", served_by="owned") == 17 - len(rented)
        cost = await gw.metric("llm_gateway_rented_cost_total", provider="standin")
        assert cost == pytest.approx(len(rented) * (11 * 1.0 + 5 * 2.0) / 1e6)


async def test_unhealthy_owned_model_spills_and_private_gets_503(standin):
    rented_url, log, _ = standin
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_gateway(policy(dead, rented_url)) as gw, httpx.AsyncClient(timeout=10) as http:
        renter, private = await issue(gw, "allow_rented"), await issue(gw, "private_only")
        for stream in (False, True):
            r = await http.post(f"{gw.url}/v1/chat/completions", headers={"authorization": f"Bearer {renter}"},
                                json={"model": "m", "messages": [], "stream": stream})
            assert r.status_code == 200 and r.headers["x-gateway-served-by"] == "rented"
            assert "rented" in r.text
            if stream:
                assert '"usage"' not in r.text  # the usage chunk is stripped as for owned streams
        r = await http.post(f"{gw.url}/v1/chat/completions", headers={"authorization": f"Bearer {private}"},
                            json={"model": "m", "messages": []})
        assert r.status_code == 503
        assert len(read_log(log)) == 2


async def test_provider_key_errors_are_never_relayed(standin, monkeypatch):
    rented_url, log, provider_key = standin
    monkeypatch.setenv("STANDIN_KEY", provider_key[:-4] + "XXXX")  # the gateway reads a wrong key
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_gateway(policy(dead, rented_url)) as gw, httpx.AsyncClient(timeout=10) as http:
        renter = await issue(gw, "allow_rented")
        r = await http.post(f"{gw.url}/v1/chat/completions", headers={"authorization": f"Bearer {renter}"},
                            json={"model": "m", "messages": []})
        assert r.status_code == 502 and "XXXX" not in r.text and "credentials" in r.json()["error"]["message"]


@pytest.mark.parametrize("tracing", [False, True])
@pytest.mark.parametrize("send_trace_context", [False, True])
async def test_rented_provider_gets_trace_context_only_when_the_policy_asks(standin, tracing, send_trace_context):
    rented_url, log, _ = standin
    rules = policy(f"http://127.0.0.1:{free_port()}", rented_url)
    rules["providers"][0]["send_trace_context"] = send_trace_context
    if tracing:  # a collector nobody listens on: export fails quietly, the headers are what counts here
        rules["tracing"] = {"enabled": True, "endpoint": f"http://127.0.0.1:{free_port()}/v1/traces"}
    client_trace = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                    "tracestate": "vendor=private-tenant-42", "baggage": "user=alice"}
    async with running_gateway(rules) as gw, httpx.AsyncClient(timeout=10) as http:
        renter = await issue(gw, "allow_rented")
        for stream in (False, True):
            r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m", "messages": [], "stream": stream},
                                headers={"authorization": f"Bearer {renter}", **client_trace})
            assert r.status_code == 200 and r.headers["x-gateway-served-by"] == "rented"
    seen = [entry["trace"] for entry in read_log(log)]
    assert len(seen) == 2
    for trace in seen:
        assert "baggage" not in trace  # never forwarded to any upstream
        if send_trace_context:
            assert trace["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
            assert trace["tracestate"] == "vendor=private-tenant-42"
        else:
            assert trace == {}


async def test_a_team_that_keeps_data_private_holds_its_keys_at_home_whatever_they_say(standin):
    """The admin API never lets a key of a private_only team allow renting; should one say so anyway (written
    while its team changed), the request path still keeps it off the rented provider, until the team allows it."""
    rented_url, log, _ = standin
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_gateway(policy(dead, rented_url)) as gw, httpx.AsyncClient(timeout=10) as http:
        store = gw.state.store
        await store.create_team(TeamRecord(name="vault"))  # private_only, the default
        key = await issue(gw, "allow_rented")
        record = await store.get_key(key_id_of(key))
        await store.put_key(record.model_copy(update={"team": "vault"}))
        await gw.state.forget_key(record.id)

        async def ask() -> httpx.Response:
            return await http.post(f"{gw.url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                   json={"model": "m", "messages": []})

        assert (await ask()).status_code == 503 and read_log(log) == []  # nothing left for the provider
        await store.put_team(TeamRecord(name="vault", data_policy="allow_rented"))
        await gw.state.forget_key("team:vault")
        r = await ask()
        assert r.status_code == 200 and r.headers["x-gateway-served-by"] == "rented" and len(read_log(log)) == 1


async def test_a_teams_rented_budget_is_spent_by_all_its_keys_together(standin):
    rented_url, log, _ = standin
    dead = f"http://127.0.0.1:{free_port()}"  # every call rents
    async with running_gateway(policy(dead, rented_url)) as gw, httpx.AsyncClient(timeout=10) as http:
        # a call costs about (11 prompt + 5 completion tokens at 1 and 2 per million): 2.1e-5; the team has 5e-5
        await gw.state.store.create_team(TeamRecord(name="renters", data_policy="allow_rented",
                                                    budget={"max_rented_spend": 5e-5, "period": "day"}))
        keys = []
        for _ in range(2):
            key = await issue(gw, "allow_rented")
            record = await gw.state.store.get_key(key_id_of(key))
            await gw.state.store.put_key(record.model_copy(update={"team": "renters"}))
            keys.append(key)
        answers = []
        while len(answers) < 10 and (not answers or answers[-1].status_code == 200):
            answers.append(await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m", "messages": []},
                                           headers={"authorization": f"Bearer {keys[len(answers) % 2]}"}))
        served = len(answers) - 1
        assert answers[-1].status_code == 503 and "rented budget is spent" in answers[-1].text
        assert 2 <= served <= 3 and len(read_log(log)) == served  # both keys spent the one budget
