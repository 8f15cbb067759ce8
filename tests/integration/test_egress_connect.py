"""A backend named by hostname whose DNS answer turns public after load: the gateway must refuse to connect.

The public answer is in TEST-NET-3 (203.0.113.0/24) and every TCP connection the process opens is recorded,
so the test shows the refusal happens before any connection attempt, not because the address is unreachable.
"""

from __future__ import annotations

import ipaddress
import logging

import httpcore
import httpx
import pytest

from gateway.wiring import Gateway
from policies.config import Policy, PolicyError
from tests.support.gateway import AUTH, one_model, running_gateway
from tests.support.recorder import Recorder
from tests.support.servers import serve_app

PUBLIC = "203.0.113.7"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SLOW_HEALTH = {"interval": 60, "backoff_initial": 60, "backoff_max": 60}  # only requests open connections
NO_SCRAPE = {"scrape": {"enabled": False}}  # nor vLLM /metrics scrapes: their refusals would count too


class SwitchableDNS:
    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers

    async def resolve(self, host: str, port: int) -> list[str]:
        if host not in self.answers:
            raise OSError(f"unknown host {host}")
        return list(self.answers[host])


@pytest.fixture
def connects(monkeypatch) -> list[str]:
    """Every host any httpx client in this process opens a TCP connection to."""
    seen: list[str] = []
    real = httpcore.AnyIOBackend.connect_tcp

    async def recording(self, host, port, *args, **kwargs):
        seen.append(host)
        return await real(self, host, port, *args, **kwargs)

    monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", recording)
    return seen


def in_test_net(host: str) -> bool:
    try:
        return ipaddress.ip_address(host) in ipaddress.ip_network("203.0.113.0/24")
    except ValueError:
        return False


async def test_dns_turning_public_after_load_is_refused_before_connecting(connects, caplog):
    dns = SwitchableDNS({"backend.internal": ["127.0.0.1"]})
    rec = Recorder()
    # No keep-alive at the backend: every request needs a new connection, so a DNS change is seen at once.
    async with serve_app(rec, timeout_keep_alive=0) as up, httpx.AsyncClient(timeout=10, headers=AUTH) as http:
        port = up.rsplit(":", 1)[1]
        policy = one_model(f"http://backend.internal:{port}", health=SLOW_HEALTH, routing=NO_SCRAPE)
        async with running_gateway(policy, resolver=dns) as gw:
            r = await http.post(f"{gw.url}/v1/chat/completions", json=BODY)
            assert r.status_code == 200 and len(rec.requests) == 1
            assert "backend.internal" not in connects and "127.0.0.1" in connects  # connected to the checked IP

            dns.answers["backend.internal"] = [PUBLIC]
            with caplog.at_level(logging.INFO):
                r = await http.post(f"{gw.url}/v1/chat/completions", json=BODY)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend_available"
            assert len(rec.requests) == 1
            assert not any(in_test_net(h) for h in connects)
            assert f"refused: backend backend.internal:{port} resolved to public address {PUBLIC}" in caplog.text
            assert "backend m-0" in caplog.text and "is down" in caplog.text
            assert await gw.metric("llm_gateway_backend_up", backend="m-0") == 0
            # one request, one connection attempt, refused once (health probes are a minute apart)
            assert await gw.metric("llm_gateway_upstream_errors_total", backend="m-0", kind="connect") == 1
            assert await gw.metric("llm_gateway_egress_refused_total", host="backend.internal") == 1

            dns.answers["backend.internal"] = ["127.0.0.1"]  # put right: the next probe brings it back
            replica = gw.state.replicas.by_model["m"][0]
            assert await gw.state.replicas.check(replica.upstream.client, replica, 5)
            r = await http.post(f"{gw.url}/v1/chat/completions", json=BODY)
            assert r.status_code == 200 and len(rec.requests) == 2


async def test_replica_whose_answer_turns_public_fails_over_to_a_private_one(connects):
    dns = SwitchableDNS({"a.internal": ["127.0.0.1"], "b.internal": ["127.0.0.1"]})
    rec_a, rec_b = Recorder("a"), Recorder("b")
    async with serve_app(rec_a, timeout_keep_alive=0) as up_a, serve_app(rec_b) as up_b, \
            httpx.AsyncClient(timeout=10, headers=AUTH) as http:
        urls = [f"http://{name}.internal:{up.rsplit(':', 1)[1]}" for name, up in (("a", up_a), ("b", up_b))]
        policy = one_model(*urls, health=SLOW_HEALTH, routing=NO_SCRAPE)
        async with running_gateway(policy, resolver=dns) as gw:
            dns.answers["a.internal"] = ["127.0.0.1", PUBLIC]  # one record of many is enough to refuse
            # the guard checks new connections: drop the one the startup health check left open
            gw.state.replicas.by_model["m"][0].upstream.client.close_idle()
            served = []
            for _ in range(30):  # ties between the replicas are broken at random: go on until a was picked once
                r = await http.post(f"{gw.url}/v1/chat/completions", json=BODY)
                assert r.status_code == 200
                served.append(r.json()["served_by"])
                if await gw.metric("llm_gateway_egress_refused_total", host="a.internal") >= 1:
                    break
            assert set(served) == {"b"} and rec_a.requests == []
            assert await gw.metric("llm_gateway_backend_up", backend="m-0") == 0
            assert await gw.metric("llm_gateway_retries_total") == 1  # the one refusal, retried once on b
    assert not any(in_test_net(h) for h in connects)


async def test_public_answer_at_startup_stops_the_gateway(tmp_path):
    dns = SwitchableDNS({"backend.internal": ["127.0.0.1", PUBLIC]})
    policy = Policy.model_validate({**one_model("http://backend.internal:8000", health=SLOW_HEALTH, routing=NO_SCRAPE),
                                    "store": {"kind": "sqlite", "path": str(tmp_path / "keys.db")}})
    gateway = Gateway(policy, resolver=dns)
    with pytest.raises(PolicyError, match=f"backends\\[0\\]\\(name=m-0\\).*public address {PUBLIC}"):
        async with gateway.lifespan(None):
            pass
    await gateway.store.close()


async def test_unresolvable_backend_at_startup_only_logs(caplog):
    with caplog.at_level(logging.WARNING, logger="gateway.egress"):
        async with running_gateway(one_model("http://not-yet.internal:8000", health=SLOW_HEALTH, routing=NO_SCRAPE),
                                   resolver=SwitchableDNS({})) as gw:
            assert gw.state.proxy is not None
    assert "cannot resolve host 'not-yet.internal'" in caplog.text
