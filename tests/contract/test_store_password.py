"""A Redis that requires a password: the policy names the env var that holds it (`store.password_env`), so the
policy file, and the ConfigMap it is deployed as, never carries the secret."""

from __future__ import annotations

import pytest
import redis

from gateway.wiring import Gateway
from policies.config import PolicyError, parse_policy
from policies.store import StoreUnavailable
from tests.support.redis_server import RedisServer

SECRET = "s3cret-redis-password-for-tests"


def policy(url: str, password_env: str | None = "TEST_REDIS_PASSWORD"):
    store = f"store: {{kind: redis, url: '{url}'" + (f", password_env: {password_env}" if password_env else "") + "}"
    return parse_policy(store + "\nmodels: [{name: m, backends: [{url: 'http://127.0.0.1:9'}]}]\n")


@pytest.fixture
def locked_redis():
    """A private server with requirepass set (the shared one has none)."""
    with RedisServer() as server:
        redis.Redis(port=server.port).config_set("requirepass", SECRET)
        yield server
        redis.Redis(port=server.port, password=SECRET).config_set("requirepass", "")


async def test_password_from_env_reaches_redis(locked_redis, monkeypatch):
    monkeypatch.setenv("TEST_REDIS_PASSWORD", SECRET)
    gateway = Gateway(policy(locked_redis.url))
    try:
        await gateway.store.ping()
    finally:
        await gateway.store.close()


async def test_without_the_password_redis_refuses(locked_redis):
    gateway = Gateway(policy(locked_redis.url, password_env=None))
    try:
        with pytest.raises(StoreUnavailable) as info:
            await gateway.store.ping()
        assert SECRET not in str(info.value)
    finally:
        await gateway.store.close()


def test_unset_env_var_is_named_and_refused(monkeypatch):
    monkeypatch.delenv("TEST_REDIS_PASSWORD", raising=False)
    with pytest.raises(PolicyError, match="TEST_REDIS_PASSWORD is not set"):
        Gateway(policy("redis://127.0.0.1:6379/0"))


def test_password_in_url_and_env_is_refused():
    with pytest.raises(PolicyError, match="keep it in the env var only"):
        policy("redis://:pw@127.0.0.1:6379/0")
