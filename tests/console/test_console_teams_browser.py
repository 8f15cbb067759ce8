"""The teams page and a team admin's own-or-rent view in a real browser (headless Debian Chromium driven by
Playwright, as tests/console/test_console_browser.py): an admin creates a team with the form (the list and its
summary refresh in place) and changes its limits on the team's page; a team admin sees its team's page read-only
and its own-or-rent page with its team's figures. Every new page fits a 360 px wide screen, passes axe-core with
no serious or critical violation, keeps its headings in order and labels every field, and opens with its summary
before any table; no inline script runs (the CSP stays on for everything but the axe pass). Screenshots, desktop
and narrow, land in build/artifacts/console/."""

from __future__ import annotations

import httpx
import pytest

from tools.simulator import SimConfig
from tools.simulator import create_app as simulator
from gateway.admin.auth import mint_token
from policies.config import Admin
from tests.console.test_console_browser import ENV, SECRET, admin_api, axe_violations, expect, token
from tests.support.browser import assert_offers_no_change, browser_page, screenshot, sign_in
from tests.support.gateway import one_model, running_gateway
from tests.support.servers import serve_app

CONSOLE = {"enabled": True}
NARROW = {"width": 360, "height": 800}
DESKTOP = {"width": 1280, "height": 900}
SUMMARY_FIRST = """() => {
  const summary = document.querySelector('main #summary');
  const table = document.querySelector('main table');
  if (!summary) { return 'no summary'; }
  if (summary.querySelectorAll('dt').length < 2) { return 'an empty summary'; }
  if (table && !(summary.compareDocumentPosition(table) & Node.DOCUMENT_POSITION_FOLLOWING)) {
    return 'the summary comes after a table';
  }
  return 'first';
}"""


@pytest.fixture(autouse=True)
def admin_secret(monkeypatch):
    monkeypatch.setenv(ENV, SECRET)


def team_token(team: str) -> str:
    return mint_token(Admin(), 900, role="team_admin", subject=f"{team}-lead", secret=SECRET, team=team)


async def fits(page, where: str) -> None:
    wide = await page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert wide <= 0, f"{where} is {wide} px wider than the screen"


async def accessible(page, where: str) -> list[dict]:
    """axe-core's serious and critical findings; headings in order and every field labelled (asserted)."""
    found = await axe_violations(page)
    levels = await page.evaluate("[...document.querySelectorAll('h1,h2,h3,h4')].map(h => Number(h.tagName[1]))")
    assert levels[0] == 1 and all(b - a <= 1 for a, b in zip(levels, levels[1:])), (where, levels)
    unlabelled = await page.evaluate("[...document.querySelectorAll('main input:not([type=hidden]), main select')]"
                                     ".filter(e => !e.labels || !e.labels.length).map(e => e.name)")
    assert not unlabelled, (where, unlabelled)
    assert await page.locator("main nav, header nav").count() >= 1 and await page.locator("main").count() == 1
    return found


async def traffic(gw_url: str, team: str, calls: int) -> str:
    """A key of `team` that has made `calls` calls; its id."""
    r = await admin_api(gw_url, "POST", "/keys", json={"name": f"{team}-app", "team": team})
    assert r.status_code == 201, r.text
    record, secret = r.json()["record"], r.json()["key"]
    async with httpx.AsyncClient(base_url=gw_url, timeout=30) as http:
        for _ in range(calls):
            r = await http.post("/v1/chat/completions", headers={"authorization": f"Bearer {secret}"},
                                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
    return record["id"]


async def test_admin_creates_and_changes_a_team_and_a_team_admin_reads_its_own():
    async with serve_app(simulator(SimConfig(model="served-m"))) as sim, \
            running_gateway({**one_model(sim), "console": CONSOLE}) as gw:
        async with browser_page() as page:
            await sign_in(page, gw.url, token("admin"))
            await page.get_by_role("link", name="Teams", exact=True).click()
            await expect()(page.locator("h1")).to_have_text("Teams")
            await page.evaluate("window.stillTheSamePage = true")
            await page.get_by_text("Create a team").click()
            form = page.locator("#create form")
            await form.get_by_label("Name").fill("search-ads")
            await form.get_by_label("Description").fill("ads ranking")
            await form.get_by_label("Tokens per period").fill("100000")
            await form.get_by_role("button", name="Create team").click()
            await expect()(page.locator("#new-team")).to_contain_text("Team search-ads created")
            created = page.locator('tr[data-team="search-ads"]')
            await expect()(created.locator("td.budget")).to_have_text("– rented spend, 100000 tokens per month")
            await expect()(page.locator("#summary dd").first).to_have_text("1")  # the summary, refreshed in place
            await expect()(form.get_by_label("Name")).to_have_value("")
            assert await page.evaluate("window.stillTheSamePage === true")
            assert await page.evaluate(SUMMARY_FIRST) == "first"
            await screenshot(page, "teams-desktop")

            await created.get_by_role("link", name="search-ads").click()
            await expect()(page.locator("h1")).to_have_text("Team search-ads")
            settings = page.locator("section[aria-labelledby=settings-h] form")
            await expect()(settings.get_by_label("Tokens per period")).to_have_value("100000")
            await settings.get_by_label("Requests per minute").fill("250")
            await settings.get_by_role("button", name="Save settings").click()
            await expect()(page.locator("#team-limits")).to_have_text("250 requests/min, – tokens/min, – at once")
            await expect()(page.get_by_role("status")).to_have_text("Saved.")
            team = (await admin_api(gw.url, "GET", "/teams/search-ads")).json()
            assert team["limits"]["requests_per_minute"] == 250 and team["budget"]["max_tokens_per_period"] == 100000
            assert await page.evaluate(SUMMARY_FIRST) == "first"
            await screenshot(page, "team-desktop")
            await page.set_viewport_size(NARROW)
            for path, name in (("teams", "teams-narrow"), ("teams/search-ads", "team-narrow")):
                await page.goto(f"{gw.url}/console/{path}")
                await expect()(page.locator("h1")).to_be_visible()
                await fits(page, path)
                await screenshot(page, name)
            assert not page.errors, page.errors

        for name, calls in (("blue", 4),):
            assert (await admin_api(gw.url, "POST", "/teams", json={"name": name})).status_code == 201
            blue_key = await traffic(gw.url, name, calls)
        ads_key = await traffic(gw.url, "search-ads", 1)
        async with browser_page() as page:
            await sign_in(page, gw.url, team_token("search-ads"))
            await page.get_by_role("link", name="Own or rent", exact=True).click()
            await expect()(page.locator("#team-scope")).to_contain_text("search-ads")
            first = page.locator("#summary dd").first
            await expect()(first).to_have_text("1")  # its one call; blue's four are not its figures
            assert blue_key not in await page.content()
            await screenshot(page, "report-team-desktop")
            await page.get_by_role("link", name="Teams", exact=True).click()
            await expect()(page.locator("tbody tr")).to_have_count(1)
            await expect()(page.locator('tr[data-team="search-ads"] td.keys')).to_have_text("1")
            await page.goto(f"{gw.url}/console/teams/blue")
            await expect()(page.locator("main")).to_contain_text("team search-ads only")
            assert page.errors == ["Failed to load resource: the server responded with a status of 403 (Forbidden)"]
            page.errors.clear()  # that refusal was the point; nothing else may fail
            await page.goto(f"{gw.url}/console/teams/search-ads")
            await expect()(page.locator("main table")).to_contain_text(ads_key)
            await assert_offers_no_change(page, "a team admin's team page")
            await page.set_viewport_size(NARROW)
            for path, name in (("report", "report-team-narrow"), ("teams/search-ads", "team-admin-narrow")):
                await page.goto(f"{gw.url}/console/{path}")
                await expect()(page.locator("h1")).to_be_visible()
                await fits(page, path)
                await screenshot(page, name)
            assert not page.errors, page.errors


async def test_the_new_pages_are_accessible_and_every_long_page_opens_with_its_summary():
    async with serve_app(simulator(SimConfig(model="served-m"))) as sim, \
            running_gateway({**one_model(sim), "console": CONSOLE}) as gw:
        assert (await admin_api(gw.url, "POST", "/teams", json={"name": "red", "limits": {"max_concurrent": 4},
                                                              "budget": {"max_rented_spend": 5}})).status_code == 201
        await traffic(gw.url, "red", 1)
        problems = {}
        async with browser_page(bypass_csp=True) as page:  # only so axe-core can be injected
            for who, jwt, paths in (("admin", token("admin"), ("teams", "teams/red", "keys", "usage", "fleet", "report")),
                                    ("team admin", team_token("red"), ("teams", "teams/red", "report"))):
                await page.context.clear_cookies()
                await sign_in(page, gw.url, jwt)
                for path in paths:
                    for size in (DESKTOP, NARROW):
                        await page.set_viewport_size(size)
                        await page.goto(f"{gw.url}/console/{path}")
                        await expect()(page.locator("h1")).to_be_visible()
                        where = f"{path} ({who}) at {size['width']} px"
                        assert await page.evaluate(SUMMARY_FIRST) == "first", where
                        await fits(page, where)
                        if who == "team admin" and path.startswith("teams"):
                            await assert_offers_no_change(page, where)
                        found = await accessible(page, where)
                        if found:
                            problems[where] = found
        assert not problems, problems
