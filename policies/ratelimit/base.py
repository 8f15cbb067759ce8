"""Rate limits: what is limited, the decision at admission, and the arithmetic both implementations share.

Each scope (one API key, or one model's total across keys) may limit requests per minute, tokens per minute
and requests in flight. Minute limits are token buckets: capacity = the per-minute limit, refilled
continuously at limit/60 per second, so a burst can use the whole minute's allowance at once and capacity
returns steadily; `Retry-After` is the exact time until the bucket holds enough again. Tokens are reserved
at admission (an estimate) and the difference to the real usage is settled when the response ends, so the
bucket may briefly go negative after an underestimate. Concurrency is a set of leases (request id -> expiry),
so a replica that dies cannot hold slots forever.

Admission is all-or-nothing across every scope of a request: either every bucket and slot is taken, or none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

REQUESTS, TOKENS, CONCURRENCY = "requests", "tokens", "concurrency"
CONCURRENCY_RETRY = 1.0  # seconds: a slot frees when some request ends, which nothing predicts


@dataclass(frozen=True, slots=True)
class Scope:
    name: str  # "key:<id>" or "model:<name>"
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    @property
    def limited(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent))


@dataclass(slots=True)
class Decision:
    allowed: bool
    scope: str = ""  # the scope that refused, when not allowed
    kind: str = ""  # REQUESTS, TOKENS or CONCURRENCY
    retry_after: float = 0.0
    # for the x-ratelimit-* headers, about the first scope (the key)
    remaining_requests: int | None = None
    reset_requests: float = 0.0
    remaining_tokens: int | None = None
    reset_tokens: float = 0.0


@dataclass(slots=True)
class Ticket:
    """What admission took, so the release gives back exactly that."""

    scopes: tuple[Scope, ...]
    member: str
    reserved: int
    prompt: int = 0  # the prompt's tokens as estimated: what an answer that ends early is counted at, with its events
    released: bool = False
    limiter: Limiter | None = field(default=None, repr=False)  # the one that took it


class Limiter(Protocol):
    async def acquire(self, scopes: tuple[Scope, ...], cost: int, member: str, lease: float) -> Decision:
        """Admit (taking a request, `cost` tokens and a slot in every scope) or refuse without taking anything."""

    async def release(self, ticket: Ticket, used: int) -> None:
        """Free the slot and settle the tokens: give back `reserved - used` (or take more if used more)."""

    async def slots(self, scope: str) -> int:
        """Requests in flight in a scope (for tests and metrics)."""

    async def close(self) -> None:
        """At shutdown: send what is still queued to the store (bounded), so no slot waits for its lease."""


class Bucket:
    """A token bucket's level after refilling to `now`; the same arithmetic as the Lua script."""

    __slots__ = ("capacity", "rate", "level", "at")

    def __init__(self, per_minute: int, level: float | None, at: float | None, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        if level is None or at is None:
            self.level = self.capacity
        else:
            self.level = min(self.capacity, level + max(0.0, now - at) * self.rate)
        self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` (capped at capacity) is available; 0 when it is now."""
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.rate

    def reset(self) -> float:
        return max(0.0, (self.capacity - self.level) / self.rate)


def format_reset(seconds: float) -> str:
    """OpenAI's style for x-ratelimit-reset-*: 20ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{int(math.ceil(rest))}s"
