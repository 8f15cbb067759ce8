"""Rate limits kept in this process: the embedded default, and the local fallback when Redis is away."""

from __future__ import annotations

import time
from collections.abc import Callable

from policies.ratelimit.base import (
    CONCURRENCY,
    CONCURRENCY_RETRY,
    REQUESTS,
    TOKENS,
    Bucket,
    Decision,
    Scope,
    Ticket,
)


Plan = tuple[Scope, Bucket | None, Bucket | None]  # a scope and its requests and tokens buckets (if limited)


class MemoryLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.buckets: dict[tuple[str, str], tuple[float, float]] = {}  # (scope, kind) -> (level, at)
        self.leases: dict[str, dict[str, float]] = {}  # scope -> member -> expiry

    def _bucket(self, scope: str, kind: str, per_minute: int, now: float) -> Bucket:
        level, at = self.buckets.get((scope, kind), (None, None))
        return Bucket(per_minute, level, at, now)

    def _live(self, scope: str, now: float) -> dict[str, float]:
        leases = self.leases.setdefault(scope, {})
        for member in [m for m, expiry in leases.items() if expiry <= now]:
            del leases[member]
        return leases

    async def acquire(self, scopes: tuple[Scope, ...], cost: int, member: str, lease: float) -> Decision:
        now = self.clock()
        plans: list[Plan] = []
        for scope in scopes:
            requests = self._bucket(scope.name, REQUESTS, scope.requests_per_minute, now) \
                if scope.requests_per_minute else None
            tokens = self._bucket(scope.name, TOKENS, scope.tokens_per_minute, now) if scope.tokens_per_minute else None
            plans.append((scope, requests, tokens))
        refusal = self._refusal(plans, cost, now)
        if refusal is not None:
            return self._report(refusal, plans[0])
        for scope, requests, tokens in plans:
            if requests is not None:
                requests.level -= 1
                self.buckets[(scope.name, REQUESTS)] = (requests.level, now)
            if tokens is not None:
                tokens.level -= cost
                self.buckets[(scope.name, TOKENS)] = (tokens.level, now)
            if scope.max_concurrent:
                self.leases.setdefault(scope.name, {})[member] = now + lease
        return self._report(Decision(True), plans[0])

    def _refusal(self, plans: list[Plan], cost: int, now: float) -> Decision | None:
        for scope, requests, tokens in plans:
            if requests is not None and requests.level < 1:
                return Decision(False, scope.name, REQUESTS, requests.wait_for(1))
            if tokens is not None and tokens.wait_for(cost) > 0:
                return Decision(False, scope.name, TOKENS, tokens.wait_for(cost))
            if scope.max_concurrent and len(self.leases.get(scope.name, ())) >= scope.max_concurrent \
                    and len(self._live(scope.name, now)) >= scope.max_concurrent:  # expired leases swept only here
                return Decision(False, scope.name, CONCURRENCY, CONCURRENCY_RETRY)
        return None

    @staticmethod
    def _report(decision: Decision, first: Plan) -> Decision:
        """The first scope's (the key's) levels, for the x-ratelimit-* headers, admitted or not."""
        _, requests, tokens = first
        if requests is not None:
            decision.remaining_requests, decision.reset_requests = int(requests.level), requests.reset()
        if tokens is not None:
            decision.remaining_tokens, decision.reset_tokens = max(0, int(tokens.level)), tokens.reset()
        return decision

    async def release(self, ticket: Ticket, used: int) -> None:
        now = self.clock()
        refund = ticket.reserved - used
        for scope in ticket.scopes:
            if scope.tokens_per_minute and refund:
                bucket = self._bucket(scope.name, TOKENS, scope.tokens_per_minute, now)
                self.buckets[(scope.name, TOKENS)] = (min(bucket.capacity, bucket.level + refund), now)
            if scope.max_concurrent:
                self.leases.get(scope.name, {}).pop(ticket.member, None)

    async def slots(self, scope: str) -> int:
        return len(self._live(scope, self.clock()))

    async def close(self) -> None:
        """Nothing waits to be sent: every release is applied as it comes."""
