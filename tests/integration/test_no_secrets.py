"""No API key, key hash, admin token or admin secret appears in any log line, error body, header or metric.

A full run: keys issued, used (plain and streamed), rotated, revoked, misused, upstream failures, admin
mistakes, metrics scraped. Everything logged (DEBUG and up, every logger) and every response is searched
for every secret, except the one response that hands a key to its admin.
"""

import logging

import httpx
import openai
import pytest

from gateway.admin.auth import mint_token
from policies.config import Admin
from policies.keys import hash_key
from tests.support.gateway import running_gateway
from tests.support.recorder import Recorder
from tests.support.servers import serve_app

SECRET = "admin-secret-" + "q" * 40


async def test_no_secret_in_logs_responses_or_metrics(monkeypatch, caplog):
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    caplog.set_level(logging.DEBUG)
    token = mint_token(Admin(), 600)
    viewer = mint_token(Admin(), 600, role="viewer")
    secrets_issued = {SECRET, token, viewer}
    seen: list[str] = []  # every response the clients got, as text

    def record(response: httpx.Response) -> httpx.Response:
        seen.append(f"{response.status_code} {dict(response.headers)} {response.text}")
        return response

    rec = Recorder()
    async with serve_app(rec) as up, running_gateway(
        {"models": [{"name": "m", "backends": [{"url": up}]}]}, issue_test_key=False
    ) as gw, httpx.AsyncClient(timeout=10) as http:
        admin = {"authorization": f"Bearer {token}"}

        async def issue(path: str, **kw) -> str:
            r = await http.post(f"{gw.url}/admin/keys{path}", headers=admin, **kw)
            assert r.status_code in (200, 201), r.text
            key = r.json()["key"]
            secrets_issued.update({key, key.split("-", 2)[2], hash_key(key)})
            return key

        key = await issue("", json={"name": "a", "models": ["m"]})
        other = await issue("", json={"name": "b"})
        key_id = key.split("-")[1]
        for k in (key, other):
            client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=k, max_retries=0)
            await client.chat.completions.create(model="m", messages=[])
            [c async for c in await client.chat.completions.create(model="m", messages=[], stream=True)]
        rotated = await issue(f"/{key_id}/rotate", json={"grace_seconds": 60})
        rec.mode = "status:500"
        record(await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"},
                               headers={"authorization": f"Bearer {rotated}"}))
        rec.mode = "ok"
        tampered = [key[:-1] + ("A" if key[-1] != "A" else "B"), key + key, f"Bearer {key}", key.replace("sk-", "pk-")]
        for bad in tampered:
            record(await http.post(f"{gw.url}/v1/chat/completions", json={"model": "m"},
                                   headers={"authorization": f"Bearer {bad}"}))
            record(await http.get(f"{gw.url}/v1/models", headers={"authorization": f"Bearer {bad}"}))
        record(await http.post(f"{gw.url}/v1/chat/completions", content=b"{broken",
                               headers={"authorization": f"Bearer {key}"}))
        record(await http.post(f"{gw.url}/v1/chat/completions", json={"model": "nope"},
                               headers={"authorization": f"Bearer {other}"}))
        for bad_token in (token[:-3], token + "x", viewer):
            record(await http.post(f"{gw.url}/admin/keys", json={"name": "x"},
                                   headers={"authorization": f"Bearer {bad_token}"}))
        record(await http.post(f"{gw.url}/admin/keys/{key_id}/revoke", headers=admin))
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0).models.list()
        for path in ("", f"/{key_id}", f"/{key_id}/usage"):
            record(await http.get(f"{gw.url}/admin/keys{path}", headers=admin))
        record(await http.patch(f"{gw.url}/admin/keys/{key_id}", headers=admin, json={"name": "renamed"}))
        record(await http.get(f"{gw.url}/metrics"))
        record(await http.get(f"{gw.url}/schema/openapi.json"))

    logs = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''} {r.args!r}" for r in caplog.records)
    assert "request_id=" in logs  # the access log was captured, so the search below means something
    haystacks = {"logs": logs, "responses": "\n".join(seen), "upstream": repr(rec.requests)}
    for where, text in haystacks.items():
        for secret in secrets_issued:
            assert secret not in text, f"a secret appeared in {where}"
