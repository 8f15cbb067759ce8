"""The batches and audit pages, the confirm steps and the narrow layout in a real browser (headless Debian
Chromium driven by Playwright, as tests/console/test_console_browser.py): an admin cancels a running batch from
the batches page and finds the act in the audit log; every page fits a 360 px wide screen. Screenshots, desktop
and narrow, land in build/artifacts/console/."""

from __future__ import annotations

import io
import re

import openai
import pytest

from tools.simulator import SimConfig
from tools.simulator import create_app as simulator
from tests.console.test_console_batches_audit import chat_line, ended, jsonl
from tests.console.test_console_browser import ENV, SECRET, admin_api, axe_violations, expect, token
from tests.support.browser import assert_offers_no_change, browser_page, screenshot, sign_in
from tests.support.gateway import TEST_KEY, one_model, running_gateway
from tests.support.servers import serve_app

CONSOLE = {"enabled": True}
SLOW = SimConfig(model="served-m", step_base_ms=40, step_ms_per_seq=0)
NARROW = {"width": 360, "height": 800}
DESKTOP = {"width": 1280, "height": 900}


@pytest.fixture(autouse=True)
def admin_secret(monkeypatch):
    monkeypatch.setenv(ENV, SECRET)


async def fits(page, where: str) -> None:
    """Nothing on the page is wider than the screen: the page itself never scrolls sideways."""
    wide = await page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert wide <= 0, f"{where} is {wide} px wider than the screen"


async def test_admin_cancels_a_batch_and_finds_it_in_the_audit_log(tmp_path):
    async with serve_app(simulator(SLOW)) as sim:
        policy = {**one_model(sim), "console": CONSOLE,
                  "batch": {"files_dir": str(tmp_path / "files"), "poll_seconds": 0.1, "concurrency": 1}}
        async with running_gateway(policy) as gw, browser_page() as page:
            sdk = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=30)
            uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(n) for n in range(40)]))),
                                              purpose="batch")
            batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")
            await sign_in(page, gw.url, token("admin"))
            await page.get_by_role("link", name="Batches", exact=True).click()
            row = page.locator(f'tr[data-batch="{batch.id}"]')
            await expect()(row.locator("td.status")).to_have_text(re.compile("validating|in_progress"))
            await expect()(row.locator("td.progress")).to_contain_text("/ 40")
            await screenshot(page, "batches-desktop")
            button = row.get_by_role("button", name=f"Cancel batch {batch.id}")
            await expect()(button).to_be_hidden()  # behind a confirm step: one click alone cancels nothing
            await row.get_by_text("Cancel…").click()
            await button.click()
            await expect()(page.get_by_role("status")).to_contain_text(f"{batch.id}: cancelling")
            await expect()(row.locator("td.status")).to_have_text(re.compile("cancelling|cancelled"))
            assert (await ended(sdk, batch.id)).status == "cancelled"

            await page.get_by_role("link", name="Audit log").click()
            await page.get_by_label("Action").fill("batch.cancel")
            await page.get_by_role("button", name="Search").click()
            await expect()(page).to_have_url(re.compile(r"action=batch\.cancel"))
            events = page.locator("#audit-table tbody tr")
            await expect()(events).to_have_count(1)
            await expect()(events.first).to_contain_text("admin-in-test")
            await expect()(events.first.locator("td.action")).to_have_text("batch.cancel")
            await expect()(events.first).to_contain_text(batch.id)
            await screenshot(page, "audit-desktop")
            assert not page.errors, page.errors

            await page.set_viewport_size(NARROW)
            for path, name in (("batches", "batches-narrow"), ("audit", "audit-narrow")):
                await page.goto(f"{gw.url}/console/{path}")
                await expect()(page.locator("h1")).to_be_visible()
                await fits(page, path)
                await screenshot(page, name)
            assert not page.errors, page.errors


async def test_every_page_fits_a_narrow_screen_and_the_new_pages_are_accessible(tmp_path):
    async with serve_app(simulator(SimConfig(model="served-m"))) as sim:
        policy = {**one_model(sim), "console": CONSOLE, "batch": {"files_dir": str(tmp_path / "files")}}
        async with running_gateway(policy) as gw:
            client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=30)
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            r = await admin_api(gw.url, "POST", "/keys", json={"name": "a-key-with-a-rather-long-name-for-a-phone"})
            assert r.status_code == 201, r.text
            key_id = TEST_KEY.split("-")[1]
            pages = ("fleet", "keys", f"keys/{key_id}", "usage", "report", "variants", "batches", "audit")
            async with browser_page() as page:
                await sign_in(page, gw.url, token("admin"))
                for width in (360, 420):
                    await page.set_viewport_size({"width": width, "height": 800})
                    for path in pages:
                        await page.goto(f"{gw.url}/console/{path}")
                        await expect()(page.locator("h1")).to_be_visible()
                        await fits(page, f"{path} at {width} px")
                await page.set_viewport_size(NARROW)
                await page.goto(f"{gw.url}/console/keys")
                await screenshot(page, "keys-narrow")
                assert not page.errors, page.errors
            async with browser_page(bypass_csp=True) as page:  # only so axe-core can be injected
                await sign_in(page, gw.url, token("viewer"))
                problems = {}
                for path in ("batches", "audit"):
                    for size in (DESKTOP, NARROW):
                        await page.set_viewport_size(size)
                        await page.goto(f"{gw.url}/console/{path}")
                        await expect()(page.locator("h1")).to_be_visible()
                        await assert_offers_no_change(page, path)
                        found = await axe_violations(page)
                        if found:
                            problems[f"{path} at {size['width']} px"] = found
                        levels = await page.evaluate(
                            "[...document.querySelectorAll('h1,h2,h3,h4')].map(h => Number(h.tagName[1]))")
                        assert levels[0] == 1 and all(b - a <= 1 for a, b in zip(levels, levels[1:])), (path, levels)
                        unlabelled = await page.evaluate(
                            "[...document.querySelectorAll('main input:not([type=hidden]), main select')]"
                            ".filter(e => !e.labels || !e.labels.length).map(e => e.name)")
                        assert not unlabelled, (path, unlabelled)
                assert not problems, problems


async def test_issuing_refreshes_the_list_and_clears_the_form_and_revoke_and_rotate_ask_first():
    async with serve_app(simulator(SimConfig(model="served-m"))) as sim, \
            running_gateway({**one_model(sim), "console": CONSOLE}) as gw, browser_page() as page:
        await sign_in(page, gw.url, token("admin"))
        await page.get_by_role("link", name="Keys", exact=True).click()
        await page.evaluate("window.stillTheSamePage = true")
        await page.get_by_text("Issue a key").click()
        form = page.locator("#create form")
        await form.get_by_label("Name", exact=True).fill("issued-here")
        await form.get_by_label("Requests per minute").fill("42")
        await form.get_by_role("button", name="Issue key").click()
        await expect()(page.locator(".one-time-secret")).to_have_value(re.compile(r"^sk-[0-9a-f]{16}-"))
        key_id = (await page.locator(".one-time-secret").input_value()).split("-")[1]
        table = page.locator("#keys-table")
        await expect()(table.locator("caption")).to_contain_text("2 of 2 keys")  # the list, refreshed in place
        await expect()(table.get_by_role("row").filter(has_text=key_id)).to_contain_text("issued-here")
        await expect()(form.get_by_label("Name", exact=True)).to_have_value("")  # ready for the next key
        await expect()(form.get_by_label("Requests per minute")).to_have_value("")
        assert await page.evaluate("window.stillTheSamePage === true")
        await screenshot(page, "keys-issued-refreshed")

        await table.get_by_role("link", name=key_id).click()
        revoke = page.get_by_role("button", name="Yes, revoke this key")
        rotate = page.get_by_role("button", name="Yes, rotate the secret")
        await expect()(revoke).to_be_hidden()  # each behind a confirm step: one stray click changes nothing
        await expect()(rotate).to_be_hidden()
        await page.get_by_text("Rotate secret…").click()
        await expect()(page.locator("section[aria-labelledby=rotate-h] details p")).to_contain_text("shown once")
        await rotate.click()
        await expect()(page.locator("#rotate-result .one-time-secret")).to_have_value(re.compile(r"^sk-"))
        await page.get_by_text("Revoke this key…").click()
        await expect()(page.locator("#key-state")).to_have_text("active")  # opening the step revoked nothing
        await screenshot(page, "key-revoke-confirm")
        await revoke.click()
        await expect()(page.locator("#key-state")).to_have_text("revoked")
        assert (await admin_api(gw.url, "GET", f"/keys/{key_id}")).json()["revoked"] is True
        assert not page.errors, page.errors
