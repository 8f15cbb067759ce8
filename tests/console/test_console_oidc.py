"""Signing in to the console at a real OpenID provider (node-oidc-provider, started here): the authorization code
flow with PKCE followed by hand over HTTP (console -> the provider's authorize -> its login and consent -> the
console's callback -> a console page as the right role), and each way it must fail: a tampered state, a replayed
code, a nonce that is not the sign-in's, the provider's error, a person with no role here; each ends on the
sign-in page with a 4xx that says why and holds no code or token. Signing out ends the session."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
import pytest

from tests.support.gateway import one_model, running_gateway
from tests.support.oidc_provider import OidcProvider

ROLES = {"gw-admins": "admin", "gw-operators": "operator", "gw-viewers": "viewer",
         "team-a-admins": {"role": "team_admin", "team": "team-a"}}
SECRET_ENV = "LLM_GATEWAY_TEST_CONSOLE_OIDC_SECRET"
CALLBACK = "/console/oidc/callback"


def policy(issuer: str, **console) -> dict:
    sign_in = {"client_id": "console", "client_secret_env": SECRET_ENV, "scopes": ["openid", "groups"],
               "button": "Test SSO", **console}
    oidc = {"issuer": issuer, "roles": ROLES, "console": sign_in}
    return one_model("http://127.0.0.1:9", admin={"leeway_seconds": 0, "oidc": oidc},
                     console={"enabled": True, "secure_cookie": False})


@pytest.fixture
def provider(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "console-secret")  # the provider's secret of client `console`
    idp = OidcProvider(tmp_path).start("k1")
    yield idp
    idp.stop()


def with_param(url: str, name: str, value: str) -> str:
    parts = urlsplit(url)
    query = [(k, value if k == name else v) for k, v in parse_qsl(parts.query)]
    return urlunsplit(parts._replace(query=urlencode(query)))


async def start(http: httpx.AsyncClient) -> str:
    """Press "Sign in with Test SSO" on the sign-in page: the provider's authorize URL the console sends to."""
    form = await http.get("/console/signin")
    assert form.status_code == 200 and '<a class="button" href="/console/oidc/start">Sign in with Test SSO' in form.text
    r = await http.get("/console/oidc/start")
    assert r.status_code == 303, r.text[:500]
    return r.headers["location"]


async def at_provider(http: httpx.AsyncClient, authorize: str, user: str) -> str:
    """Follow the provider's pages as a browser would, logging in as `user` and consenting: the callback URL the
    provider sends the browser back to (not followed)."""
    r = await http.get(authorize)
    for _ in range(12):
        if r.is_redirect:
            location = str(r.url.join(r.headers["location"]))
            if urlsplit(location).path == CALLBACK:
                return location
            r = await http.get(location)
            continue
        assert r.status_code == 200, r.text[:500]
        action = re.search(r'<form[^>]*action="([^"]+)"', r.text).group(1)
        prompt = re.search(r'name="prompt" value="(\w+)"', r.text).group(1)
        fields = {"prompt": prompt, **({"login": user, "password": "any"} if prompt == "login" else {})}
        r = await http.post(str(r.url.join(action)), data=fields)
    raise AssertionError("the provider never sent the browser back to the console")


async def sign_in(http: httpx.AsyncClient, user: str) -> httpx.Response:
    """The whole flow; the callback's answer."""
    return await http.get(await at_provider(http, await start(http), user))


async def landed(http: httpx.AsyncClient, callback: httpx.Response) -> httpx.Response:
    """The console page the callback's page moves on to."""
    assert callback.status_code == 200, callback.text[:800]
    landing = re.search(r'http-equiv="refresh" content="0; url=([^"]+)"', callback.text).group(1)
    return await http.get(landing)


def refused(r: httpx.Response, status: int, why: str, *secrets: str) -> None:
    """A failed sign-in: the sign-in page again, with the status and reason, no session, no secret echoed."""
    assert r.status_code == status, (r.status_code, r.text[:800])
    assert why in r.text, r.text[:1500]
    assert "Sign in with Test SSO" in r.text and 'name="token"' in r.text
    assert not any(c.startswith("console_session=") and "max-age=0" not in c.lower()
                   for c in r.headers.get_list("set-cookie"))
    for secret in secrets:
        assert secret not in r.text and secret not in str(r.headers)


async def test_each_role_signs_in_at_the_provider_and_a_person_without_one_does_not(provider):
    async with running_gateway(policy(provider.issuer)) as gw:
        for user, role, path in (("alice", "admin", "/console/fleet"), ("olivia", "operator", "/console/fleet"),
                                 ("vera", "viewer", "/console/fleet"), ("tina", "team_admin", "/console/keys")):
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
                callback = await sign_in(http, user)
                session = http.cookies.get("console_session", path="/console")
                assert session, callback.headers.get_list("set-cookie")
                assert "console_oidc" not in {c.name for c in http.cookies.jar if c.value}  # the flow's cookie ends
                page = await landed(http, callback)
                assert page.status_code == 200 and str(page.url).endswith(path), (user, page.url)
                shown = re.search(r'<span>([^<]*) <span class="role">([^<]*)</span>', page.text)
                assert shown and shown.group(1) == user and shown.group(2).startswith(role), (user, shown)
                if role == "team_admin":  # its team's pages only, as with a pasted team_admin token
                    assert "team team-a" in page.text and (await http.get("/console/fleet")).status_code == 403
                    continue
                csrf = re.search(r'"X-CSRF-Token": "([0-9a-f]+)"', page.text).group(1)
                keys = await http.post("/console/keys", data={"name": f"by-{user}"}, headers={"x-csrf-token": csrf})
                assert keys.status_code == (201 if role == "admin" else 403), (user, keys.text[:300])

        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            r = await sign_in(http, "oscar")  # signed in at the provider, in no group the policy maps
            refused(r, 403, "no gateway role is mapped to this token&#39;s groups")
            assert (await http.get("/console/fleet")).status_code == 303


async def test_tampered_state_replayed_code_nonce_mismatch_and_provider_error_are_refused(provider):
    async with running_gateway(policy(provider.issuer)) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        # a tampered state: refused, and the sign-in it tried to answer is over (its answer no longer works)
        assert (await http.get("/console/fleet")).status_code == 303
        callback = await at_provider(http, await start(http), "alice")
        code = dict(parse_qsl(urlsplit(callback).query))["code"]
        refused(await http.get(with_param(callback, "state", "x" + "y" * 42)), 400, "(state)", code)
        refused(await http.get(callback), 400, "No sign-in at the identity provider is under way", code)
        assert (await http.get("/console/fleet")).status_code == 303  # no session came of either

        # a replayed code: the same answer again, then the code under a fresh sign-in's own state
        callback = await at_provider(http, await start(http), "alice")
        code = dict(parse_qsl(urlsplit(callback).query))["code"]
        assert (await landed(http, await http.get(callback))).status_code == 200
        refused(await http.get(callback), 400, "already used", code)
        fresh = dict(parse_qsl(urlsplit(await start(http)).query))["state"]
        replay = f"{CALLBACK}?{urlencode({'code': code, 'state': fresh, 'iss': provider.issuer})}"
        refused(await http.get(replay), 401, "refused the sign-in&#39;s code (invalid_grant)", code)

        # an ID token whose nonce is not the one this sign-in sent
        authorize = with_param(await start(http), "nonce", "n" * 43)
        callback = await at_provider(http, authorize, "alice")
        refused(await http.get(callback), 401, "does not belong to this sign-in (nonce)",
                dict(parse_qsl(urlsplit(callback).query))["code"])

        # the provider answers with an error (the person declined, say)
        state = dict(parse_qsl(urlsplit(await start(http)).query))["state"]
        r = await http.get(CALLBACK, params={"error": "access_denied", "error_description": "no thanks",
                                             "state": state})
        refused(r, 401, "did not sign you in (access_denied)")

        # another issuer's answer (RFC 9207's iss): refused before the code is ever sent anywhere
        callback = await at_provider(http, await start(http), "alice")
        refused(await http.get(with_param(callback, "iss", "http://127.0.0.1:1")), 400, "(iss)")


async def test_a_public_client_signs_in_and_signing_out_ends_the_session(provider):
    async with running_gateway(policy(provider.issuer, client_id="console-public", client_secret_env=None)) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        page = await landed(http, await sign_in(http, "alice"))
        assert page.status_code == 200 and "Sign out" in page.text
        session = http.cookies.get("console_session", path="/console")
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text).group(1)
        out = await http.post("/console/signout", data={"csrf": csrf})
        assert out.status_code == 303 and out.headers["location"] == "/console/signin"
        http.cookies.set("console_session", session, path="/console")  # a copy of the cookie kept after signing out
        r = await http.get("/console/fleet")
        assert r.status_code == 303 and r.headers["location"] == "/console/signin"


async def test_without_console_settings_the_page_offers_pasting_only(provider):
    settings = policy(provider.issuer)
    del settings["admin"]["oidc"]["console"]
    async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        form = await http.get("/console/signin")
        assert form.status_code == 200 and 'name="token"' in form.text and "Sign in with" not in form.text
        r = await http.get("/console/oidc/start")
        assert r.status_code == 404 and "not configured here: paste a token" in r.text


async def test_in_a_browser_the_button_signs_in_at_the_provider_and_back(provider):
    """Chromium (tests/support/browser.py) presses the button, logs in and consents at the provider's own pages,
    and lands on the console signed in, with the Secure cookies a real deployment has; signing out ends it."""
    from playwright.async_api import expect

    from tests.support.browser import browser_page, screenshot

    settings = policy(provider.issuer)
    settings["console"] = {"enabled": True}  # secure_cookie on: Chromium keeps Secure cookies for http://127.0.0.1
    async with running_gateway(settings) as gw, browser_page() as page:
        await page.goto(f"{gw.url}/console/")
        await page.get_by_role("link", name="Sign in with Test SSO").click()
        await expect(page).to_have_url(re.compile(rf"^{re.escape(provider.issuer)}/interaction/"))
        await page.locator("input[name=login]").fill("olivia")
        await page.locator("input[name=password]").fill("any")
        await page.get_by_role("button", name="Sign-in").click()
        await page.get_by_role("button", name="Continue").click()  # the provider's consent
        await expect(page).to_have_url(f"{gw.url}/console/fleet")
        await expect(page.get_by_role("button", name="Sign out")).to_be_visible()
        await expect(page.locator(".signout .role")).to_have_text("operator")
        page.errors.clear()  # the provider's pages are not the console's: from here on, none may fail
        await page.reload()
        await expect(page.get_by_role("button", name="Sign out")).to_be_visible()
        assert not page.errors, page.errors
        await screenshot(page, "oidc-signed-in")
        await page.get_by_role("button", name="Sign out").click()
        await expect(page).to_have_url(f"{gw.url}/console/signin")
        await page.goto(f"{gw.url}/console/fleet")
        await expect(page).to_have_url(f"{gw.url}/console/signin")
