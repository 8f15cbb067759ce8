"""Pipeline step: admit a request under its key's, its team's and its model's limits, and settle up when it ends.

Admission is one call to the limiter (one Redis round trip when shared); the release (slot back, token
reservation settled against the real usage) runs off the request path. While the shared store is down (an
outage, or a failover until the new primary answers), each limit kind follows its `on_store_failure` mode:
fail_closed answers 503 with Retry-After, fail_open admits and counts in this process alone. Each admission
the store could not record is counted (llm_gateway_store_unavailable) and logged (at most a line a second).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from policies.background import Background
from policies.config import Policy
from policies.errors import RateLimited, StateUnavailable
from policies.ids import unique_id
from policies.keys import KeyLimits
from policies.metrics import GatewayMetrics
from policies.pipeline import Call, Slot
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
from policies.see_through import see_through
from policies.tokens import used_tokens
from policies.store import StoreUnavailable

log = logging.getLogger("gateway.ratelimit")

RELEASE_RETRY_SECONDS = 30.0  # a failover is over well within this; an outage longer leaves it to the lease
WHAT = {REQUESTS: "requests per minute", TOKENS: "tokens per minute", CONCURRENCY: "concurrent requests"}


TICKET: Slot[Ticket] = Slot("rate-limit ticket")  # what the limiter took for the call, to give back as it leaves


class RateLimit:
    name = "rate-limit"
    writes = (TICKET,)

    def __init__(self, policy: Policy, limiter: Limiter, background: Background, metrics: GatewayMetrics) -> None:
        self.config = policy.rate_limits
        self.limiter = limiter
        self.local = limiter if isinstance(limiter, MemoryLimiter) else MemoryLimiter()
        self.background = background
        self.metrics = metrics
        self.model_scopes = {
            m.name: Scope(f"model:{m.name}", **m.limits.model_dump()) for m in policy.models if m.limits
        }
        self.model_scopes.update({  # a LoRA adapter is a model: its own totals (its base's are not shared)
            a.name: Scope(f"model:{a.name}", **a.limits.model_dump())
            for m in policy.models if m.lora for a in m.lora.adapters if a.limits
        })
        self.outage_logged_at = -1.0
        self.outage_unlogged = 0
        self.scope_cache: dict[tuple[str, str], tuple[object, object, tuple[Scope, ...]]] = {}

    def scopes(self, call: Call) -> tuple[Scope, ...]:
        """The limits this call counts against; remembered per (key record, model) while the record is the same
        object (the auth cache hands out one record per key until it refreshes it)."""
        key, team = call.key, call.team
        assert key is not None  # the key step ran first (a batch's line comes with its key)
        cached = self.scope_cache.get((key.id, call.model))
        if cached is not None and cached[0] is key and cached[1] is team:
            return cached[2]
        scopes = self.build_scopes(call)
        if len(self.scope_cache) >= 10_000:
            self.scope_cache.clear()
        self.scope_cache[(key.id, call.model)] = (key, team, scopes)
        return scopes

    def build_scopes(self, call: Call) -> tuple[Scope, ...]:
        """The key's limits, its team's (every key of the team counts against them together) and the model's."""
        key = call.key
        assert key is not None  # the key step ran first (a batch's line comes with its key)
        limits = key.limits
        scopes = [Scope(f"key:{key.id}", limits.requests_per_minute, limits.tokens_per_minute,
                        limits.max_concurrent)]
        if call.team is not None:
            team = call.team.limits
            scopes.append(Scope(call.team.id, team.requests_per_minute, team.tokens_per_minute, team.max_concurrent))
        if call.model in self.model_scopes:
            scopes.append(self.model_scopes[call.model])
        return tuple(s for s in scopes if s.limited)

    async def enter(self, call: Call) -> None:
        scopes = self.scopes(call)
        if not scopes:
            return
        estimate = call.tokens
        prompt = estimate.prompt(call.body)
        cost = prompt + estimate.output(call.body, self.config.default_max_tokens)
        member = f"{call.request.id}:{unique_id()}"
        limiter = self.limiter
        try:
            asked = limiter.acquire(scopes, cost, member, self.config.lease_seconds)
            decision = await (asked if limiter is self.local else see_through(
                asked, lambda got: got.allowed and self.background(
                    self.release(Ticket(scopes, member, cost, limiter=limiter), 0))))
        except StoreUnavailable:
            limiter = self.local
            decision = await self.outage(scopes, cost, member)
        assert call.key is not None  # as scopes() found
        call.response_headers.update(headers(call.key.limits, decision))
        if not decision.allowed:
            self.refuse(call, decision)
        TICKET.put(call, Ticket(scopes, member, cost, prompt, limiter=limiter))

    async def outage(self, scopes: tuple[Scope, ...], cost: int, member: str) -> Decision:
        modes = self.config.on_store_failure
        kinds = {k for s in scopes for k, v in ((REQUESTS, s.requests_per_minute), (TOKENS, s.tokens_per_minute),
                                                  (CONCURRENCY, s.max_concurrent)) if v}
        closed = any(getattr(modes, kind) == "fail_closed" for kind in kinds)
        self.metrics.store_unavailable.labels("rate_limit", "fail_closed" if closed else "fail_open").inc()
        self.note_outage(closed)
        if closed:
            raise StateUnavailable("the rate-limit store is unavailable; try again shortly")
        return await self.local.acquire(scopes, cost, member, self.config.lease_seconds)

    def note_outage(self, closed: bool) -> None:
        """A log line for each admission the store could not record, at most one a second (with how many
        more there were), so an outage under load is visible without flooding the log."""
        self.outage_unlogged += 1
        now = time.monotonic()
        if now - self.outage_logged_at < 1.0:
            return
        what = "refused (fail_closed)" if closed else "served, counted in this process only (fail_open)"
        log.warning("rate-limit store unavailable: %d admission(s) not recorded in it, %s",
                    self.outage_unlogged, what)
        self.outage_logged_at, self.outage_unlogged = now, 0

    def refuse(self, call: Call, decision: Decision) -> None:
        scope_type, _, name = decision.scope.partition(":")
        where = {"key": "this API key", "team": f"this API key's team {name}"}.get(scope_type, f"model {name}")
        wait = max(decision.retry_after, 0.001)
        self.metrics.rate_limited.labels(call.model, scope_type, decision.kind).inc()
        raise RateLimited(
            f"Rate limit reached for {WHAT[decision.kind]} on {where}. Try again in {format_reset(wait)}.",
            code="rate_limit_exceeded",
            param=decision.kind,
            headers={"retry-after": str(max(1, math.ceil(wait))), "retry-after-ms": str(math.ceil(wait * 1000))},
        )

    async def leave(self, call: Call) -> None:
        ticket = TICKET.get(call)
        if ticket is None or ticket.released:
            return
        ticket.released = True
        usage = call.usage if isinstance(call.usage, dict) else {}
        used = sum(used_tokens(usage))  # never below 0: a backend cannot give a token limit back
        if not usage:  # ended early: what was sent so far is the best measure we have
            used = ticket.prompt + call.streamed_events
        if ticket.limiter is self.local:
            await self.local.release(ticket, used)
        else:
            self.background(self.release(ticket, used))

    async def release(self, ticket: Ticket, used: int) -> None:
        """Off the request path; while the store is away (a failover takes seconds) try again for a while, so
        a slot comes back when the new primary answers rather than when its lease expires."""
        deadline = time.monotonic() + RELEASE_RETRY_SECONDS
        while True:
            try:
                assert ticket.limiter is not None  # a ticket made by enter() names its limiter
                await ticket.limiter.release(ticket, used)
                return
            except StoreUnavailable:
                if time.monotonic() >= deadline:
                    log.warning("could not release a rate-limit slot while the store is down; its lease will expire")
                    return
                await asyncio.sleep(0.5)


def headers(limits: KeyLimits, decision: Decision) -> dict[str, str]:
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
