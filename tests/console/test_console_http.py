"""The console's HTTP contract without a browser: off unless enabled, the session cookie's attributes, the token
never in a page, the CSP on every answer, no inline script or style anywhere, and sign-in's own CSRF nonce."""

from __future__ import annotations

import re
import time

import httpx
import jwt
import pytest

from gateway.admin.auth import mint_token
from policies.config import Admin
from tests.support.gateway import TEST_KEY, one_model, running_gateway

SECRET = "h" * 40
PAGES = ("fleet", "fleet/live", "keys", "usage", "report", "variants", "report.json")


@pytest.fixture(autouse=True)
def admin_secret(monkeypatch):
    monkeypatch.setenv(Admin().jwt_secret_env, SECRET)


def token(role: str = "admin", ttl: float = 600) -> str:
    return mint_token(Admin(), ttl, role=role, secret=SECRET)


async def signed_in(http: httpx.AsyncClient, token: str) -> httpx.Response:
    form = await http.get("/console/signin")
    nonce = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
    http.cookies.set("console_signin", nonce)  # httpx keeps no Secure cookie over http://; a browser does on loopback
    return await http.post("/console/signin", data={"csrf": nonce, "token": token})


async def test_the_console_is_off_unless_the_policy_enables_it():
    async with running_gateway(one_model("http://127.0.0.1:9")) as gw, httpx.AsyncClient(base_url=gw.url) as http:
        for path in ("/console", "/console/signin", "/console/keys", "/console/static/console.css"):
            r = await http.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url", path
        r = await http.post("/console/signin", data={"token": token()})
        assert r.status_code == 404


async def test_signing_in_sets_a_strict_cookie_and_no_page_ever_holds_the_token():
    policy = {**one_model("http://127.0.0.1:9"), "console": {"enabled": True}}
    admin = token()
    async with running_gateway(policy) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        r = await signed_in(http, admin)
        assert r.status_code == 303 and r.headers["location"] == "/console/fleet"
        cookie = next(c for c in r.headers.get_list("set-cookie") if c.startswith("console_session="))
        attributes = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
        assert {"httponly", "secure", "path", "max-age", "samesite"} <= attributes
        assert "samesite=strict" in cookie.lower() and "path=/console" in cookie.lower()
        session = cookie.split(";")[0].split("=", 1)[1]  # a session id kept server-side, never the token
        assert admin not in cookie and admin.split(".")[2] not in cookie
        http.cookies.set("console_session", session)  # httpx keeps no Secure cookie over http://; a browser does
        key_id = TEST_KEY.split("-")[1]
        for path in (*PAGES, f"keys/{key_id}"):
            r = await http.get(f"/console/{path}")
            assert r.status_code == 200, (path, r.text[:300])
            assert admin not in r.text and admin.split(".")[2] not in r.text, path
            assert TEST_KEY.split("-")[2] not in r.text, path
            csp = r.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
            assert r.headers["x-content-type-options"] == "nosniff"
            if r.headers["content-type"].startswith("text/html"):
                assert not re.search(r"<script(?![^>]*\bsrc=)", r.text), f"{path}: an inline script"
                assert not re.search(r"\s(style|on[a-z]+)=", r.text), f"{path}: an inline style or handler"
                assert "cdn" not in r.text.lower() and "https://" not in r.text, path
        asset = re.search(r'src="(/console/static/htmx-2\.0\.11\.min\.js\?v=[0-9a-f]{12})"', r.text)
        assert asset is not None and (await http.get(asset.group(1))).status_code == 200
        r = await http.get("/console/keys/0000000000000000")  # an error page carries the headers too
        assert r.status_code == 404 and "content-security-policy" in r.headers
        r = await http.get("/console/signin", headers={"host": "console.internal"})  # plain HTTP, not loopback
        assert "secure_cookie: false" in r.text  # says why the browser would drop the session cookie
        assert "secure_cookie" not in (await http.get("/console/signin")).text


async def test_sign_in_refuses_a_bad_token_or_a_missing_nonce_and_echoes_nothing():
    policy = {**one_model("http://127.0.0.1:9"), "console": {"enabled": True, "secure_cookie": False}}
    forged = mint_token(Admin(), 600, secret="x" * 40)
    async with running_gateway(policy) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        r = await signed_in(http, forged)
        assert r.status_code == 401 and forged not in r.text
        assert "console_session" not in r.headers.get("set-cookie", "")
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as other:  # no nonce: a cross-site post
            r = await other.post("/console/signin", data={"token": token(), "csrf": "guessed"})
        assert r.status_code == 403 and "console_session=" not in r.headers.get("set-cookie", "")
        r = await http.get("/console/keys", follow_redirects=False)  # no session: to the sign-in form
        assert r.status_code == 303 and r.headers["location"] == "/console/signin"
        expired = token(ttl=-120)
        http.cookies.set("console_session", expired)
        assert (await http.get("/console/keys", follow_redirects=False)).status_code == 303
        r = await http.post("/console/keys", data={"name": "x"}, headers={"hx-request": "true"})
        assert r.status_code == 401 and r.headers["hx-redirect"] == "/console/signin"


async def test_a_team_admin_token_as_a_hand_made_cookie_opens_nothing():
    """A team admin signs in (tests/console/test_console_team_admin.py); its token pasted into the session cookie
    by hand is no session, and changes nothing."""
    policy = {**one_model("http://127.0.0.1:9"), "console": {"enabled": True, "secure_cookie": False}}
    now = int(time.time())
    admin = Admin()
    team = jwt.encode({"iss": admin.issuer, "aud": admin.audience, "sub": "tina", "role": "team_admin",
                       "team": "red", "iat": now, "exp": now + 600}, SECRET, algorithm="HS256")
    async with running_gateway(policy) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        http.cookies.set("console_session", team)  # a cookie made by hand is no session
        r = await http.get("/console/keys", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/console/signin"
        r = await http.post("/console/keys", data={"name": "x"}, headers={"hx-request": "true"})
        assert r.status_code == 401
        assert len(await gw.state.store.list_keys()) == 1  # only the test key
