"""Teams on the embedded store: the admin API keeps every key inside its team, a team admin reaches only its
own team's keys, and the request path holds a team's keys to its models, limits and budget together."""

import asyncio
import time

import httpx
import jwt
import openai
import pytest

from gateway.cli import main
from tests.support.gateway import running_gateway
from tests.support.recorder import Recorder
from tests.support.servers import serve_app

SECRET = "s" * 40


def token(role: str = "admin", **claims) -> dict:
    now = int(time.time())
    body = {"iss": "llm-gateway", "aud": "llm-gateway-admin", "sub": "t", "role": role, "iat": now, "nbf": now,
            "exp": now + 86400, **claims}  # minted when the module is collected: outlive the whole suite
    return {"authorization": f"Bearer {jwt.encode(body, SECRET, algorithm='HS256')}"}


ADMIN = token()


@pytest.fixture
async def env(monkeypatch):
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    async with serve_app(Recorder()) as up:
        policy = {"models": [{"name": "m", "backends": [{"url": up}]}, {"name": "other", "backends": [{"url": up}]}],
                  "auth": {"cache_seconds": 30}}
        async with running_gateway(policy, issue_test_key=False) as gw, httpx.AsyncClient(timeout=10) as http:

            async def call(method, path, headers=ADMIN, **kw):
                return await http.request(method, f"{gw.url}/admin{path}", headers=headers, **kw)

            yield gw, call


def sdk(gw, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


async def new_key(call, headers=ADMIN, **fields) -> tuple[str, dict]:
    r = await call("POST", "/keys", headers=headers, json={"name": "k", **fields})
    assert r.status_code == 201, r.text
    return r.json()["key"], r.json()["record"]


async def test_a_key_may_only_narrow_its_team_and_nothing_half_applies(env):
    _, call = env
    r = await call("POST", "/teams", json={"name": "search", "models": ["m"], "limits": {"requests_per_minute": 10},
                                           "budget": {"max_tokens_per_period": 1000}})
    assert r.status_code == 201, r.text
    assert r.json()["data_policy"] == "private_only"  # the safe ceiling unless the admin says otherwise
    assert (await call("POST", "/teams", json={"name": "search"})).status_code == 409

    refused = {
        "limits.requests_per_minute": {"limits": {"requests_per_minute": 20}},
        "models": {"models": ["m", "other"]},
        "data_policy": {"data_policy": "allow_rented"},
        "budget.max_tokens_per_period": {"budget": {"max_tokens_per_period": 5000}},
    }
    for field, fields in refused.items():
        r = await call("POST", "/keys", json={"name": "k", "team": "search", **fields})
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "exceeds_team" and error["param"] == field and field in error["message"]
    r = await call("POST", "/keys", json={"name": "k", "team": "nosuch"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "team_not_found"
    assert (await call("GET", "/keys")).json() == []  # none of those was created

    _, record = await new_key(call, team="search", limits={"requests_per_minute": 5})
    r = await call("PATCH", f"/keys/{record['id']}", json={"limits": {"requests_per_minute": 50}})
    assert r.status_code == 409 and "requests_per_minute 50 is above team search's 10" in r.json()["error"]["message"]
    assert (await call("GET", f"/keys/{record['id']}")).json()["limits"]["requests_per_minute"] == 5

    r = await call("PATCH", "/teams/search", json={"limits": {"requests_per_minute": 3}})
    assert r.status_code == 409, r.text
    assert record["id"] in r.json()["error"]["message"] and r.json()["error"]["code"] == "team_below_keys"
    assert (await call("GET", "/teams/search")).json()["limits"]["requests_per_minute"] == 10
    r = await call("PATCH", "/teams/search", json={"limits": {"requests_per_minute": 5}, "description": "d"})
    assert r.status_code == 200 and r.json()["limits"]["requests_per_minute"] == 5

    r = await call("DELETE", "/teams/search")
    assert r.status_code == 409 and record["id"] in r.json()["error"]["message"]
    assert (await call("POST", f"/keys/{record['id']}/revoke")).status_code == 200
    assert (await call("DELETE", "/teams/search")).status_code == 200
    assert (await call("GET", "/teams/search")).status_code == 404


async def test_a_team_admin_manages_only_its_own_teams_keys(env):
    _, call = env
    for name in ("red", "blue"):
        assert (await call("POST", "/teams", json={"name": name})).status_code == 201
    _, blue = await new_key(call, team="blue")
    _, loose = await new_key(call)
    red_admin = token("team_admin", team="red")

    _, mine = await new_key(call, headers=red_admin, name="mine")
    assert mine["team"] == "red"  # a team admin's keys are its team's
    assert [k["id"] for k in (await call("GET", "/keys", headers=red_admin)).json()] == [mine["id"]]
    for other in (blue, loose):
        for method, path, body in (("GET", "", None), ("PATCH", "", {"name": "x"}), ("POST", "/revoke", None),
                                   ("POST", "/rotate", None), ("GET", "/usage", None), ("GET", "/budget", None)):
            r = await call(method, f"/keys/{other['id']}{path}", headers=red_admin, json=body)
            assert r.status_code == 403, (method, path, r.text)
    refusals = [
        ("POST", "/keys", {"name": "k", "team": "blue"}), ("PATCH", f"/keys/{mine['id']}", {"team": "blue"}),
        ("PATCH", f"/keys/{mine['id']}", {"team": None}), ("GET", "/keys?team=blue", None),
        ("POST", "/teams", {"name": "green"}), ("PATCH", "/teams/red", {"limits": {"max_concurrent": 100}}),
        ("DELETE", "/teams/red", None), ("GET", "/teams/blue", None), ("GET", "/teams/blue/usage", None),
        ("GET", "/report", None), ("GET", "/report?team=blue", None), ("GET", "/replicas", None),
        ("GET", "/policy", None),
    ]
    for method, path, body in refusals:
        r = await call(method, path, headers=red_admin, json=body)
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["error"]["type"]  # the OpenAI error shape
    assert (await call("GET", f"/keys/{blue['id']}")).json()["revoked"] is False  # untouched
    assert [t["name"] for t in (await call("GET", "/teams", headers=red_admin)).json()] == ["red"]
    for path in ("/teams/red", "/teams/red/usage", "/teams/red/budget", "/report?team=red",
                 f"/keys/{mine['id']}/usage"):
        assert (await call("GET", path, headers=red_admin)).status_code == 200, path
    r = await call("POST", f"/keys/{mine['id']}/rotate", headers=red_admin, json={"grace_seconds": 0})
    assert r.status_code == 200
    assert (await call("POST", f"/keys/{mine['id']}/revoke", headers=red_admin)).status_code == 200
    # a team_admin token must name a team
    assert (await call("GET", "/keys", headers=token("team_admin"))).status_code == 401
    assert (await call("GET", "/keys", headers=token("team_admin", team="Not A Name"))).status_code == 401


async def test_team_models_limits_usage_and_report_on_the_request_path(env):
    gw, call = env
    r = await call("POST", "/teams", json={"name": "ads", "models": ["m"], "limits": {"requests_per_minute": 3}})
    assert r.status_code == 201
    first, one = await new_key(call, team="ads")
    second, two = await new_key(call, team="ads", limits={"requests_per_minute": 3})
    outsider, _ = await new_key(call, limits={"requests_per_minute": 3})

    a, b = sdk(gw, first), sdk(gw, second)
    assert [m.id async for m in a.models.list()] == ["m"]  # the key has no list: its team's
    with pytest.raises(openai.PermissionDeniedError, match="team ads may not use model other"):
        await a.chat.completions.create(model="other", messages=[])
    await a.chat.completions.create(model="m", messages=[])
    await b.chat.completions.create(model="m", messages=[])
    await a.chat.completions.create(model="m", messages=[])
    with pytest.raises(openai.RateLimitError, match="team ads"):  # the fourth of the team's, whichever key
        await b.chat.completions.create(model="m", messages=[])
    await sdk(gw, outsider).chat.completions.create(model="m", messages=[])  # another key is not the team's

    deadline = time.monotonic() + 30
    while True:  # usage is written off the request path
        usage = (await call("GET", "/teams/ads/usage")).json()
        if usage["total"].get("requests") == 3 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert usage["total"]["requests"] == 3 and usage["keys"][one["id"]]["requests"] == 2
    assert usage["keys"][two["id"]]["requests"] == 1
    report = (await call("GET", "/report?window=3600")).json()
    assert report["teams"]["ads"]["requests"] == 3
    only = (await call("GET", "/report?window=3600&team=ads")).json()
    assert set(only["keys"]) == {one["id"], two["id"]} and only["models"]["m"]["owned"]["requests"] == 3


async def test_a_team_budget_counts_every_key_of_the_team(env):
    gw, call = env
    # every answer uses 10 tokens; each call is admitted while used + its estimate fits in 25
    r = await call("POST", "/teams", json={"name": "lab", "budget": {"max_tokens_per_period": 25, "period": "day"}})
    assert r.status_code == 201
    keys = [(await new_key(call, team="lab"))[0] for _ in range(2)]
    served = 0
    with pytest.raises(openai.RateLimitError, match="Team lab has used its 25 tokens"):
        for i in range(10):
            await sdk(gw, keys[i % 2]).chat.completions.create(model="m", messages=[], max_tokens=1)
            served += 1
    assert 2 <= served <= 3, served  # both keys' calls counted against one budget
    status = (await call("GET", "/teams/lab/budget")).json()
    assert status["id"] == "lab" and status["tokens"] == 10 * served and status["max_tokens_per_period"] == 25
    outsider, _ = await new_key(call, budget={"max_tokens_per_period": 25})
    await sdk(gw, outsider).chat.completions.create(model="m", messages=[], max_tokens=1)  # not the team's


async def test_a_teams_priority_ceiling_binds_its_admin_its_keys_and_its_clients(monkeypatch):
    """A team admin cannot lift its keys above the team's max_priority_class, and a key allowed to pick its
    class by header is still served at most at the ceiling: the backend (priority scheduling) gets the
    clamped class's vLLM priority, not the one asked for."""
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    backend = Recorder()
    classes = [{"name": "urgent", "vllm_priority": -5}, {"name": "interactive"},
               {"name": "batch", "vllm_priority": 10}]
    async with serve_app(backend) as up:
        policy = {"models": [{"name": "m", "backends": [{"url": up, "scheduling_policy": "priority"}]}],
                  "priorities": {"classes": classes}}
        async with running_gateway(policy, issue_test_key=False) as gw, httpx.AsyncClient(timeout=10) as http:

            async def call(method, path, headers=ADMIN, **kw):
                return await http.request(method, f"{gw.url}/admin{path}", headers=headers, **kw)

            r = await call("POST", "/teams", json={"name": "red", "max_priority_class": "urgnet"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "max_priority_class", r.text
            assert "urgnet" in r.json()["error"]["message"]
            assert (await call("GET", "/teams")).json() == []
            r = await call("POST", "/teams", json={"name": "red", "max_priority_class": "interactive"})
            assert r.status_code == 201 and r.json()["max_priority_class"] == "interactive"

            red_admin = token("team_admin", team="red")
            r = await call("POST", "/keys", headers=red_admin, json={"name": "k", "priority_class": "urgent"})
            assert r.status_code == 409, r.text
            assert r.json()["error"]["code"] == "exceeds_team" and r.json()["error"]["param"] == "priority_class"
            assert (await call("GET", "/keys")).json() == []  # nothing stored
            secret, record = await new_key(call, headers=red_admin, priority_class="interactive",
                                           client_priority=True)
            r = await call("PATCH", f"/keys/{record['id']}", headers=red_admin, json={"priority_class": "urgent"})
            assert r.status_code == 409 and r.json()["error"]["code"] == "exceeds_team"
            assert (await call("GET", f"/keys/{record['id']}")).json()["priority_class"] == "interactive"
            r = await call("PATCH", "/teams/red", headers=red_admin, json={"max_priority_class": None})
            assert r.status_code == 403  # only a full admin changes the team

            async def sent_priority(extra: dict, body: dict | None = None) -> int:
                r = await http.post(f"{gw.url}/v1/chat/completions", headers={
                    "authorization": f"Bearer {secret}", **extra}, json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}], **(body or {})})
                assert r.status_code == 200, r.text
                return backend.requests[-1]["body"]["priority"]

            assert await sent_priority({"x-priority-class": "urgent"}) == 0  # clamped to interactive
            assert await sent_priority({}, {"priority": -100}) == 0  # its own vLLM priority ahead of it: dropped
            assert await sent_priority({"x-priority-class": "batch"}) == 10  # below the ceiling: as asked

            r = await call("PATCH", "/teams/red", json={"max_priority_class": "batch"})
            assert r.status_code == 409 and r.json()["error"]["code"] == "team_below_keys"
            assert record["id"] in r.json()["error"]["message"]
            assert (await call("GET", "/teams/red")).json()["max_priority_class"] == "interactive"
            r = await call("PATCH", f"/keys/{record['id']}", json={"priority_class": None})
            assert r.status_code == 200, r.text
            r = await call("PATCH", "/teams/red", json={"max_priority_class": "batch"})
            assert r.status_code == 200 and r.json()["max_priority_class"] == "batch"
            assert await sent_priority({"x-priority-class": "urgent"}) == 10

            admin_token = ADMIN["authorization"].removeprefix("Bearer ")
            cli = ["teams", "--url", gw.url, "--token", admin_token, "--json", "update", "red"]
            assert await asyncio.to_thread(main, [*cli, "--max-priority-class", "interactive"]) == 0
            assert (await call("GET", "/teams/red")).json()["max_priority_class"] == "interactive"
            assert await sent_priority({"x-priority-class": "urgent"}) == 0
            assert await asyncio.to_thread(main, [*cli, "--no-max-priority-class"]) == 0
            assert (await call("GET", "/teams/red")).json()["max_priority_class"] is None
            assert await sent_priority({"x-priority-class": "urgent"}) == -5  # no ceiling: as the client asks
