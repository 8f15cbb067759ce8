"""The three Redis set-ups behind `redis_server` (tests/support/redis_fixtures), each started once per session."""

from tests.support.redis_fixtures import redis_cluster, redis_sentinel, redis_standalone  # noqa: F401
