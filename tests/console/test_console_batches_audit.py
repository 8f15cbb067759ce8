"""The console's batches and audit pages over HTTP (no browser): every key's batches with their status,
progress, creation time and error file, cancelled by an admin only (with the session's CSRF token, and
audited); the audit log searched by actor, action and time range, paged, read-only for every role."""

from __future__ import annotations

import asyncio
import io
import json
import re
import time

import httpx
import openai
import pytest

from tools.simulator import SimConfig, create_app
from gateway.admin.auth import mint_token
from policies.config import Admin
from policies.keys import KeyRecord, hash_key, key_id_of, new_key, new_key_id
from tests.support.gateway import TEST_KEY, one_model, running_gateway
from tests.support.servers import serve_app

SECRET = "b" * 40
WAIT = 60.0  # seconds a background condition may take on a slow machine
SLOW = SimConfig(model="served-m", step_base_ms=40, step_ms_per_seq=0)


@pytest.fixture(autouse=True)
def admin_secret(monkeypatch):
    monkeypatch.setenv(Admin().jwt_secret_env, SECRET)


def token(role: str = "admin", subject: str | None = None) -> str:
    return mint_token(Admin(), 900, role=role, subject=subject or f"{role}-in-test", secret=SECRET)


async def signed_in(http: httpx.AsyncClient, token: str) -> str:
    """Signs `http` in (the policy's cookie is not Secure, so httpx keeps it); the session's CSRF token."""
    form = await http.get("/console/signin")
    nonce = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
    r = await http.post("/console/signin", data={"csrf": nonce, "token": token})
    assert r.status_code == 303, r.text
    page = await http.get("/console/fleet")
    return re.search(r'"X-CSRF-Token": "([0-9a-f]+)"', page.text).group(1)


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(n: int, **body) -> dict:
    return {"custom_id": f"req-{n}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"say {n}"}], "max_tokens": 40, **body}}


async def submitted(sdk: openai.AsyncOpenAI, lines: list[dict]):
    uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")


async def ended(sdk: openai.AsyncOpenAI, batch_id: str):
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        batch = await sdk.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {WAIT} s")


def rows(html: str) -> dict[str, str]:
    """The batches table's rows by batch id: each row's text, tags stripped."""
    found = re.findall(r'<tr data-batch="([^"]+)">(.*?)</tr>', html, re.S)
    return {batch_id: re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body)).strip() for batch_id, body in found}


async def test_batches_page_lists_every_keys_batches_and_only_an_admin_cancels_one(tmp_path):
    other = new_key(new_key_id())
    async with serve_app(create_app(SLOW)) as backend:
        policy = {**one_model(backend), "console": {"enabled": True, "secure_cookie": False},
                  "batch": {"files_dir": str(tmp_path / "files"), "poll_seconds": 0.1, "concurrency": 1}}
        async with running_gateway(policy) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http, \
                httpx.AsyncClient(base_url=gw.url, timeout=30) as viewer_http:
            await gw.state.store.create_key(KeyRecord(id=key_id_of(other), name="other-app", created_at=time.time(),
                                                      hash=hash_key(other)))
            mine = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TEST_KEY, max_retries=0, timeout=30)
            theirs = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=other, max_retries=0, timeout=30)
            long = await submitted(mine, [chat_line(n) for n in range(40)])  # minutes at one line at a time
            failing = await submitted(theirs, [chat_line(n, max_tokens=-1) for n in range(2)])  # the backend's 400s
            done = await ended(theirs, failing.id)
            assert done.status == "completed" and done.error_file_id

            csrf = await signed_in(http, token("admin"))
            page = await http.get("/console/batches")
            assert page.status_code == 200 and "Batches</a>" in page.text and "Audit log</a>" in page.text
            shown = rows(page.text)
            assert set(shown) == {long.id, failing.id}  # every key's, for an admin
            assert f"{key_id_of(other)} other-app completed 0 / 2 / 2" in shown[failing.id]
            assert done.error_file_id in shown[failing.id]
            assert time.strftime("%Y-%m-%d", time.gmtime(done.created_at)) in shown[failing.id]
            assert re.search(r"(validating|in_progress) \d+ / 0 / 40", shown[long.id]), shown[long.id]
            assert f'action="/console/batches/{key_id_of(TEST_KEY)}/{long.id}/cancel"' in page.text
            assert f"/{failing.id}/cancel" not in page.text  # an ended batch offers no cancel

            narrowed = rows((await http.get("/console/batches", params={"key": "other-app"})).text)
            assert set(narrowed) == {failing.id}
            assert set(rows((await http.get("/console/batches", params={"status": "completed"})).text)) == {failing.id}

            # a viewer reads the list but gets no cancel button, and the server refuses the post anyway
            viewer_csrf = await signed_in(viewer_http, token("viewer"))
            seen = await viewer_http.get("/console/batches")
            assert set(rows(seen.text)) == {long.id, failing.id} and "/cancel" not in seen.text
            cancel = f"/console/batches/{key_id_of(TEST_KEY)}/{long.id}/cancel"
            refused = await viewer_http.post(cancel, data={"csrf": viewer_csrf}, headers={"hx-request": "true"})
            assert refused.status_code == 403
            stale = await http.post(cancel, data={"csrf": "0" * 64}, headers={"hx-request": "true"})
            assert stale.status_code == 403
            wrong_key = await http.post(f"/console/batches/{key_id_of(other)}/{long.id}/cancel",
                                        data={"csrf": csrf}, headers={"hx-request": "true"})
            assert wrong_key.status_code == 404  # looked up through its key, as the Batch API does
            assert (await mine.batches.retrieve(long.id)).status in ("validating", "in_progress")

            r = await http.post(cancel, data={"csrf": csrf, "key": "", "status": "", "page": "1"},
                                headers={"hx-request": "true"})
            assert r.status_code == 200 and f"{long.id}: cancelling" in r.text
            assert re.search(r"cancell(ing|ed) ", rows(r.text)[long.id])
            final = await ended(mine, long.id)
            assert final.status == "cancelled" and final.request_counts.completed < 40
            r = await http.get("/admin/audit", params={"action": "batch.cancel"},
                               headers={"authorization": f"Bearer {token()}"})
            [event] = r.json()["events"]
            assert (event["actor"], event["role"], event["target"]) == ("admin-in-test", "admin", long.id)
            assert event["changes"]["key_id"] == key_id_of(TEST_KEY)
            assert event["changes"]["status"] in ({"from": "in_progress", "to": "cancelling"},
                                                  {"from": "validating", "to": "cancelling"})


async def test_batches_page_says_when_the_batch_api_is_off():
    policy = {**one_model("http://127.0.0.1:9"), "console": {"enabled": True, "secure_cookie": False},
              "batch": {"enabled": False}}
    async with running_gateway(policy) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        await signed_in(http, token("viewer"))
        r = await http.get("/console/batches")
        assert r.status_code == 409 and "Batch API is off" in r.text and "<h1>" in r.text


async def test_audit_page_searches_by_actor_action_and_time_and_pages_through_it():
    policy = {**one_model("http://127.0.0.1:9"), "console": {"enabled": True, "secure_cookie": False,
                                                            "page_size": 10}}
    async with running_gateway(policy) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        alice = {"authorization": f"Bearer {token('admin', 'alice')}"}
        made = []
        for n in range(12):
            r = await http.post("/admin/keys", json={"name": f"k{n}"}, headers=alice)
            assert r.status_code == 201, r.text
            made.append(r.json()["record"]["id"])
        bob = {"authorization": f"Bearer {token('admin', 'bob')}"}
        r = await http.post(f"/admin/keys/{made[0]}/revoke", headers=bob)
        assert r.status_code == 200, r.text

        await signed_in(http, token("viewer"))  # reading the log is a viewer's right; it offers no change
        first = await http.get("/console/audit", params={"actor": "alice"})
        assert first.status_code == 200
        events = re.findall(r'<tr data-event="[^"]+">(.*?)</tr>', first.text, re.S)
        assert len(events) == 10 and all("alice" in e and "key.create" in e for e in events)
        assert f"<code>{made[11]}</code>" in first.text and f"<code>{made[1]}</code>" not in first.text  # newest first
        assert 'method="post"' not in first.text.split("</header>", 1)[1] and "hx-post" not in first.text
        older = re.search(r'href="(/console/audit\?[^"]*before=[^"]+)"', first.text).group(1).replace("&amp;", "&")
        second = await http.get(older)
        events = re.findall(r'<tr data-event="[^"]+">(.*?)</tr>', second.text, re.S)
        assert len(events) == 2 and f"<code>{made[0]}</code>" in second.text and "before=" not in second.text

        revoked = await http.get("/console/audit", params={"action": "key.revoke"})
        events = re.findall(r'<tr data-event="[^"]+">(.*?)</tr>', revoked.text, re.S)
        assert len(events) == 1 and "bob" in events[0] and "revoked: False → True" in events[0]

        hour = 3600
        later = time.strftime("%Y-%m-%dT%H:%M", time.gmtime(time.time() + hour))
        earlier = time.strftime("%Y-%m-%dT%H:%M", time.gmtime(time.time() - hour))
        assert "No events match" in (await http.get("/console/audit", params={"since": later})).text
        assert "No events match" in (await http.get("/console/audit", params={"until": earlier})).text
        window = await http.get("/console/audit", params={"since": earlier, "until": later, "action": "key.revoke"})
        assert len(re.findall(r'<tr data-event=', window.text)) == 1

        bad = await http.get("/console/audit", params={"since": "yesterday"})
        assert bad.status_code == 400 and "<h1>" in bad.text
        bad = await http.get("/console/audit", params={"since": "2026-13-45T99:99"})
        assert bad.status_code == 400 and "since" in bad.text


async def test_the_new_pages_carry_the_csp_and_hold_no_inline_script_or_style(tmp_path):
    policy = {**one_model("http://127.0.0.1:9"), "console": {"enabled": True, "secure_cookie": False},
              "batch": {"files_dir": str(tmp_path / "files")}}
    async with running_gateway(policy) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        await signed_in(http, token("admin"))
        for path in ("batches", "audit", "audit?since=2026-01-01T00:00"):
            r = await http.get(f"/console/{path}")
            assert r.status_code == 200, (path, r.text[:300])
            assert "unsafe-inline" not in r.headers["content-security-policy"]
            assert not re.search(r"<script(?![^>]*\bsrc=)", r.text), f"{path}: an inline script"
            assert not re.search(r"\s(style|on[a-z]+)=", r.text), f"{path}: an inline style or handler"
            fields = re.findall(r'<(?:input|select)\b(?![^>]*type="hidden")[^>]*\bid="([^"]+)"', r.text)
            assert fields and all(f'for="{f}"' in r.text for f in fields), path  # every field has its label
