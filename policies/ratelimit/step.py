"""Pipeline step: admit a request under its key's and its model's limits, and settle up when it ends.

Admission is one call to the limiter (one Redis round trip when shared); the release (slot back, token
reservation settled against the real usage) runs off the request path. While the shared store is down, each
limit kind follows its `on_store_failure` mode: fail_closed answers 503, fail_open admits and counts in this
process alone (logged once per outage).
"""

from __future__ import annotations

import logging
import math

from policies.config import Policy
from policies.errors import RateLimited, StateUnavailable
from policies.ids import unique_id
from policies.pipeline import Call
from policies.ratelimit.base import (
    CONCURRENCY,
    REQUESTS,
    TOKENS,
    Decision,
    Limiter,
    Scope,
    Ticket,
    format_reset,
)
from policies.ratelimit.memory import MemoryLimiter
from policies.store import StoreUnavailable

log = logging.getLogger("gateway.ratelimit")

WHAT = {REQUESTS: "requests per minute", TOKENS: "tokens per minute", CONCURRENCY: "concurrent requests"}


class RateLimit:
    name = "rate-limit"

    def __init__(self, policy: Policy, limiter: Limiter, background, metrics) -> None:
        self.config = policy.rate_limits
        self.limiter = limiter
        self.local = limiter if isinstance(limiter, MemoryLimiter) else MemoryLimiter()
        self.background = background
        self.metrics = metrics
        self.model_scopes = {
            m.name: Scope(f"model:{m.name}", **m.limits.model_dump()) for m in policy.models if m.limits
        }
        self.outage_logged = False
        self.scope_cache: dict[tuple[str, str], tuple[object, tuple[Scope, ...]]] = {}

    def scopes(self, call: Call) -> tuple[Scope, ...]:
        """The limits this call counts against; remembered per (key record, model) while the record is the same
        object (the auth cache hands out one record per key until it refreshes it)."""
        key = call.key
        cached = self.scope_cache.get((key.id, call.model))
        if cached is not None and cached[0] is key:
            return cached[1]
        scopes = self.build_scopes(call)
        if len(self.scope_cache) >= 10_000:
            self.scope_cache.clear()
        self.scope_cache[(key.id, call.model)] = (key, scopes)
        return scopes

    def build_scopes(self, call: Call) -> tuple[Scope, ...]:
        limits = call.key.limits
        scopes = [Scope(f"key:{call.key.id}", limits.requests_per_minute, limits.tokens_per_minute,
                        limits.max_concurrent)]
        if call.model in self.model_scopes:
            scopes.append(self.model_scopes[call.model])
        return tuple(s for s in scopes if s.limited)

    async def enter(self, call: Call) -> None:
        scopes = self.scopes(call)
        if not scopes:
            return
        estimate = call.tokens
        call.prompt_estimate = estimate.prompt(call.body)
        cost = call.prompt_estimate + estimate.output(call.body, self.config.default_max_tokens)
        member = f"{call.request_id}:{unique_id()}"
        limiter = self.limiter
        try:
            decision = await limiter.acquire(scopes, cost, member, self.config.lease_seconds)
        except StoreUnavailable:
            limiter = self.local
            decision = await self.outage(scopes, cost, member)
        else:
            self.outage_logged = False
        call.response_headers.update(headers(call.key.limits, decision))
        if not decision.allowed:
            self.refuse(call, decision)
        call.ticket = Ticket(scopes, member, cost, limiter=limiter)

    async def outage(self, scopes: tuple[Scope, ...], cost: int, member: str) -> Decision:
        modes = self.config.on_store_failure
        kinds = {k for s in scopes for k, v in ((REQUESTS, s.requests_per_minute), (TOKENS, s.tokens_per_minute),
                                                  (CONCURRENCY, s.max_concurrent)) if v}
        if any(getattr(modes, kind) == "fail_closed" for kind in kinds):
            raise StateUnavailable("the rate-limit store is unavailable; try again shortly")
        if not self.outage_logged:
            self.outage_logged = True
            log.warning("rate-limit store unavailable: limits fail open, counted in this process only")
        return await self.local.acquire(scopes, cost, member, self.config.lease_seconds)

    def refuse(self, call: Call, decision: Decision) -> None:
        scope_type, _, name = decision.scope.partition(":")
        where = "this API key" if scope_type == "key" else f"model {name}"
        wait = max(decision.retry_after, 0.001)
        self.metrics.rate_limited.labels(call.model, scope_type, decision.kind).inc()
        raise RateLimited(
            f"Rate limit reached for {WHAT[decision.kind]} on {where}. Try again in {format_reset(wait)}.",
            code="rate_limit_exceeded",
            param=decision.kind,
            headers={"retry-after": str(max(1, math.ceil(wait))), "retry-after-ms": str(math.ceil(wait * 1000))},
        )

    async def leave(self, call: Call) -> None:
        ticket: Ticket | None = call.ticket
        if ticket is None or ticket.released:
            return
        ticket.released = True
        usage = call.usage if isinstance(call.usage, dict) else {}
        used = (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0)
        if not usage:  # ended early: what was sent so far is the best measure we have
            used = call.prompt_estimate + call.streamed_events
        if ticket.limiter is self.local:
            await self.local.release(ticket, used)
        else:
            self.background(self.release(ticket, used))

    async def release(self, ticket: Ticket, used: int) -> None:
        try:
            await ticket.limiter.release(ticket, used)
        except StoreUnavailable:
            log.warning("could not release a rate-limit slot while the store is down; its lease will expire")


def headers(limits, decision: Decision) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the key's own limits."""
    out: dict[str, str] = {}
    if limits.requests_per_minute and decision.remaining_requests is not None:
        out["x-ratelimit-limit-requests"] = str(limits.requests_per_minute)
        out["x-ratelimit-remaining-requests"] = str(max(0, decision.remaining_requests))
        out["x-ratelimit-reset-requests"] = format_reset(decision.reset_requests)
    if limits.tokens_per_minute and decision.remaining_tokens is not None:
        out["x-ratelimit-limit-tokens"] = str(limits.tokens_per_minute)
        out["x-ratelimit-remaining-tokens"] = str(decision.remaining_tokens)
        out["x-ratelimit-reset-tokens"] = format_reset(decision.reset_tokens)
    return out
