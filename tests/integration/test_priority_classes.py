"""Priority classes at the edges: set on a key by the admin API, picked per request only where the key allows,
and sent as vLLM's `priority` only to backends that schedule by it (never a client's own unless allowed)."""

from __future__ import annotations

import httpx

from gateway.admin.auth import mint_token
from policies.config import Admin
from tests.support.gateway import running_gateway
from tests.support.recorder import Recorder
from tests.support.servers import serve_app

SECRET = "priority-test-secret-0123456789abcdef"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def policy(prio_url: str, plain_url: str) -> dict:
    return {"models": [
        {"name": "m", "backends": [{"url": prio_url, "scheduling_policy": "priority"}]},
        {"name": "plain", "backends": [{"url": plain_url}]},
    ]}


async def test_the_class_reaches_a_priority_backend_and_only_allowed_clients_choose(monkeypatch):
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    admin = {"authorization": f"Bearer {mint_token(Admin(), 600)}"}
    prio, plain = Recorder(), Recorder()
    async with serve_app(prio) as p_url, serve_app(plain) as q_url, \
            running_gateway(policy(p_url, q_url), issue_test_key=False) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        r = await http.post("/admin/keys", json={"name": "batch-app", "priority_class": "batch"}, headers=admin)
        assert r.status_code == 201 and r.json()["record"]["priority_class"] == "batch"
        batch = {"authorization": f"Bearer {r.json()['key']}"}
        r = await http.post("/admin/keys", json={"name": "chat-app"}, headers=admin)
        chat_id, chat = r.json()["record"]["id"], {"authorization": f"Bearer {r.json()['key']}"}
        assert r.json()["record"]["priority_class"] is None and r.json()["record"]["client_priority"] is False

        async def sent(headers, body=BODY, extra=None, rec=prio) -> dict:
            r = await http.post("/v1/chat/completions", json=body, headers={**headers, **(extra or {})})
            assert r.status_code == 200, r.text
            return rec.requests[-1]["body"]

        assert (await sent(batch))["priority"] == 10  # the batch class's vllm_priority
        assert (await sent(chat))["priority"] == 0  # the default class, interactive
        # not allowed: the header is ignored and a client's own `priority` is replaced by the class's
        assert (await sent(chat, {**BODY, "priority": -100}, {"x-priority-class": "batch"}))["priority"] == 0
        # a backend without priority scheduling never gets the field
        assert "priority" not in await sent(batch, {**BODY, "model": "plain", "priority": -5}, rec=plain)

        r = await http.patch(f"/admin/keys/{chat_id}", json={"client_priority": True}, headers=admin)
        assert r.json()["client_priority"] is True
        await gw.state.forget_key(chat_id)
        assert (await sent(chat, extra={"x-priority-class": "batch"}))["priority"] == 10
        assert (await sent(chat, {**BODY, "priority": -100}))["priority"] == -100  # now its own
        r = await http.post("/v1/chat/completions", json=BODY, headers={**chat, "x-priority-class": "urgent"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_priority_class"

        r = await http.patch(f"/admin/keys/{chat_id}", json={"priority_class": ""}, headers=admin)
        assert r.status_code == 400 and "priority_class" in r.json()["error"]["message"]


async def test_cheapest_prefill_first_a_prompt_the_replica_holds_goes_ahead_of_one_it_must_recompute(monkeypatch):
    """The default classes send vLLM's `priority` as the class's plus a level: the prompt tokens the chosen replica
    likely has to prefill, by 1,024 (policies/prefill_order.py). A policy's own classes send the class's alone."""
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    admin = {"authorization": f"Bearer {mint_token(Admin(), 600)}"}
    prio, plain = Recorder(), Recorder()
    long_prompt = "word " * 2000  # ~2,500 tokens at 4 characters a token: level 2 when nothing of it is cached
    first = {"model": "m", "messages": [{"role": "system", "content": long_prompt},
                                        {"role": "user", "content": "the first turn"}]}
    later = {"model": "m", "messages": [*first["messages"], {"role": "assistant", "content": "an answer"},
                                        {"role": "user", "content": "the next turn"}]}
    async with serve_app(prio) as p_url, serve_app(plain) as q_url:
        async with running_gateway(policy(p_url, q_url), issue_test_key=False) as gw, \
                httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            r = await http.post("/admin/keys", json={"name": "chat-app"}, headers=admin)
            chat = {"authorization": f"Bearer {r.json()['key']}"}
            r = await http.post("/admin/keys", json={"name": "batch-app", "priority_class": "batch"}, headers=admin)
            batch = {"authorization": f"Bearer {r.json()['key']}"}
            sent = []
            for headers, body in ((chat, first), (chat, later), (chat, BODY), (batch, {**first, "user": "x"})):
                r = await http.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text
                sent.append(prio.requests[-1]["body"]["priority"])
            # whole prompt to prefill: level 2; its next turn, held but for the new messages: 0; a short one: 0;
            # the batch class's levels start at its own 10 (the same prompt, held: 10)
            assert sent == [2, 0, 0, 10]
        own = {**policy(p_url, q_url), "priorities": {"classes": [{"name": "interactive"},
                                                                   {"name": "batch", "vllm_priority": 10}]}}
        async with running_gateway(own, issue_test_key=False) as gw, \
                httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            r = await http.post("/admin/keys", json={"name": "chat-app"}, headers=admin)
            r = await http.post("/v1/chat/completions", json={**first, "user": "y"},
                                headers={"authorization": f"Bearer {r.json()['key']}"})
            assert r.status_code == 200 and prio.requests[-1]["body"]["priority"] == 0  # no levels: the class's
