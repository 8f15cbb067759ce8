"""JSON bodies nested past the gateway's bound are a 400 in the route's own error shape, never a 500.

100,000 levels of arrays or objects (orjson refuses past 1024, Litestar's msgspec decoder and Python code walking a
value would recurse), and 200 to 1000 levels (parsed fine, but past the bound: orjson writes at most 254 levels
when the body is forwarded, so 300 was a 500) to every admin write route, the OpenAI routes and Anthropic's
/v1/messages; a body as deep as a real tool schema still passes; the gateway answers normally afterwards.
"""
from __future__ import annotations

import httpx
import pytest

from tools.simulator import SimConfig
from tools.simulator import create_app as simulator
from gateway.admin.auth import mint_token
from policies.json_depth import MAX_JSON_DEPTH
from policies.config import Admin
from tests.support.gateway import AUTH, TEST_KEY, one_model, running_gateway
from tests.support.probes import eventually
from tests.support.servers import serve_app

SECRET = "j" * 40
KEY_ID = TEST_KEY.split("-")[1]


def deep_array(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def deep_object(levels: int) -> bytes:
    return b'{"a":' * (levels - 1) + b"{}" + b"}" * (levels - 1)


def deep_field(levels: int, **fields) -> bytes:
    """A body whose own fields are fine but one field nests `levels` deep in all (arrays of objects)."""
    import orjson

    head = orjson.dumps(fields)[:-1]
    inner = levels - 1  # the top object is level 1
    return head + b',"x":' + b'[{"a":' * (inner // 2) + b"1" + b"}]" * (inner // 2) + b"}"


# a well-formed body with one field this deep: 300 and 1000 were a 500 (orjson cannot write them back to the
# backend), 200 went through unbounded
FIELD_LEVELS = (200, 300, 1000)
BODIES = {
    "array 100k": deep_array(100_000),
    "object 100k": deep_object(100_000),
    "array 200": deep_array(200),
    "object 200": deep_object(200),
}


@pytest.fixture(autouse=True)
def admin_secret(monkeypatch):
    monkeypatch.setenv(Admin().jwt_secret_env, SECRET)


def admin() -> dict[str, str]:
    return {"authorization": f"Bearer {mint_token(Admin(), 600, role='admin', secret=SECRET)}",
            "content-type": "application/json"}


def openai_refusal(r: httpx.Response, what: str) -> None:
    assert r.status_code == 400, (what, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["code"] == "json_too_deep" and f"{MAX_JSON_DEPTH} levels" in error["message"], (what, error)


async def test_deep_bodies_to_the_admin_write_routes_are_400_naming_the_bound():
    async with running_gateway(one_model("http://127.0.0.1:9")) as gw, \
            httpx.AsyncClient(base_url=gw.url, headers=admin(), timeout=60) as http:
        routes = [("POST", "/admin/keys"), ("POST", "/admin/teams"), ("PATCH", f"/admin/keys/{KEY_ID}"),
                  ("POST", f"/admin/keys/{KEY_ID}/rotate"), ("PATCH", "/admin/teams/red"),
                  ("PUT", "/admin/models/m/variants")]
        for method, path in routes:
            for what, body in {**BODIES, **{f"field {n}": deep_field(n, name="x") for n in FIELD_LEVELS}}.items():
                r = await http.request(method, path, content=body)
                openai_refusal(r, f"{method} {path} {what}")
        assert (await http.get("/health")).status_code == 200
        r = await http.post("/admin/keys", json={"name": "after", "limits": {"requests_per_minute": 5}})
        assert r.status_code == 201, r.text[:300]
        r = await http.patch(f"/admin/keys/{KEY_ID}", json={"name": "renamed"})
        assert r.status_code == 200 and r.json()["name"] == "renamed", r.text[:300]
        r = await http.post("/admin/teams", json={"name": "red"})
        assert r.status_code == 201, r.text[:300]


async def test_deep_bodies_to_the_openai_and_anthropic_routes_are_400_in_their_shapes():
    async with serve_app(simulator(SimConfig(model="served-m", step_base_ms=1))) as sim, \
            running_gateway(one_model(sim)) as gw, \
            httpx.AsyncClient(base_url=gw.url, headers={**AUTH, "content-type": "application/json"},
                              timeout=60) as http:
        await eventually(lambda: _ready(gw), 20)
        for path in ("/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/embeddings"):
            fields = {f"field {n}": deep_field(n, model="m", prompt="x", max_tokens=1) for n in FIELD_LEVELS}
            for what, body in {**BODIES, **fields}.items():
                openai_refusal(await http.post(path, content=body), f"{path} {what}")
        for what, body in {**BODIES, **{f"field {n}": deep_field(n, model="m", max_tokens=1)
                                        for n in FIELD_LEVELS}}.items():
            r = await http.post("/v1/messages", content=body)
            assert r.status_code == 400, (what, r.status_code, r.text[:300])
            answer = r.json()
            assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
            assert f"{MAX_JSON_DEPTH} levels" in answer["error"]["message"], answer
        # as deep as a real tool schema (well within the bound): served
        deep_ok = deep_field(40, model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        r = await http.post("/v1/chat/completions", content=deep_ok)
        assert r.status_code == 200, r.text[:300]
        assert (await http.get("/health")).status_code == 200
        r = await http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1,
                                                          "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text[:300]


async def _ready(gw) -> bool:
    return bool(gw.state.replicas.ready().get("m"))
