"""Console sessions live on the server: the cookie is a random session id, never the admin token, and signing
out deletes the session, so a copy of the cookie taken before stops working at once."""

from __future__ import annotations

import re

import httpx
import pytest

from gateway.admin.auth import mint_token
from policies.config import Admin
from tests.console.test_console_http import signed_in as sign_in_form
from tests.support.gateway import one_model, running_gateway

SECRET = "c" * 40
# secure_cookie stays on (the default): httpx keeps no Secure cookie over http://, so the test carries it by hand
POLICY = {**one_model("http://127.0.0.1:9"), "console": {"enabled": True}}


@pytest.fixture(autouse=True)
def admin_secret(monkeypatch):
    monkeypatch.setenv(Admin().jwt_secret_env, SECRET)


async def sign_in(http: httpx.AsyncClient, token: str) -> str:
    """Signs in through the form; the session cookie's value."""
    r = await sign_in_form(http, token)
    assert r.status_code == 303, r.text[:300]
    cookies = r.headers.get_list("set-cookie")
    assert not any(token in c or token.split(".")[2] in c for c in cookies), "the admin token is in a cookie"
    session = next(c for c in cookies if c.startswith("console_session="))
    attributes = session.lower()
    assert "httponly" in attributes and "samesite=strict" in attributes and "path=/console" in attributes
    assert "secure" in attributes
    return session.split(";")[0].split("=", 1)[1]


def csrf_on(page: httpx.Response) -> str:
    found = re.search(r'"X-CSRF-Token": "([0-9a-f]+)"', page.text)
    assert found, page.text[:300]
    return found.group(1)


async def test_a_copied_session_cookie_stops_working_when_its_session_signs_out():
    token = mint_token(Admin(), 600, role="admin", secret=SECRET)
    async with running_gateway(POLICY) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as owner, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as thief:
        session = await sign_in(owner, token)
        assert session != token and len(session) >= 32
        owner.cookies.set("console_session", session)
        thief.cookies.set("console_session", session)  # a copy of the cookie, taken while signed in
        page = await thief.get("/console/keys")
        assert page.status_code == 200, page.text[:300]  # the copy works while the session lasts
        csrf = csrf_on(await owner.get("/console/keys"))
        assert csrf_on(page) == csrf

        r = await owner.post("/console/signout", headers={"x-csrf-token": csrf})
        assert r.status_code == 303 and r.headers["location"] == "/console/signin"
        assert any(c.startswith("console_session=;") or c.startswith('console_session="";')
                   for c in r.headers.get_list("set-cookie"))

        for client in (thief, owner):  # the copy, and the browser's own cookie had it not dropped it
            r = await client.get("/console/keys", follow_redirects=False)
            assert r.status_code == 303 and r.headers["location"] == "/console/signin"
            r = await client.post("/console/keys", data={"name": "after-signout"},
                                  headers={"x-csrf-token": csrf, "hx-request": "true"})
            assert r.status_code == 401 and r.headers["hx-redirect"] == "/console/signin"
        assert [k.name for k in await gw.state.store.list_keys()] == ["tests"]  # nothing was issued


async def test_signing_in_again_ends_the_earlier_session_and_the_token_alone_opens_nothing():
    token = mint_token(Admin(), 600, role="operator", secret=SECRET)
    async with running_gateway(POLICY) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        first = await sign_in(http, token)
        http.cookies.set("console_session", first)
        second = await sign_in(http, token)
        assert second != first
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as other:
            for value in (first, token):  # the replaced session; the admin token as a hand-made cookie
                other.cookies.set("console_session", value)
                r = await other.get("/console/fleet", follow_redirects=False)
                assert r.status_code == 303 and r.headers["location"] == "/console/signin", value[:8]
            other.cookies.set("console_session", second)
            assert (await other.get("/console/fleet")).status_code == 200
