"""Keys end to end on the embedded store: the admin API issues them, the request path enforces them."""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jwt
import openai
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from gateway.admin import keys as key_admin
from gateway.admin.auth import mint_token
from policies.config import Admin
from policies.keys import KEY_PATTERN, new_key_id
from tests.support.gateway import one_model, running_gateway
from tests.support.recorder import Recorder
from tests.support.servers import serve_app

SECRET = "s" * 40
ADMIN = Admin()


def token(role="admin", **overrides) -> str:
    now = int(time.time())
    claims = {"iss": "llm-gateway", "aud": "llm-gateway-admin", "sub": "t", "role": role, "iat": now,
              "nbf": now, "exp": now + 600, **overrides}
    return jwt.encode({k: v for k, v in claims.items() if v is not None}, SECRET, algorithm="HS256")


def bearer(value: str) -> dict:
    return {"authorization": f"Bearer {value}"}


@pytest.fixture
async def env(monkeypatch):
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    rec = Recorder()
    policy = {
        "models": [{"name": "m", "backends": [{"url": "U"}]}, {"name": "other", "backends": [{"url": "U"}]}],
        "auth": {"cache_seconds": 30},  # this process drops a changed key from its cache at once
    }
    async with serve_app(rec) as up:
        for model in policy["models"]:
            model["backends"][0]["url"] = up
        async with running_gateway(policy, issue_test_key=False) as gw, httpx.AsyncClient(timeout=10) as http:
            admin = bearer(token())

            async def call(method, path, **kw):
                return await http.request(method, f"{gw.url}/admin{path}", headers=kw.pop("headers", admin), **kw)

            yield gw, http, call


def sdk(gw, key):
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


async def test_key_lifecycle(env):
    gw, http, call = env
    r = await call("POST", "/keys", json={"name": "app-1", "owner": "team-a", "limits": {"requests_per_minute": 5}})
    assert r.status_code == 201, r.text
    key, record = r.json()["key"], r.json()["record"]
    assert KEY_PATTERN.match(key) and record["name"] == "app-1" and record["data_policy"] == "private_only"
    assert record["limits"]["requests_per_minute"] == 5 and "hash" not in record

    listing = (await call("GET", "/keys")).text
    shown = (await call("GET", f"/keys/{record['id']}")).json()
    assert key not in listing and key.split("-")[2] not in listing and "hash" not in listing
    assert shown["id"] == record["id"] and shown["last_used_at"] is None

    client = sdk(gw, key)
    reply = await client.chat.completions.create(model="m", messages=[])
    assert reply.usage.completion_tokens == 3
    assert {m.id async for m in client.models.list()} == {"m", "other"}

    r = await call("PATCH", f"/keys/{record['id']}", json={"models": ["m"]})
    assert r.status_code == 200 and r.json()["models"] == ["m"]
    assert [m.id async for m in client.models.list()] == ["m"]
    with pytest.raises(openai.PermissionDeniedError, match="may not use model other"):
        await client.chat.completions.create(model="other", messages=[])

    for _ in range(50):  # usage is written off the request path
        usage = (await call("GET", f"/keys/{record['id']}/usage")).json()
        if usage["total"].get("requests") == 1:
            break
        await asyncio.sleep(0.02)
    assert usage["models"]["m"]["prompt_tokens"] == 7 and usage["models"]["m"]["completion_tokens"] == 3
    assert usage["total"]["requests"] == 1  # the 403 never reached a backend
    assert (await call("GET", f"/keys/{record['id']}")).json()["last_used_at"] is not None

    r = await call("POST", f"/keys/{record['id']}/revoke")
    assert r.status_code == 200 and r.json()["revoked"] is True
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model="m", messages=[])


async def test_rotation_keeps_the_old_secret_for_the_grace_period(env):
    gw, http, call = env
    old = (await call("POST", "/keys", json={"name": "rotating"})).json()
    # 2 s: both secrets are used within it even on a slow machine; then wait for its end as the record says
    r = await call("POST", f"/keys/{old['record']['id']}/rotate", json={"grace_seconds": 2.0})
    assert r.status_code == 200
    new, until = r.json()["key"], r.json()["record"]["previous_valid_until"]
    assert new != old["key"] and r.json()["record"]["id"] == old["record"]["id"]
    for key in (old["key"], new):
        assert (await sdk(gw, key).chat.completions.create(model="m", messages=[])).choices
    await asyncio.sleep(max(0.0, until - time.time()) + 0.1)
    with pytest.raises(openai.AuthenticationError):
        await sdk(gw, old["key"]).chat.completions.create(model="m", messages=[])
    assert (await sdk(gw, new).chat.completions.create(model="m", messages=[])).choices


async def test_expiry(env):
    gw, http, call = env
    # 2 s: used within it even on a slow machine; then wait for its end as the record says
    created = (await call("POST", "/keys", json={"name": "short", "expires_in": 2.0})).json()
    key = created["key"]
    assert (await sdk(gw, key).chat.completions.create(model="m", messages=[])).choices
    await asyncio.sleep(max(0.0, created["record"]["expires_at"] - time.time()) + 0.1)
    with pytest.raises(openai.AuthenticationError):
        await sdk(gw, key).chat.completions.create(model="m", messages=[])


async def test_every_bad_api_key_is_the_same_401(env):
    gw, http, call = env
    key = (await call("POST", "/keys", json={"name": "real"})).json()["key"]
    key_id = key.split("-")[1]
    forged = f"sk-{key_id}-{'A' * 43}"
    unknown = f"sk-{'0' * 16}-{'A' * 43}"
    headers = [{}, {"authorization": "Basic abc"}, {"authorization": "Bearer"}, bearer("sk-short"), bearer(forged), bearer(unknown),
               bearer(key + "x"), {"authorization": "Bearer " + "A" * 20000}, bearer(key.upper())]
    bodies = set()
    for h in headers:
        r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"}, headers=h)
        assert r.status_code == 401, (h, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key"
        bodies.add(error["message"])
        assert key_id not in r.text and "AAAA" not in r.text
        r = await http.get(f"{gw.url}/v1/models", headers=h)
        assert r.status_code == 401
    assert len(bodies) == 1  # nothing tells which part was wrong
    r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"}, headers=bearer(key))
    assert r.status_code == 200


async def test_bad_admin_tokens_are_401_never_500(env):
    gw, http, call = env
    none_alg = jwt.encode({"iss": "llm-gateway", "aud": "llm-gateway-admin", "role": "admin",
                           "exp": int(time.time()) + 60}, None, algorithm="none")
    wrong_key = jwt.encode({"iss": "llm-gateway", "aud": "llm-gateway-admin", "role": "admin",
                            "exp": int(time.time()) + 60}, "x" * 40, algorithm="HS256")
    bad = [
        None, "Bearer", "Basic Zm9vOmJhcg==", "Bearer not.a.jwt", "Bearer " + "a" * 9000, f"Bearer {none_alg}",
        f"Bearer {wrong_key}", f"Bearer {token(exp=int(time.time()) - 120)}", f"Bearer {token(nbf=int(time.time()) + 600)}",
        f"Bearer {token(aud='someone-else')}", f"Bearer {token(iss='elsewhere')}", f"Bearer {token(role='root')}",
        f"Bearer {token(exp=None)}", f"Bearer {token()[:-4]}", "Bearer \u00e9\u00e9",
    ]
    for value in bad:
        headers = {} if value is None else {"authorization": value.encode("utf-8")}
        r = await call("GET", "/keys", headers=headers)
        assert r.status_code == 401, (value, r.text)
        assert r.json()["error"]["code"] == "invalid_admin_token"
    viewer = bearer(token(role="viewer"))
    assert (await call("GET", "/keys", headers=viewer)).status_code == 200
    r = await call("POST", "/keys", headers=viewer, json={"name": "x"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "read_only_token"
    assert (await call("POST", "/keys", headers=bearer(mint_token(ADMIN, 60)), json={"name": "y"})).status_code == 201


async def test_admin_input_errors_are_openai_errors(env):
    gw, http, call = env
    for body in ({}, {"name": ""}, {"name": "x", "surprise": 1}, {"name": "x", "data_policy": "public"},
                 {"name": "x", "allowed_cidrs": ["10.0.0.0/33"]}):
        r = await call("POST", "/keys", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"]
    assert (await call("GET", "/keys/0123456789abcdef")).status_code == 404
    assert (await call("GET", "/keys/not-an-id")).status_code in (400, 404)
    assert (await call("POST", "/keys/0123456789abcdef/revoke")).status_code == 404
    schema = (await http.get(f"{gw.url}/schema/openapi.json")).json()
    assert "/admin/keys/{key_id}/rotate" in schema["paths"]


async def test_admin_api_answers_as_its_openapi_document_says(env):
    gw, http, call = env
    # The token is checked before the body: without one, even a bad body is a 401.
    r = await call("POST", "/keys", headers={}, json={"surprise": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
    r = await call("POST", "/keys")
    assert r.status_code == 400 and "request body is missing" in r.json()["error"]["message"]
    for body in ({"name": "x", "limits": {"max_concurrent": True}}, {"name": "x", "expires_in": "60"},
                 {"name": "x", "allowed_cidrs": ["10.0.0.0/255.0.0.0"]}):
        assert (await call("POST", "/keys", json=body)).status_code == 400, body
    record = (await call("POST", "/keys", json={"name": "k", "data_policy": "allow_rented",
                                                "limits": {"max_concurrent": 2.0}})).json()["record"]
    assert record["limits"]["max_concurrent"] == 2  # 2.0 is the integer 2, as in JSON Schema
    # PATCH: null means the default; a name cannot be null.
    r = await call("PATCH", f"/keys/{record['id']}", json={"data_policy": None, "limits": None})
    assert r.status_code == 200, r.text
    assert r.json()["data_policy"] == "private_only" and r.json()["limits"]["max_concurrent"] is None
    assert (await call("PATCH", f"/keys/{record['id']}", json={"name": None})).status_code == 400
    assert (await call("POST", f"/keys/{record['id']}/rotate")).status_code == 200  # the body is optional
    # Every 405 names the methods that work, here and on /v1.
    r = await call("DELETE", "/keys")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "OPTIONS", "POST"}
    r = await call("OPTIONS", f"/keys/{record['id']}")
    assert r.status_code == 204 and set(r.headers["allow"].split(", ")) == {"GET", "OPTIONS", "PATCH"}
    r = await http.get(f"{gw.url}/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = await http.get(f"{gw.url}/metrics")
    assert r.headers["content-type"].count("charset") == 1
    schema = (await http.get(f"{gw.url}/schema/openapi.json")).json()
    assert schema["components"]["schemas"]["NewKey"]["additionalProperties"] is False
    assert schema["paths"]["/admin/keys/{key_id}/rotate"]["post"]["requestBody"]["required"] is False
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


async def test_key_restricted_to_client_networks(env):
    gw, http, call = env
    inside = (await call("POST", "/keys", json={"name": "lan", "allowed_cidrs": ["127.0.0.0/8"]})).json()["key"]
    outside = (await call("POST", "/keys", json={"name": "far", "allowed_cidrs": ["10.9.0.0/16"]})).json()["key"]
    assert (await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"}, headers=bearer(inside))).status_code == 200
    r = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"}, headers=bearer(outside))
    assert r.status_code == 403 and r.json()["error"]["code"] == "source_not_allowed"


@pytest.mark.parametrize("algorithm", ["RS256", "ES256"])
async def test_asymmetric_admin_tokens_and_no_algorithm_switching(tmp_path, algorithm):
    private = rsa.generate_private_key(65537, 2048) if algorithm == "RS256" else ec.generate_private_key(ec.SECP256R1())
    pem_private = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())
    pem_public = private.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "pub.pem").write_bytes(pem_public)
    admin = {"jwt_algorithm": algorithm, "jwt_public_key_file": str(tmp_path / "pub.pem")}
    async with running_gateway({**one_model("http://127.0.0.1:9"), "admin": admin}) as gw, \
            httpx.AsyncClient() as http:
        good = mint_token(Admin(**admin), 60, private_key=pem_private)
        assert (await http.get(f"{gw.url}/admin/keys", headers=bearer(good))).status_code == 200
        claims = jwt.decode(good, options={"verify_signature": False})
        # the classic confusion attack: an HS256 token whose HMAC secret is the public key
        forged = jwt.api_jws.PyJWS().encode(jwt.utils.force_bytes(__import__("json").dumps(claims)),
                                            b"x" * 40, algorithm="HS256")
        assert (await http.get(f"{gw.url}/admin/keys", headers=bearer(forged))).status_code == 401


async def test_admin_api_disabled_without_a_secret(monkeypatch):
    monkeypatch.delenv("LLM_GATEWAY_ADMIN_SECRET", raising=False)
    async with running_gateway(one_model("http://127.0.0.1:9")) as gw, httpx.AsyncClient() as http:
        r = await http.get(f"{gw.url}/admin/keys", headers=bearer(token()))
        assert r.status_code == 503 and r.json()["error"]["code"] == "admin_not_configured"


async def test_validation_errors_name_the_field(env):
    gw, http, call = env
    r = await call("POST", "/keys", json={"name": "x", "data_policy": "public"})
    assert r.status_code == 400 and "data_policy" in r.json()["error"]["message"]


async def test_keys_survive_a_gateway_restart_on_sqlite(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    rec = Recorder()
    async with serve_app(rec) as up:
        policy = {**one_model(up), "store": {"kind": "sqlite", "path": str(tmp_path / "keys.db")}}
        async with running_gateway(policy, issue_test_key=False) as gw, httpx.AsyncClient() as http:
            r = await http.post(f"{gw.url}/admin/keys", headers=bearer(token()), json={"name": "kept"})
            key = r.json()["key"]
            assert (await sdk(gw, key).chat.completions.create(model="m", messages=[])).choices
        async with running_gateway(policy, issue_test_key=False) as gw:
            assert (await sdk(gw, key).chat.completions.create(model="m", messages=[])).choices


async def test_an_update_changes_only_the_limits_it_names_through_the_api_and_the_cli(env):
    gw, http, call = env
    limits = {"requests_per_minute": 60, "tokens_per_minute": 9000, "max_concurrent": 4}
    key_id = (await call("POST", "/keys", json={"name": "limited", "limits": limits})).json()["record"]["id"]
    r = await call("PATCH", f"/keys/{key_id}", json={"limits": {"requests_per_minute": 30}})
    assert r.status_code == 200 and r.json()["limits"] == {**limits, "requests_per_minute": 30}
    cli = str(Path(sys.executable).with_name("llm-gateway"))
    env_vars = {**os.environ, "LLM_GATEWAY_ADMIN_TOKEN": token()}
    done = await asyncio.to_thread(subprocess.run, [cli, "keys", "--url", gw.url, "--json", "update", key_id,
                                                    "--max-concurrent", "2"],
                                   env=env_vars, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["limits"] == {**limits, "requests_per_minute": 30, "max_concurrent": 2}
    # one limit sent as null lifts that one; `limits: null` lifts them all
    r = await call("PATCH", f"/keys/{key_id}", json={"limits": {"tokens_per_minute": None}})
    assert r.json()["limits"] == {"requests_per_minute": 30, "tokens_per_minute": None, "max_concurrent": 2}
    r = await call("PATCH", f"/keys/{key_id}", json={"limits": None})
    assert r.json()["limits"] == dict.fromkeys(limits)


@pytest.mark.parametrize("limits", [{"requests_per_minute": 10**9 + 1}, {"tokens_per_minute": 10**12 + 1},
                                    {"max_concurrent": 100_001}, {"requests_per_minute": 10**40}])
async def test_key_limits_beyond_their_bounds_are_a_400_naming_the_field(env, limits):
    gw, http, call = env
    (field, _), = limits.items()
    r = await call("POST", "/keys", json={"name": "greedy", "limits": limits})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    key_id = (await call("POST", "/keys", json={"name": "modest"})).json()["record"]["id"]
    r = await call("PATCH", f"/keys/{key_id}", json={"limits": limits})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    r = await call("POST", "/keys", json={"name": "budget", "budget": {"max_tokens_per_period": 10**15 + 1}})
    assert r.status_code == 400 and "max_tokens_per_period" in r.json()["error"]["message"], r.text


async def test_a_key_id_collision_on_create_takes_another_id(env, monkeypatch):
    """Ids are 64 random bits: a collision cannot be waited for, so the id source repeats a taken id once."""
    gw, http, call = env
    taken = (await call("POST", "/keys", json={"name": "first"})).json()["record"]["id"]
    ids = iter([taken, taken])
    monkeypatch.setattr(key_admin, "new_key_id", lambda: next(ids, None) or new_key_id())
    r = await call("POST", "/keys", json={"name": "second"})
    assert r.status_code == 201, r.text
    second = r.json()["record"]["id"]
    assert second != taken and (await call("GET", f"/keys/{taken}")).json()["name"] == "first"
    assert (await call("GET", f"/keys/{second}")).json()["name"] == "second"
