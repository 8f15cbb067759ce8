"""The three ways to reach Redis, as the policy file says them and as the store reads them."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from policies.config import PolicyError, parse_policy
from policies.store.redis_client import CLUSTER, SENTINEL, STANDALONE, connect, parse

MODELS = "\nmodels: [{name: m, backends: [{url: 'http://127.0.0.1:9'}]}]\n"


def store(text: str):
    return parse_policy(f"store: {text}" + MODELS).store


def test_address_forms():
    assert parse("redis://127.0.0.1:6379/0").mode == STANDALONE
    assert parse("rediss://h:6380/0").tls
    sentinel = parse("redis+sentinel://a:26379,b:26380/mymaster/2")
    assert (sentinel.mode, sentinel.addresses, sentinel.master_name, sentinel.db) == (
        SENTINEL, (("a", 26379), ("b", 26380)), "mymaster", 2)
    cluster = parse("rediss+cluster://a:7000,[::1]:7001")
    assert (cluster.mode, cluster.tls, cluster.addresses) == (CLUSTER, True, (("a", 7000), ("::1", 7001)))


@pytest.mark.parametrize("bad", [
    "http://h:1", "redis+sentinel://h:1", "redis+sentinel://:pw-secret@h:1/m", "redis+cluster://h:1/0",
    "redis+cluster://h", "redis+sentinel://h:1/m/x",
])
def test_bad_addresses_are_refused_without_echoing_them(bad):
    with pytest.raises(ValueError) as info:
        parse(bad)
    assert "pw-secret" not in str(info.value) and "h:1" not in str(info.value)


async def test_each_form_gets_redis_pys_own_client():
    for url, kind in [("redis://127.0.0.1:9/0", Redis), ("redis+sentinel://127.0.0.1:9/m", Redis),
                      ("redis+cluster://127.0.0.1:9", RedisCluster)]:
        client = connect(url)
        assert isinstance(client, kind)
        await client.aclose()


def test_policy_sentinel_and_cluster_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("SENTINEL_PW", "sentinel-secret")
    secret_file = tmp_path / "redis-password"
    secret_file.write_text("data-secret\n")
    s = store(f"{{kind: redis, password_file: '{secret_file}', sentinel: {{addresses: ['s-0:26379', 's-1:26379'], "
              "master_name: gw, password_env: SENTINEL_PW}}")
    assert s.redis_url() == "redis+sentinel://s-0:26379,s-1:26379/gw/0"
    assert (s.password(), s.sentinel.password()) == ("data-secret", "sentinel-secret")
    c = store("{kind: redis, tls: true, tls_ca_file: /ca.pem, cluster: {nodes: ['r-0:6379', 'r-1:6379']}}")
    assert c.redis_url() == "rediss+cluster://r-0:6379,r-1:6379"
    assert "secret" not in s.redis_url()


@pytest.mark.parametrize("text, says", [
    ("{kind: redis, url: 'redis://h:1/0', cluster: {nodes: ['h:1']}}", "one way to reach Redis"),
    ("{kind: redis, sentinel: {addresses: ['a:1']}, cluster: {nodes: ['h:1']}}", "not both"),
    ("{kind: redis, cluster: {nodes: []}}", "at least 1"),
    ("{kind: redis, prefix: 'a{b}'}", "prefix"),
    ("{kind: redis, password_env: A, password_file: /f}", "not both"),
])
def test_contradictory_store_settings_are_refused(text, says):
    with pytest.raises(PolicyError, match=says):
        store(text)


def test_missing_secret_file_is_named(tmp_path):
    s = store(f"{{kind: redis, password_file: '{tmp_path / 'absent'}'}}")
    with pytest.raises(PolicyError, match="password_file"):
        s.password()
