"""Privacy, hostile pass: a prompt of a key made `private_only` never reaches a rented provider, however long ago its
call was admitted.

The decision to rent used to be taken at admission and reused: a call queued before an admin PATCHed its key to
`private_only`, whose owned connection then failed, still went to the rented provider seconds after the PATCH
answered. Here the owned backend (a slow simulator capped at 1) sits behind a TCP proxy that can go down; the
rented stand-in logs every request it gets. A key that allows renting (in a team that does too) queues behind a
private call; then it is made private, or revoked, or (the control) nothing changes; then
the owned backend stops taking connections and the private call ends, so the queued call's owned connection fails.
Unchanged, it spills (so the path really rents); changed, it never does, and the provider's log proves it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import jwt
import pytest

from tools.simulator import create_app
from tests.integration.test_overflow import SLOW, issue, standin  # noqa: F401 - the stand-in provider fixture
from tests.integration.test_overflow import policy as overflow_policy
from tests.support.gateway import running_gateway
from tests.support.probes import eventually, metric_sum
from tests.support.rented_standin import read_log
from tests.support.servers import free_port, serve_app
from tests.support.tcp_proxy import tcp_proxy

SECRET = "p" * 40
BODY = {"model": "m", "messages": [{"role": "user", "content": "private words"}], "max_tokens": 5}


def admin_headers() -> dict[str, str]:
    now = int(time.time())
    token = jwt.encode({"iss": "llm-gateway", "aud": "llm-gateway-admin", "sub": "t", "role": "admin", "iat": now,
                        "nbf": now, "exp": now + 600}, SECRET, algorithm="HS256")
    return {"authorization": f"Bearer {token}"}


def policy(owned: str, rented: str) -> dict:
    """test_overflow's, with one slot, never spilling for waiting (only when no owned replica can serve: the
    failover path), a long auth cache (a stale record would serve long) and only the failed connection taking
    the replica out."""
    found = overflow_policy(owned, rented, when_wait_exceeds=60)
    found["models"][0]["backends"][0]["cap"] = 1
    return {**found, "auth": {"cache_seconds": 30}, "health": {"interval": 30}}


async def _in_flight(http: httpx.AsyncClient, url: str, metric: str, n: int) -> bool:
    return metric_sum((await http.get(f"{url}/metrics")).text, metric, model="m") == n


@pytest.mark.parametrize("change", ["none", "key_private", "revoke"])
async def test_a_call_queued_before_its_key_lost_renting_never_rents(standin, monkeypatch, change):  # noqa: F811
    rented_url, log, _ = standin
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    async with serve_app(create_app(SLOW)) as sim:
        sim_port = int(sim.rsplit(":", 1)[1])
        async with tcp_proxy("127.0.0.1", sim_port, free_port()) as door, \
                running_gateway(policy(door.url, rented_url)) as gw, \
                httpx.AsyncClient(timeout=60, headers=admin_headers()) as admin, \
                httpx.AsyncClient(timeout=60) as http:
            r = await admin.post(f"{gw.url}/admin/teams", json={"name": "t1", "data_policy": "allow_rented"})
            assert r.status_code == 201, r.text
            r = await admin.post(f"{gw.url}/admin/keys", json={"name": "k", "team": "t1",
                                                               "data_policy": "allow_rented"})
            assert r.status_code == 201, r.text
            key, key_id = r.json()["key"], r.json()["record"]["id"]
            holder = await issue(gw, "private_only")
            async with http.stream("POST", f"{gw.url}/v1/chat/completions",
                                   json={**BODY, "max_tokens": 400, "ignore_eos": True, "stream": True},
                                   headers={"authorization": f"Bearer {holder}"}) as holding:
                assert holding.status_code == 200
                chunks = holding.aiter_bytes()  # kept: a dropped iterator closes the stream
                await anext(chunks)  # it holds the one slot (~8 s at 20 ms a token)
                waiting = asyncio.create_task(http.post(
                    f"{gw.url}/v1/chat/completions", json=BODY,
                    headers={"authorization": f"Bearer {key}", "x-request-id": "queued"}))
                await eventually(lambda: _in_flight(http, gw.url, "llm_gateway_queue_depth", 1), timeout=30)

                if change == "key_private":
                    r = await admin.patch(f"{gw.url}/admin/keys/{key_id}", json={"data_policy": "private_only"})
                    assert r.status_code == 200, r.text
                elif change == "revoke":
                    r = await admin.post(f"{gw.url}/admin/keys/{key_id}/revoke")
                    assert r.status_code == 200, r.text
                door.refuse_new(keep=b"POST /v1/chat/completions")  # the owned backend takes no new connection
            # the private call hung up: its slot goes to the queued call, whose owned connection is refused
            reply = await asyncio.wait_for(waiting, 60)

    sent = {e["request_id"] for e in read_log(log)}
    if change == "none":  # the control: the same path rents for a key that still may
        assert reply.status_code == 200 and reply.headers["x-gateway-served-by"] == "rented", reply.text
        assert "queued" in sent
        return
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["code"] == "rented_not_allowed"
    assert "queued" not in sent
