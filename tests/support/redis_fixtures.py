"""Pytest fixtures for tests that need Redis. Import them into a conftest (or a test module):

    from tests.support.redis_fixtures import redis_prefix, redis_server  # noqa: F401

One server serves the whole session; tests stay independent by writing under their own `redis_prefix`.
A test that stops or restarts Redis should start its own `RedisServer` rather than disturb the shared one.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.support.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix no other test uses."""
    return f"test-{uuid.uuid4().hex[:12]}:"
