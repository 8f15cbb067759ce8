"""Pytest fixtures for tests that need Redis. Import them into a conftest (or a test module):

    from tests.support.redis_fixtures import redis_prefix, redis_server  # noqa: F401

Three ways to run Redis (one server, a Sentinel set, a Cluster: see redis_ha), each started once per session
when a test first needs it. `redis_server` is the one the test's parameters name: a suite parametrized with
"redis", "redis-sentinel" and "redis-cluster" runs unchanged against all three (a test without such a
parameter gets the standalone server). Tests stay independent by writing under their own `redis_prefix`. A
test that stops, restarts or kills Redis should start its own rather than disturb the shared ones.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.support.redis_ha import ClusterSet, SentinelSet
from tests.support.redis_server import RedisServer

SETUPS = {"redis": "redis_standalone", "redis-sentinel": "redis_sentinel", "redis-cluster": "redis_cluster"}


@pytest.fixture(scope="session")
def redis_standalone() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[SentinelSet]:
    with SentinelSet() as servers:
        yield servers


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[ClusterSet]:
    with ClusterSet() as servers:
        yield servers


@pytest.fixture
def redis_server(request) -> RedisServer | SentinelSet | ClusterSet:
    """The set-up this test's parameters name; each has a `url` that open_store("redis", url=...) takes."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    setup = next((SETUPS[v] for v in params.values() if isinstance(v, str) and v in SETUPS), "redis_standalone")
    return request.getfixturevalue(setup)


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix no other test uses."""
    return f"test-{uuid.uuid4().hex[:12]}:"


def shared_stores(request, tmp_path, count: int = 2) -> list:
    """`count` stores on one backing store, as that many gateway replicas open them: the SQLite file under
    `tmp_path` when the test's parameter is "sqlite", else the Redis set-up it names (under its own prefix)."""
    from policies.store import open_store

    if request.param == "sqlite":
        return [open_store("sqlite", path=str(tmp_path / "gateway.db")) for _ in range(count)]
    server, prefix = request.getfixturevalue("redis_server"), request.getfixturevalue("redis_prefix")
    return [open_store("redis", url=server.url, prefix=prefix) for _ in range(count)]
