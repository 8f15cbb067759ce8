"""A real browser for the console's tests: Debian's Chromium (`make test` installs it: scripts/setup_browser.sh),
driven by Playwright for Python, headless, talking only to loopback gateways. Playwright never downloads a
browser here: it is pointed at /usr/bin/chromium.

Waits are Playwright's own (auto-waiting locators and `expect`) with generous deadlines, so a machine twice as
slow as usual only takes longer. Screenshots go to build/artifacts/console/ (CI keeps that folder).
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path


from tests.support.needs import missing

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "build" / "artifacts" / "console"
AXE = Path(__file__).parent / "vendor" / "axe-core-4.11.0.min.js"
TIMEOUT_MS = 30_000  # any one wait; a page answers in well under a second on an idle machine


def need_chromium() -> None:
    if shutil.which(CHROMIUM) is None:
        missing(f"Debian's chromium ({CHROMIUM})", "browser-setup")


@contextlib.asynccontextmanager
async def browser_page(bypass_csp: bool = False) -> AsyncIterator:
    """A fresh headless Chromium page (its own cookies), with the page's console errors collected in
    `page.errors` (a CSP refusal shows there)."""
    need_chromium()
    from playwright.async_api import async_playwright, expect

    expect.set_options(timeout=TIMEOUT_MS)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            context = await browser.new_context(bypass_csp=bypass_csp, viewport={"width": 1280, "height": 900})
            page = await context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.errors = []
            page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: page.errors.append(str(e)))
            yield page
        finally:
            await browser.close()


async def sign_in(page, base: str, token: str) -> None:
    from playwright.async_api import expect

    await page.goto(f"{base}/console/")
    await expect(page).to_have_url(re.compile(r"/console/signin$"))
    await page.get_by_label("Admin token").fill(token)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.get_by_role("button", name="Sign out")).to_be_visible()


async def csrf_of(page) -> str:
    """The signed-in session's CSRF token, as the page hands it to htmx."""
    headers = await page.locator("body").get_attribute("hx-headers")
    found = re.search(r'"X-CSRF-Token": "([0-9a-f]+)"', headers or "")
    assert found, f"no CSRF token on the page: {headers!r}"
    return found.group(1)


async def assert_offers_no_change(page, where: str) -> None:
    """The page on screen offers nothing that changes anything (sign-out aside): no posting form, no htmx
    change, no number field to edit. What a viewer must see on every page."""
    changing = page.locator("form[method=post]:not(.signout), [hx-post], [hx-put], [hx-delete]")
    assert await changing.count() == 0, f"{where} offers a viewer a change"
    assert await page.locator("main input[type=number]").count() == 0, f"{where} offers a viewer a number to edit"


async def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    return path
