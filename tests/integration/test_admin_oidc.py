"""Admins from a real OpenID provider (node-oidc-provider, started here): roles from its groups claim, its key
rotation followed, and every bad token a 401 that names the problem without repeating the token."""

import asyncio
import time

import httpx
import jwt
import pytest

from tests.support.gateway import one_model, running_gateway
from tests.support.oidc_provider import OidcProvider, signing_key
from tests.support.probes import eventually

ROLES = {"gw-admins": "admin", "gw-operators": "operator", "gw-viewers": "viewer",
         "team-a-admins": {"role": "team_admin", "team": "team-a"}}


def policy(issuer: str, **oidc) -> dict:
    settings = {"issuer": issuer, "roles": ROLES, "unknown_kid_refetch_seconds": 0.2, **oidc}
    return one_model("http://127.0.0.1:9", admin={"leeway_seconds": 0, "oidc": settings})


@pytest.fixture
def provider(tmp_path):
    idp = OidcProvider(tmp_path).start("k1")
    yield idp
    idp.stop()


def foreign(issuer: str, kid: str, key=None) -> str:
    """A token naming the provider as issuer but signed with a key the provider never had."""
    claims = {"iss": issuer, "aud": "llm-gateway-admin", "sub": "x", "exp": int(time.time()) + 60,
              "groups": ["gw-admins"]}
    return jwt.encode(claims, key or signing_key(kid)[0], algorithm="RS256", headers={"kid": kid})


def bearer(token: str) -> dict:
    return {"authorization": f"Bearer {token}"}


async def admin(http, gw, method, path, token, **kw):
    return await http.request(method, f"{gw.url}/admin{path}", headers=bearer(token), **kw)


async def test_each_role_from_the_providers_groups(provider, monkeypatch):
    secret = "s" * 40  # the shared-secret mode stays beside the provider
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", secret)
    async with running_gateway(policy(provider.issuer)) as gw, httpx.AsyncClient(timeout=30) as http:
        admins, operators, viewers = [await asyncio.to_thread(provider.token, c)
                                      for c in ("admins", "operators", "viewers")]
        created = await admin(http, gw, "POST", "/keys", admins, json={"name": "from-sso"})
        assert created.status_code == 201, created.text
        for token in (operators, viewers):
            assert (await admin(http, gw, "GET", "/keys", token)).status_code == 200
            r = await admin(http, gw, "POST", "/keys", token, json={"name": "x"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "read_only_token"
        r = await admin(http, gw, "PUT", "/models/m/variants", operators, json={"weights": []})
        assert r.status_code == 404  # past the role check: an operator may change weights (m has no variants)

        team = await asyncio.to_thread(provider.token, "team-a")
        r = await admin(http, gw, "GET", "/keys", team)  # a team admin lists its own team's keys (none yet)
        assert r.status_code == 200 and r.json() == []
        r = await admin(http, gw, "GET", "/audit", team)  # but reaches no route outside its team
        assert r.status_code == 403 and r.json()["error"]["code"] == "team_admin_token"
        claims = await gw.state.admin_auth.check(f"Bearer {team}", write=True, team_admin=True)
        assert claims["role"] == "team_admin" and claims["team"] == "team-a" and claims["iss"] == provider.issuer
        r = await admin(http, gw, "GET", "/keys", await asyncio.to_thread(provider.token, "outsiders"))
        assert r.status_code == 403 and r.json()["error"]["code"] == "no_admin_role"
        assert "groups" in r.json()["error"]["message"]

        from gateway.admin.auth import mint_token
        from policies.config import Admin

        assert (await admin(http, gw, "GET", "/keys", mint_token(Admin(), 60, secret=secret))).status_code == 200
        events = (await admin(http, gw, "GET", "/audit", viewers, params={"action": "key.create"})).json()["events"]
        assert [(e["actor"], e["issuer"], e["role"]) for e in events] == [("admins", provider.issuer, "admin")]


async def test_bad_tokens_are_401s_naming_the_problem(provider, tmp_path):
    other = OidcProvider(tmp_path).start("k1")  # a second, real issuer the gateway does not trust
    try:
        async with running_gateway(policy(provider.issuer)) as gw, httpx.AsyncClient(timeout=30) as http:
            assert (await admin(http, gw, "GET", "/keys", provider.token("admins"))).status_code == 200
            short = await asyncio.to_thread(provider.token, "admins", "urn:llm-gateway:short")
            cases = {
                "issuer": await asyncio.to_thread(other.token, "admins"),
                "audience": await asyncio.to_thread(provider.token, "admins", "urn:elsewhere"),
                "not valid yet": provider.sign("k1", nbf=int(time.time()) + 600),
                "signature does not verify": foreign(provider.issuer, "k1"),  # the provider's kid, another key
                "not among the issuer's keys": foreign(provider.issuer, "k-unknown"),
                "no sub claim": provider.sign("k1", sub=None),
            }
            for problem, token in cases.items():
                r = await admin(http, gw, "GET", "/keys", token)
                error = r.json()["error"]
                assert r.status_code == 401 and error["code"] == "invalid_admin_token", (problem, r.text)
                assert problem in error["message"], (problem, error["message"])
                assert token not in r.text and token.split(".")[1] not in r.text

            async def expired() -> bool:
                r = await admin(http, gw, "GET", "/keys", short)
                return r.status_code == 401 and "expired" in r.json()["error"]["message"]

            await eventually(expired, timeout=30, every=0.5)  # issued for 2 s, no leeway
    finally:
        other.stop()


async def test_key_rotation_at_the_provider_is_followed(provider):
    async with running_gateway(policy(provider.issuer)) as gw, httpx.AsyncClient(timeout=30) as http:
        before = await asyncio.to_thread(provider.token, "admins")
        assert (await admin(http, gw, "GET", "/keys", before)).status_code == 200
        await asyncio.to_thread(provider.start, "k2")  # the provider now signs with k2 and lists only k2
        after = await asyncio.to_thread(provider.token, "admins")
        await asyncio.sleep(0.3)  # past unknown_kid_refetch_seconds since the first fetch
        r = await admin(http, gw, "GET", "/keys", after)
        assert r.status_code == 200, r.text  # a new kid: the JWKS is fetched again
        r = await admin(http, gw, "GET", "/keys", before)
        assert r.status_code == 401 and "not among the issuer's keys" in r.json()["error"]["message"]

        keys = gw.state.admin_auth.oidc  # unknown kids refetch at most once per unknown_kid_refetch_seconds
        fetched = keys.fetches
        key = signing_key("r")[0]
        flood = [foreign(provider.issuer, f"r{i}", key) for i in range(30)]
        started = time.monotonic()
        for token in flood:
            await admin(http, gw, "GET", "/keys", token)
        elapsed = time.monotonic() - started
        assert keys.fetches - fetched <= elapsed / 0.2 + 1


async def test_unreachable_provider_keeps_cached_keys_then_fails_closed(provider):
    settings = {"refresh_seconds": 1, "max_stale_seconds": 8}
    async with running_gateway(policy(provider.issuer, **settings)) as gw, httpx.AsyncClient(timeout=30) as http:
        token = await asyncio.to_thread(provider.token, "admins")
        assert (await admin(http, gw, "GET", "/keys", token)).status_code == 200
        await asyncio.to_thread(provider.stop)
        r = await admin(http, gw, "GET", "/keys", token)
        assert r.status_code == 200, r.text  # cached keys keep working while the provider is away
        await asyncio.sleep(0.3)  # past unknown_kid_refetch_seconds
        r = await admin(http, gw, "GET", "/keys", foreign(provider.issuer, "k3"))  # a new kid: fails closed
        assert r.status_code == 401 and "cannot be fetched now" in r.json()["error"]["message"], r.text

        async def stale() -> bool:
            r = await admin(http, gw, "GET", "/keys", token)
            return r.status_code == 401 and "could not be refreshed" in r.json()["error"]["message"]

        await eventually(stale, timeout=40, every=0.5)  # past max_stale_seconds: the cached keys too
        await asyncio.to_thread(provider.start, "k1")  # back, same key: trusted again

        async def back() -> bool:
            return (await admin(http, gw, "GET", "/keys", token)).status_code == 200

        await eventually(back, timeout=30, every=0.5)


def hostile_provider(port: int, mode: str):
    """An ASGI 'provider' whose JWKS never ends (`endless`) or never comes (`silent`)."""
    issuer = f"http://127.0.0.1:{port}"

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/.well-known/openid-configuration":
            body = f'{{"issuer": "{issuer}", "jwks_uri": "{issuer}/jwks"}}'.encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        if mode == "silent":
            await asyncio.sleep(3600)
        await send({"type": "http.response.body", "body": b'{"keys": [', "more_body": True})
        for _ in range(100_000):  # 100 MB unless the reader stops
            await send({"type": "http.response.body", "body": b" " * 1024, "more_body": True})
        await send({"type": "http.response.body", "body": b"]}"})

    return app


@pytest.mark.parametrize("mode, problem", [("endless", "over 4096 bytes"), ("silent", "no answer in 1 s")])
async def test_a_provider_that_floods_or_stalls_is_cut_off(mode, problem):
    from tests.support.servers import free_port, serve_app

    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    settings = {"fetch_timeout_seconds": 1, "max_document_bytes": 4096}
    async with serve_app(hostile_provider(port, mode), port=port, timeout_graceful_shutdown=1), \
            running_gateway(policy(issuer, **settings)) as gw, httpx.AsyncClient(timeout=30) as http:
        started = time.monotonic()
        r = await admin(http, gw, "GET", "/keys", foreign(issuer, "k1"))
        assert r.status_code == 401 and problem in r.json()["error"]["message"], r.text
        assert time.monotonic() - started < 10


async def test_the_console_takes_a_providers_token_and_audits_its_acts_and_keeps_a_team_admin_to_its_team(provider):
    """Signed in to the console with the provider's token, a key issued and revoked there is in the audit log as
    the provider's subject; a team admin's token from the provider opens its team's pages only."""
    import re

    from gateway.console.session import csrf_of

    settings = {**policy(provider.issuer), "console": {"enabled": True, "secure_cookie": False}}
    async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        async def sign_in(token: str) -> httpx.Response:
            nonce = re.search(r'name="csrf" value="([^"]+)"', (await http.get("/console/signin")).text).group(1)
            return await http.post("/console/signin", data={"csrf": nonce, "token": token})

        team = await asyncio.to_thread(provider.token, "team-a")
        r = await sign_in(team)  # a team admin signs in to its team's pages only
        assert r.status_code == 303 and http.cookies.get("console_session"), r.text[:300]
        assert (await http.get("/console/fleet")).status_code == 403
        http.cookies.clear()

        admins = await asyncio.to_thread(provider.token, "admins")
        assert (await sign_in(admins)).status_code == 303
        session = http.cookies.get("console_session")  # a server-side session's id, never the token
        assert session and admins not in session
        change = {"x-csrf-token": csrf_of(session), "hx-request": "true"}
        r = await http.post("/console/keys", data={"name": "console-sso"}, headers=change)
        assert r.status_code == 201, r.text[:300]
        key_id = re.search(r"sk-([0-9a-f]{16})-", r.text).group(1)
        assert (await http.post(f"/console/keys/{key_id}/revoke", headers=change)).status_code == 200
        events = (await admin(http, gw, "GET", "/audit", admins, params={"target": key_id})).json()["events"]
        assert [(e["action"], e["actor"], e["issuer"], e["role"]) for e in events] == [
            ("key.revoke", "admins", provider.issuer, "admin"), ("key.create", "admins", provider.issuer, "admin")]
