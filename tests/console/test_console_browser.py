"""The console in a real browser (headless Debian Chromium driven by Playwright) against gateways over the vLLM
simulator: what an admin, an operator and a viewer can do, that the API and the SDK see it, and that the pages
are usable from the keyboard and by assistive technology. Screenshots land in build/artifacts/console/."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tools.simulator import SimConfig
from tools.simulator import create_app as simulator
from gateway.admin.auth import mint_token
from gateway.app import create_app
from policies.config import Admin, load_policy
from tests.support.browser import AXE, assert_offers_no_change, browser_page, csrf_of, screenshot, sign_in
from tests.support.gateway import TEST_KEY, default_key_record, one_model, running_gateway
from tests.support.servers import free_port, serve_app, stop_processes

SECRET = "c" * 40
ENV = Admin().jwt_secret_env
CONSOLE = {"enabled": True}  # secure_cookie stays on: Chromium keeps Secure cookies for http://127.0.0.1
SERVED = SimConfig(model="served")
WAIT = 60.0  # seconds any background condition may take on a slow machine


def token(role: str = "admin") -> str:
    return mint_token(Admin(), 900, role=role, subject=f"{role}-in-test", secret=SECRET)


async def admin_api(gw_url: str, method: str, path: str, **kw) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.request(method, f"{gw_url}/admin{path}",
                                  headers={"authorization": f"Bearer {token()}"}, **kw)


async def audited(gw_url: str, **params) -> list[dict]:
    """GET /admin/audit's events (newest first)."""
    r = await admin_api(gw_url, "GET", "/audit", params=params)
    assert r.status_code == 200, r.text
    return r.json()["events"]


def expect():
    from playwright.async_api import expect as playwright_expect

    return playwright_expect


@pytest.fixture(autouse=True)
def admin_secret(monkeypatch):
    monkeypatch.setenv(ENV, SECRET)


async def test_admin_issues_a_key_the_sdk_uses_changes_it_and_revokes_it():
    async with serve_app(simulator(SimConfig(model="served-m"))) as sim, \
            running_gateway({**one_model(sim), "console": CONSOLE}) as gw, browser_page() as page:
        await sign_in(page, gw.url, token("admin"))
        await screenshot(page, "fleet-admin")
        await page.get_by_role("link", name="Keys", exact=True).click()
        await page.get_by_text("Issue a key").click()
        form = page.locator("#create form")
        await form.get_by_label("Name", exact=True).fill("browser-app")
        await form.get_by_label("Requests per minute").fill("100")
        await form.get_by_label("Data policy").select_option("allow_rented")
        await form.get_by_role("button", name="Issue key").click()
        box = page.locator(".one-time-secret")
        await expect()(box).to_have_value(re.compile(r"^sk-[0-9a-f]{16}-"))
        secret = await box.input_value()
        key_id = secret.split("-")[1]
        await screenshot(page, "keys-new-secret")

        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=secret, max_retries=0, timeout=30)
        reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content
        shown = (await admin_api(gw.url, "GET", f"/keys/{key_id}")).json()
        assert shown["name"] == "browser-app" and shown["limits"]["requests_per_minute"] == 100
        assert shown["data_policy"] == "allow_rented"

        await page.reload()  # the secret was shown once: never again, in the list or on the key's page
        assert secret not in await page.content() and secret.split("-")[2] not in await page.content()
        await page.get_by_label("Search keys").fill("browser-app")
        await expect()(page.locator("#keys-table caption")).to_contain_text("1 of 2 keys")
        await page.get_by_role("link", name=key_id).click()
        await expect()(page.locator("#key-state")).to_have_text("active")
        await expect()(page.locator("section[aria-labelledby=usage-h] tbody")).to_contain_text("m")
        assert secret.split("-")[2] not in await page.content()

        settings = page.locator("section[aria-labelledby=settings-h] form")
        await settings.get_by_label("Requests per minute").fill("7")
        await settings.get_by_label("Tokens per period").fill("5000")
        await settings.get_by_role("button", name="Save settings").click()
        await expect()(page.locator("#key-limits")).to_contain_text("7 requests/min")
        shown = (await admin_api(gw.url, "GET", f"/keys/{key_id}")).json()
        assert shown["limits"]["requests_per_minute"] == 7 and shown["budget"]["max_tokens_per_period"] == 5000

        # a change without the session's CSRF token is refused, though the cookie is sent
        refused = await page.request.post(f"{gw.url}/console/keys/{key_id}/revoke", form={"x": "1"})
        assert refused.status == 403
        assert (await admin_api(gw.url, "GET", f"/keys/{key_id}")).json()["revoked"] is False

        await page.get_by_text("Revoke this key…").click()  # a confirm step first
        await page.get_by_role("button", name="Yes, revoke this key").click()
        await expect()(page.locator("#key-state")).to_have_text("revoked")
        await screenshot(page, "key-revoked")
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert (await admin_api(gw.url, "GET", f"/keys/{key_id}")).json()["revoked"] is True
        # audited as the signed-in admin, as the admin API's acts are: the same actions, targets and diffs
        events = await audited(gw.url, target=key_id)
        assert [e["action"] for e in events] == ["key.revoke", "key.update", "key.create"]
        assert {(e["actor"], e["role"], e["address"]) for e in events} == {("admin-in-test", "admin", "127.0.0.1")}
        created, updated, revoked = events[2]["changes"], events[1]["changes"], events[0]["changes"]
        assert created["name"] == "browser-app" and created["limits"]["requests_per_minute"] == 100
        assert updated["limits"]["to"]["requests_per_minute"] == 7 and "budget" in updated
        assert revoked["revoked"] == {"from": False, "to": True}
        assert secret not in str(events) and secret.split("-")[2] not in str(events)

        await page.get_by_role("link", name="Usage").click()  # its call, per key and per model
        await expect()(page.get_by_role("row").filter(has_text=key_id)).to_contain_text("browser-app")
        await page.get_by_role("link", name="Own or rent").click()  # charts drawn under the CSP, from the JSON
        await expect()(page.locator(".chart .uplot")).to_have_count(2)
        await page.get_by_label("Window", exact=True).select_option(label="last day")
        await page.get_by_role("button", name="Show").click()
        await expect()(page).to_have_url(re.compile(r"window=86400"))
        await expect()(page.locator(".chart .uplot")).to_have_count(2)
        chart = page.locator(".chart").first
        assert await chart.get_attribute("data-src") == "/console/report.json?window=86400"
        before = int(await chart.get_attribute("data-requests"))
        await page.evaluate("window.stillTheSamePage = true")
        other = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=30)
        for _ in range(2):
            await other.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        await expect()(chart).to_have_attribute("data-requests", str(before + 2), timeout=WAIT * 1000)
        assert await page.evaluate("window.stillTheSamePage === true")  # redrawn from fresh JSON, in place
        assert not page.errors, page.errors  # no script error, no CSP refusal


@contextlib.asynccontextmanager
async def gateway_from_file(policy: dict, path: Path) -> AsyncIterator[str]:
    """A gateway whose policy is a file it watches (so an operator can reload it)."""
    path.write_text(yaml.safe_dump(policy))
    app = create_app(load_policy(str(path)), policy_path=str(path))
    await app.state.store.create_key(default_key_record())
    async with serve_app(app, proxy_headers=False) as url:
        yield url


def variants_policy(a: str, b: str, db: str) -> dict:
    return {"store": {"kind": "sqlite", "path": db}, "console": CONSOLE,
            "health": {"interval": 0.2, "backoff_initial": 0.2, "backoff_max": 1},
            "models": [{"name": "m", "served_name": "served", "guard": {"min_samples": 40}, "variants": [
                {"name": "a", "weight": 50, "backends": [{"url": a}]},
                {"name": "b", "weight": 50, "backends": [{"url": b}]}]}]}


async def test_operator_changes_a_variant_weight_and_reloads_the_policy_but_cannot_touch_keys(tmp_path):
    async with serve_app(simulator(SERVED)) as a, serve_app(simulator(SERVED)) as b:
        policy = variants_policy(a, b, str(tmp_path / "keys.db"))
        async with gateway_from_file(policy, tmp_path / "policy.yaml") as url, browser_page() as page:
            await sign_in(page, url, token("operator"))
            await page.get_by_role("link", name="Variants").click()
            await page.get_by_label("Weight of a").fill("80")
            await page.get_by_label("Weight of b").fill("20")
            await page.get_by_role("button", name="Save weights of m").click()
            await expect()(page.get_by_role("status")).to_have_text("Saved.")
            await screenshot(page, "variants-operator")
            view = (await admin_api(url, "GET", "/models/m/variants")).json()
            assert [(v["name"], v["weight"]) for v in view["variants"]] == [("a", 80), ("b", 20)]
            for v in view["variants"]:  # the guard's state and reason, as the API gives them
                row = page.get_by_role("row").filter(has=page.get_by_role("rowheader", name=v["name"], exact=True))
                await expect()(row.locator("td.guard")).to_have_text(v["guard"]["state"])
                await expect()(row.locator("td.guard-reason")).to_have_text(
                    v["guard"]["reason"] or v["guard"]["undecided"] or "")

            before = (await admin_api(url, "GET", "/policy")).json()["version"]
            policy["console"] = {**CONSOLE, "refresh_seconds": 3}
            (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
            await page.get_by_role("link", name="Fleet").click()
            await page.get_by_role("button", name="Reload the policy file").click()
            await expect()(page.locator("#reload-result")).to_contain_text("Reloaded")
            after = (await admin_api(url, "GET", "/policy")).json()["version"]
            assert after != before
            weights, reload = (await audited(url, action="variants.weights"))[0], \
                (await audited(url, action="policy.reload"))[0]  # both as the operator who acted
            assert (weights["actor"], weights["role"], weights["target"]) == ("operator-in-test", "operator", "m")
            assert weights["changes"] == {"a": {"from": 50, "to": 80}, "b": {"from": 50, "to": 20}}
            assert (reload["actor"], reload["role"]) == ("operator-in-test", "operator")
            assert reload["changes"]["version"] == {"from": before, "to": after}

            await page.get_by_role("link", name="Keys", exact=True).click()
            await expect()(page.locator("#keys-table")).to_be_visible()
            assert await page.get_by_text("Issue a key").count() == 0
            refused = await page.request.post(f"{url}/console/keys", form={"name": "x"},
                                              headers={"x-csrf-token": await csrf_of(page)})
            assert refused.status == 403
            assert len((await admin_api(url, "GET", "/keys")).json()) == 1
            assert not page.errors, page.errors


async def test_viewer_reads_every_page_and_can_change_nothing(tmp_path):
    async with serve_app(simulator(SERVED)) as a, serve_app(simulator(SERVED)) as b:
        async with gateway_from_file(variants_policy(a, b, str(tmp_path / "keys.db")), tmp_path / "p.yaml") as url, \
                browser_page() as page:
            key_id = TEST_KEY.split("-")[1]
            await sign_in(page, url, token("viewer"))
            for path in ("fleet", "keys", f"keys/{key_id}", "usage", "report", "variants"):
                await page.goto(f"{url}/console/{path}")
                await expect()(page.locator("h1")).to_be_visible()
                await assert_offers_no_change(page, path)
            await screenshot(page, "variants-viewer")
            csrf = await csrf_of(page)
            for path, form in ((f"keys/{key_id}/revoke", {}), ("keys", {"name": "x"}),
                               (f"keys/{key_id}", {"name": "y"}), (f"keys/{key_id}/rotate", {}),
                               ("variants", {"model": "m", "weight:a": "0"}), ("reload", {})):
                refused = await page.request.post(f"{url}/console/{path}", form=form, headers={"x-csrf-token": csrf})
                assert refused.status == 403, (path, refused.status)
            keys = (await admin_api(url, "GET", "/keys")).json()
            assert [(k["name"], k["revoked"]) for k in keys] == [("tests", False)]
            weights = (await admin_api(url, "GET", "/models/m/variants")).json()["variants"]
            assert [v["weight"] for v in weights] == [50, 50]
            assert not page.errors, page.errors


def start_simulator(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tools.simulator", "--host", "127.0.0.1", "--port", str(port),
                             "--model", "served-m", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def listening(port: int) -> None:
    deadline = time.monotonic() + WAIT
    async with httpx.AsyncClient(timeout=2) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the simulator on port {port} never answered")


async def test_fleet_page_shows_a_replica_go_down_and_come_back_without_a_reload():
    ports = [free_port(), free_port()]
    procs = [start_simulator(p) for p in ports]
    try:
        for port in ports:
            await listening(port)
        policy = {**one_model(*(f"http://127.0.0.1:{p}" for p in ports)), "console": {**CONSOLE, "refresh_seconds": 1}}
        async with running_gateway(policy) as gw, browser_page() as page:
            await sign_in(page, gw.url, token("viewer"))
            second = page.locator('tr[data-replica="m-1"] td.state')
            await expect()(page.locator('tr[data-replica="m-0"] td.state')).to_have_text("up")
            await expect()(second).to_have_text("up")
            await page.evaluate("window.stillTheSamePage = true")

            stop_processes([procs[1]])
            await expect()(second).to_have_text("down", timeout=WAIT * 1000)
            await expect()(page.locator("table.fleet caption")).to_contain_text("1 of 2 replicas up")
            await screenshot(page, "fleet-replica-down")

            procs[1] = start_simulator(ports[1])
            await expect()(second).to_have_text("up", timeout=WAIT * 1000)
            client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=30)
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            await expect()(page.locator("table.answered tbody tr").filter(has_text="200")).to_contain_text(
                "m-", timeout=WAIT * 1000)  # shown by the page's next refresh: a background condition
            assert await page.evaluate("window.stillTheSamePage === true")  # htmx refreshed it in place
            await screenshot(page, "fleet-replica-back")
            assert not page.errors, page.errors
    finally:
        stop_processes(procs)


async def axe_violations(page) -> list[dict]:
    await page.add_script_tag(path=str(AXE))
    result = await page.evaluate("axe.run(document, {resultTypes: ['violations']})")
    return [{"id": v["id"], "impact": v["impact"], "nodes": [n["target"] for n in v["nodes"]][:3]}
            for v in result["violations"] if v["impact"] in ("serious", "critical")]


async def tab_until(page, selector: str, most: int = 80) -> int:
    """Presses Tab from the top of the page until `selector` has the focus; how many presses it took."""
    await page.locator("body").focus()
    for presses in range(1, most + 1):
        await page.keyboard.press("Tab")
        if await page.evaluate("(s) => document.activeElement && document.activeElement.matches(s)", selector):
            return presses
    raise AssertionError(f"{selector} is not reachable with the keyboard in {most} presses")


async def test_pages_are_accessible_reachable_by_keyboard_and_charts_draw_from_json():
    async with serve_app(simulator(SimConfig(model="served-m"))) as sim, \
            running_gateway({**one_model(sim), "console": CONSOLE}) as gw:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=30)
        for _ in range(3):  # traffic, so the report has a series to draw
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        async with browser_page(bypass_csp=True) as page:  # only so axe-core can be injected
            await sign_in(page, gw.url, token("admin"))
            key_id = TEST_KEY.split("-")[1]
            problems = {}
            for path in ("fleet", "keys", f"keys/{key_id}", "usage", "report", "variants"):
                await page.goto(f"{gw.url}/console/{path}")
                await expect()(page.locator("h1")).to_be_visible()
                if path == "report":
                    await expect()(page.locator(".chart .uplot")).to_have_count(2)
                    assert int(await page.locator(".chart").first.get_attribute("data-points")) >= 1
                found = await axe_violations(page)
                if found:
                    problems[path] = found
                await screenshot(page, path.replace("/", "-"))
            assert not problems, problems

            await page.goto(f"{gw.url}/console/keys")
            await tab_until(page, "#q")
            await tab_until(page, "#create summary")
            await page.keyboard.press("Enter")  # opens the form
            await page.keyboard.press("Tab")
            assert await page.evaluate("document.activeElement.id") == "new-name"
            await page.keyboard.type("typed-key")
            for _ in range(40):  # on through every field to the button, which Enter presses
                if await page.evaluate("document.activeElement.textContent") == "Issue key":
                    break
                await page.keyboard.press("Tab")
            await page.keyboard.press("Enter")
            await expect()(page.locator(".one-time-secret")).to_have_value(re.compile("^sk-"))
            await screenshot(page, "keys-keyboard")
            assert [k["name"] for k in (await admin_api(gw.url, "GET", "/keys")).json()] == ["tests", "typed-key"]
            assert not page.errors, page.errors
