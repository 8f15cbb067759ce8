"""Every 503 the gateway answers says when to try again: each error class with status 503 carries Retry-After."""

from __future__ import annotations

import policies.errors as errors


def subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from subclasses(sub)


def test_every_503_error_carries_a_retry_after():
    unavailable = [cls for cls in subclasses(errors.GatewayError) if cls.status == 503]
    assert {c.__name__ for c in unavailable} >= {"NoBackendAvailable", "OverBudget", "StateUnavailable"}
    for cls in unavailable:
        seconds = cls("try again shortly").headers.get("retry-after")
        assert seconds is not None and int(seconds) >= 1, cls.__name__
    # a caller's own headers are kept, and its own Retry-After wins
    assert errors.NoBackendAvailable("x", headers={"retry-after": "7"}).headers == {"retry-after": "7"}
