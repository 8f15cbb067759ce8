"""The console in a real browser (headless Debian Chromium driven by Playwright) against a gateway process over
the two shared real CPU vLLM servers: one public model, `duo`, whose replicas are vLLM A and vLLM B.

In one browser session: the fleet page shows both replicas up with vLLM's own running, waiting and KV cache
figures (scraped from the real servers' /metrics), and they move under real load; vLLM B is paused (SIGSTOP)
until the gateway's health check takes it down, and the page, never reloaded, shows it down and then up again
once B is resumed; a key issued on the keys page gets a real completion through the OpenAI SDK, is revoked on
its page, and the SDK then gets 401; signed in again as a viewer, every page shows and none offers a change.
Screenshots land in build/artifacts/console/ (CI keeps them).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import openai
import pytest

from tests.e2e.conftest import e2e_policy, gateway_process
from tests.e2e.vllm_procs import free_port
from tests.support.browser import assert_offers_no_change, browser_page, csrf_of, screenshot, sign_in
from tests.support.probes import metric_sum

WAIT_MS = 90_000  # any background condition (a scrape, a health check, a refresh) on a slow, loaded 2-core machine
REFRESH = 1  # seconds between the fleet page's refreshes
# the fleet table's cells by column (td elements of a replica's row, after its name's th)
COLUMN = {"state": 2, "running": 4, "waiting": 5, "kv": 6}


@pytest.fixture(scope="module")
def console_gateway(vllm_servers, tmp_path_factory):
    """A gateway process with the console on, serving `duo` over both shared vLLM servers."""
    policy = e2e_policy(vllm_servers, free_port())
    policy["models"] = [m for m in policy["models"] if m["name"] == "duo"]  # one table: duo-a (A) and duo-b (B)
    policy["console"] = {"enabled": True, "refresh_seconds": REFRESH}
    with gateway_process(policy, tmp_path_factory.mktemp("console-gateway")) as gw:
        yield gw


def expect():
    from playwright.async_api import expect as playwright_expect

    return playwright_expect


def cell(page, replica: str, column: str):
    return page.locator(f'tr[data-replica="{replica}"] td:nth-of-type({COLUMN[column]})')


async def load(url: str, key: str, stop: asyncio.Event) -> None:
    """Long streams to `duo`, four at a time, one after another until `stop`: vLLM has requests running for as
    long as the page needs to see them (one 400-token stream alone takes only ~2 s on this model)."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120) as client:
        async def one() -> None:
            while not stop.is_set():
                stream = await client.completions.create(model="duo", prompt="Count on and on:", max_tokens=400,
                                                         stream=True, extra_body={"ignore_eos": True})
                async for _ in stream:
                    if stop.is_set():
                        break
                await stream.close()

        await asyncio.gather(*(one() for _ in range(4)))


async def test_console_over_real_vllm_fleet_keys_and_viewer(console_gateway, vllm_servers):
    gw, paused = console_gateway, vllm_servers["b"]
    started = time.monotonic()
    async with browser_page() as page:
        # 1. the fleet: both real replicas up, with vLLM's own figures, not blanks
        await sign_in(page, gw.url, gw.admin_token("admin"))
        await expect()(page.locator("h1")).to_have_text("Fleet")
        for replica in ("duo-a", "duo-b"):
            await expect()(cell(page, replica, "state")).to_have_text("up", timeout=WAIT_MS)
            await expect()(cell(page, replica, "running")).to_have_text(re.compile(r"^\d+$"), timeout=WAIT_MS)
            await expect()(cell(page, replica, "waiting")).to_have_text(re.compile(r"^\d+$"), timeout=WAIT_MS)
            await expect()(cell(page, replica, "kv")).to_have_text(re.compile(r"^\d+ %$"), timeout=WAIT_MS)
        await expect()(page.locator("table.fleet caption")).to_contain_text("2 of 2 replicas up")
        await page.evaluate("window.stillTheSamePage = true")  # gone if anything below reloads the page

        # ... and they follow vLLM under real load: a replica's running count leaves 0 while streams run there
        stop = asyncio.Event()
        loader = asyncio.create_task(load(gw.url, gw.key, stop))
        try:
            busy = page.locator("tr[data-replica] td:nth-of-type(4)").filter(has_text=re.compile(r"^[1-9]\d*$"))
            await expect()(busy.first).to_be_visible(timeout=WAIT_MS)
            # the servers themselves say so too (the four streams start together, so end together: between one
            # round and the next, for a moment, none runs; the page may have shown the count of the round before)
            deadline = time.monotonic() + WAIT_MS / 1000
            while sum((vllm_running := {k: metric_sum(s.metrics_text(), "vllm:num_requests_running")
                                        for k, s in vllm_servers.items()}).values()) < 1:
                assert time.monotonic() < deadline, vllm_running
                await asyncio.sleep(0.1)
            await screenshot(page, "vllm-fleet-under-load")
        finally:
            stop.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(loader, 120)
        loader.result()  # a stream that failed fails the test
        for replica in ("duo-a", "duo-b"):  # and back to 0 once the streams are done
            await expect()(cell(page, replica, "running")).to_have_text("0", timeout=WAIT_MS)

        # 3. vLLM B stops answering (SIGSTOP): the health check takes duo-b down, the page shows it without a
        # reload, and once B is resumed, up again. Resumed however this ends: later tests share B.
        try:
            paused.pause()
            await expect()(cell(page, "duo-b", "state")).to_have_text(re.compile(r"^down"), timeout=WAIT_MS)
            await expect()(page.locator("table.fleet caption")).to_contain_text("1 of 2 replicas up")
            await expect()(cell(page, "duo-a", "state")).to_have_text("up")
            await screenshot(page, "vllm-fleet-replica-down")
        finally:
            paused.resume()
        await expect()(cell(page, "duo-b", "state")).to_have_text("up", timeout=WAIT_MS)
        await expect()(cell(page, "duo-b", "running")).to_have_text(re.compile(r"^\d+$"), timeout=WAIT_MS)
        await expect()(page.locator("table.fleet caption")).to_contain_text("2 of 2 replicas up")
        assert await page.evaluate("window.stillTheSamePage === true")  # refreshed in place, never reloaded
        await screenshot(page, "vllm-fleet-replica-back")

        # 2. a key issued on the keys page gets a real completion from vLLM; revoked on its page: 401
        await page.get_by_role("link", name="Keys", exact=True).click()
        await page.get_by_text("Issue a key").click()
        form = page.locator("#create form")
        await form.get_by_label("Name", exact=True).fill("console-vllm")
        await form.get_by_role("button", name="Issue key").click()
        box = page.locator(".one-time-secret")
        await expect()(box).to_have_value(re.compile(r"^sk-[0-9a-f]{16}-"))
        secret = await box.input_value()
        key_id = secret.split("-")[1]
        async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=secret, max_retries=0, timeout=120) as sdk:
            reply = await sdk.chat.completions.create(model="duo", max_tokens=8,
                                                      messages=[{"role": "user", "content": "Say hello."}])
            assert reply.choices[0].message.content and reply.model in ("tiny-a", "tiny-b", "duo"), reply
            assert reply.usage is not None and reply.usage.completion_tokens >= 1  # counted by vLLM
            await page.goto(f"{gw.url}/console/keys/{key_id}")
            await expect()(page.locator("#key-state")).to_have_text("active")
            await page.get_by_text("Revoke this key…").click()  # a confirm step first
            await page.get_by_role("button", name="Yes, revoke this key").click()
            await expect()(page.locator("#key-state")).to_have_text("revoked")
            await screenshot(page, "vllm-key-revoked")
            with pytest.raises(openai.AuthenticationError) as refused:
                await sdk.chat.completions.create(model="duo", max_tokens=8,
                                                  messages=[{"role": "user", "content": "Say hello."}])
            assert refused.value.status_code == 401
        assert secret not in await page.content()
        assert not page.errors, page.errors

        # 4. signed in again as a viewer: every page shows, none offers a change, and a change posted is refused
        await page.get_by_role("button", name="Sign out").click()
        await sign_in(page, gw.url, gw.admin_token("viewer"))
        await expect()(cell(page, "duo-a", "state")).to_have_text("up", timeout=WAIT_MS)
        for path in ("fleet", "keys", f"keys/{key_id}", "usage", "report", "variants"):
            await page.goto(f"{gw.url}/console/{path}")
            await expect()(page.locator("h1")).to_be_visible()
            await assert_offers_no_change(page, path)
        await screenshot(page, "vllm-viewer-variants")
        refused_post = await page.request.post(f"{gw.url}/console/keys", form={"name": "by-viewer"},
                                               headers={"x-csrf-token": await csrf_of(page)})
        assert refused_post.status == 403
        assert not page.errors, page.errors
    print(f"console over real vLLM: {time.monotonic() - started:.1f} s in the browser")
