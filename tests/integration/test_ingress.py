"""Who may call the gateway: the global client allowlist, per-key networks, and X-Forwarded-For from proxies.

Every request here really comes from 127.0.0.1; addresses beyond that arrive in X-Forwarded-For, which counts
only when 127.0.0.1 is configured as a trusted proxy.
"""

from __future__ import annotations

import time

import httpx
import pytest

from policies.config import Network
from policies.keys import KeyRecord, hash_key, new_key, new_key_id
from policies.network import ClientNetwork
from tests.support.gateway import AUTH, one_model, running_gateway
from tests.support.recorder import Recorder
from tests.support.servers import serve_app

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def post(gw, headers=(), auth=AUTH) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.post(f"{gw.url}/v1/chat/completions", json=BODY,
                               headers=[*auth.items(), *headers])


async def models(gw, headers=(), auth=AUTH) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.get(f"{gw.url}/v1/models", headers=[*auth.items(), *headers])


def xff(value: str) -> tuple[str, str]:
    return ("x-forwarded-for", value)


def refused(r: httpx.Response) -> bool:
    return r.status_code == 403 and r.json()["error"]["code"] == "source_not_allowed"


async def test_global_allowlist_refuses_outsiders_before_authentication():
    rec = Recorder()
    async with serve_app(rec) as up:
        outside = one_model(up, network={"allowed_client_cidrs": ["10.0.0.0/8"]})
        async with running_gateway(outside) as gw:
            assert refused(await post(gw))
            assert refused(await post(gw, auth={}))  # 403 before the key is looked at: no 401
            assert refused(await models(gw))
            assert refused(await post(gw, [xff("10.1.2.3")]))  # spoofed: the peer is no trusted proxy
        inside = one_model(up, network={"allowed_client_cidrs": ["10.0.0.0/8", "127.0.0.0/8"]})
        async with running_gateway(inside) as gw:
            assert (await post(gw)).status_code == 200
            assert (await models(gw)).status_code == 200
            assert (await post(gw, [xff("8.8.8.8")])).status_code == 200  # spoofed outsider: the peer counts
    assert len(rec.requests) == 2


async def test_trusted_proxy_forwards_the_client_address():
    network = {"allowed_client_cidrs": ["10.0.0.0/8"], "trusted_proxies": ["127.0.0.1/32"]}
    async with serve_app(Recorder()) as up, running_gateway(one_model(up, network=network)) as gw:
        assert (await post(gw, [xff("10.1.2.3")])).status_code == 200
        assert (await models(gw, [xff("10.1.2.3")])).status_code == 200
        assert refused(await post(gw, [xff("8.8.8.8")]))
        assert refused(await models(gw, [xff("8.8.8.8")]))
        assert refused(await post(gw))  # no header: the proxy itself is the client, and it is not allowed
        # the client prepends an allowed address; the proxy appends the real one, which is what counts
        assert refused(await post(gw, [xff("10.1.2.3, 8.8.8.8")]))
        # the same with the proxy adding its own header line instead of extending the client's
        assert refused(await post(gw, [xff("10.1.2.3"), xff("8.8.8.8")]))


async def test_chain_of_trusted_proxies_is_walked_from_the_right():
    network = {"allowed_client_cidrs": ["10.0.0.0/8"], "trusted_proxies": ["127.0.0.1/32", "192.168.7.0/24"]}
    async with serve_app(Recorder()) as up, running_gateway(one_model(up, network=network)) as gw:
        assert (await post(gw, [xff("8.8.8.8, 10.1.2.3, 192.168.7.2, 192.168.7.9")])).status_code == 200
        assert refused(await post(gw, [xff("10.1.2.3, 8.8.8.8, 192.168.7.2, 192.168.7.9")]))
        assert refused(await post(gw, [xff("10.1.2.3, 8.8.8.8, 192.168.7.2"), xff("192.168.7.9")]))


async def test_malformed_forwarded_for_from_a_trusted_proxy_falls_back_to_the_peer():
    only_proxy = {"allowed_client_cidrs": ["127.0.0.0/8"], "trusted_proxies": ["127.0.0.1/32"]}
    async with serve_app(Recorder()) as up, running_gateway(one_model(up, network=only_proxy)) as gw:
        for junk in ["garbage", "", "10.1.2.3, unknown", "10.1.2.3,", "1.2.3.4:5678", "8.8.8.8, 999.1.1.1"]:
            assert (await post(gw, [xff(junk)])).status_code == 200, junk  # counted as the peer, 127.0.0.1
        assert refused(await post(gw, [xff("garbage, 8.8.8.8")]))  # junk left of the client is never read


def office_key() -> tuple[KeyRecord, dict[str, str]]:
    """A key usable only from 10.1.0.0/16, and the header that presents it."""
    key_id = new_key_id()
    key = new_key(key_id)
    record = KeyRecord(id=key_id, name="office", created_at=time.time(), hash=hash_key(key),
                       allowed_cidrs=["10.1.0.0/16"])
    return record, {"authorization": f"Bearer {key}"}


async def test_key_networks_see_the_forwarded_address():
    record, auth = office_key()
    network = {"trusted_proxies": ["127.0.0.1/32"]}  # no global allowlist: only the key restricts
    async with serve_app(Recorder()) as up, running_gateway(one_model(up, network=network)) as gw:
        await gw.state.store.create_key(record)
        assert (await post(gw, [xff("10.1.2.3")], auth=auth)).status_code == 200
        assert (await models(gw, [xff("10.1.2.3")], auth=auth)).status_code == 200
        assert refused(await post(gw, [xff("10.2.0.1")], auth=auth))
        assert refused(await models(gw, [xff("10.2.0.1")], auth=auth))
        assert refused(await post(gw, auth=auth))  # the proxy's own address is not the key's network
        assert (await post(gw, [xff("10.2.0.1")])).status_code == 200  # the test key has no networks


async def test_key_networks_ignore_forwarded_for_from_an_untrusted_peer():
    record, auth = office_key()
    async with serve_app(Recorder()) as up, running_gateway(one_model(up)) as gw:
        await gw.state.store.create_key(record)
        assert refused(await post(gw, [xff("10.1.2.3")], auth=auth))
        assert refused(await models(gw, [xff("10.1.2.3")], auth=auth))


@pytest.mark.parametrize("peer, header, expected", [
    ("127.0.0.1", None, "127.0.0.1"),
    ("127.0.0.1", "10.1.2.3", "10.1.2.3"),
    ("8.8.8.8", "10.1.2.3", "8.8.8.8"),  # untrusted peer: header ignored
    ("::ffff:127.0.0.1", "10.1.2.3", "10.1.2.3"),  # IPv4-mapped peer is the IPv4 address
    ("127.0.0.1", "::ffff:10.1.2.3", "10.1.2.3"),
    ("127.0.0.1", "2001:db8::1, fd00::9", "2001:db8::1"),
    ("127.0.0.1", "fd00::9, 127.0.0.5", "fd00::9"),
    ("127.0.0.1", "192.168.7.2, 127.0.0.2", "192.168.7.2"),  # all trusted: the left-most
    ("127.0.0.1", " 10.1.2.3 ,  10.4.5.6 ", "10.4.5.6"),
    ("127.0.0.1", "[10.1.2.3]", "127.0.0.1"),
    ("127.0.0.1", ", ".join(["192.168.7.1"] * 40), "127.0.0.1"),  # a longer chain of proxies than we read
    ("", "10.1.2.3", ""),  # no peer (e.g. a unix socket): nothing to trust
])
def test_client_address_rule(peer, header, expected):
    network = ClientNetwork(Network(trusted_proxies=["127.0.0.0/8", "192.168.7.0/24", "fd00::/8"]))
    assert network.client_address(peer, header) == expected
