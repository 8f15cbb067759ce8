"""Fallback chains: a call that its model's own replicas could not serve goes to the next model of the model's
`fallbacks` (policies/config/fallbacks.py), then to rented providers, in order (issue "failures the client never
sees", item 2; design.md's ninth shape, for fallback models and rented providers).

The proxy calls `Fallbacks.after` from one place, when `forward` failed: every replica down or unreachable (a
503), the attempts failed past their retries (a 5xx or a 504), or the model was full past its queue bound (a 429).
Each step is checked as the first was: the key (and its team) must be allowed the step's model, and a rented step
is reached only by a key whose data policy allows renting (asked of the store at that moment, as every rent is),
whose rented budget can be reserved, on a route a rented API has. A step refused stops the chain there: the client
gets the original error, so a `private_only` key's prompt never leaves for a later step either. Rate limits and
budgets were reserved once, when the call entered, and are settled on what served (its usage, its cost).

A step that serves renames the call to the model that served: the answer's `model` field, the ledger's and the
usage record's model, the metrics and the trace all name it, and the answer carries `x-gateway-served-model` and
`x-gateway-fallback-from`. A pinned call (a stored Responses id) and a streamed upload have nowhere else to go.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from backends.http1 import Client, Response
from backends.rented import RentedProviders
from backends.replicas import UP, Replica
from backends.upstream import Upstream
from gateway.endpoints.base import ROUTE
from gateway.http.form_upload import UPLOAD
from policies.budget import BEFORE_RENT
from policies.config import Model, Provider, RentedStep
from policies.errors import (
    GatewayError,
    NoBackendAvailable,
    NotRentable,
    OverBudget,
    RateLimited,
    UpstreamFailed,
    UpstreamStatus,
    UpstreamTimeout,
)
from policies.metrics import GatewayMetrics
from policies.pipeline import Call
from policies.variants import SHADOW

SERVED_MODEL = "x-gateway-served-model"  # on an answer a fallback served: the public model that served it
FALLBACK_FROM = "x-gateway-fallback-from"  # ... and the model whose replicas could not
UNAVAILABLE, FAILED, FULL = "unavailable", "failed", "full"


class Proxy(Protocol):
    """What a chain uses of the proxy (gateway/proxy.py)."""

    async def forward_model(self, call: Call, rent: bool = True) -> Response: ...
    async def rent(self, call: Call, since: float, target: Replica | None = None) -> Response: ...
    async def read_whole(self, call: Call, response: Response) -> object: ...
    def release(self, call: Call) -> None: ...


@dataclass(frozen=True, slots=True)
class Step:
    model: str  # the public model the step serves (an owned model, or the one the rented provider maps)
    target: Replica | None  # the rented provider's pseudo-replica; None: the owned model's replicas
    label: str  # the metric's `to`: the model, or rented:<provider>


def reason_of(error: GatewayError) -> str | None:
    """Why a failure of `forward` may go down the chain (the metric's reason), or None: it is the client's own
    (a bad request, a key's rate limit) and goes to the client."""
    if isinstance(error, NoBackendAvailable):
        return UNAVAILABLE
    if isinstance(error, RateLimited):
        return FULL if error.code == "model_at_capacity" else None
    if isinstance(error, UpstreamStatus):
        return FULL if error.status == 429 else FAILED if error.status >= 500 else None
    if isinstance(error, (UpstreamFailed, UpstreamTimeout)):
        return FAILED
    return None


class Fallbacks:
    """The chains of one policy snapshot, their rented steps' targets connected through the gateway's client."""

    def __init__(self, models: Iterable[Model], providers: Iterable[Provider], rented: RentedProviders,
                 metrics: GatewayMetrics, client: Client | None) -> None:
        self.metrics = metrics
        by_name = {p.name: p for p in providers}
        self.chains: dict[str, tuple[Step, ...]] = {}
        for model in models:
            steps = []
            for step in model.fallbacks:
                if isinstance(step, RentedStep):
                    serves = step.model or model.name
                    target = self.rented_target(rented, by_name[step.provider], serves, client)
                    if target is None:
                        continue  # its key is not set: RentedProviders logged it, and the step is skipped
                    steps.append(Step(serves, target, f"rented:{step.provider}"))
                else:
                    steps.append(Step(step, None, step))
            if steps:
                self.chains[model.name] = tuple(steps)

    @staticmethod
    def rented_target(rented: RentedProviders, provider: Provider, model: str, client: Client | None) -> Replica | None:
        """The provider's pseudo-replica for `model`: the overflow's own when it is the same, else one of its own
        carrying the provider's key (None when the key is not set)."""
        known = rented.targets.get(model)
        if known is not None and known.rented == provider.name:
            return known
        key = rented.keys.get(provider.name)
        if key is None:
            return None
        target = Replica(name=f"rented:{provider.name}", model=model, url=provider.base_url,
                         served_name=provider.models[model], rented=provider.name, state=UP)
        if client is not None:
            target.upstream = Upstream(client, target.url, timeout=rented.timeouts[provider.name],
                                       headers={"authorization": f"Bearer {key}"})
        return target

    async def after(self, proxy: Proxy, call: Call, failure: GatewayError | Response) -> Response:
        """Serve `call` from its model's chain after `forward` failed with `failure` (an error, or an answer whose
        status is a 5xx or 429); raises the original error when no step may or can serve it."""
        if isinstance(failure, Response):
            try:
                await proxy.read_whole(call, failure)  # the error its answer would have been: raises
            except GatewayError as exc:
                failure = exc
            else:  # not reached: read_whole raises for every status the proxy passes here
                raise UpstreamFailed(f"the backend for model {call.model} failed")
        original = failure
        reason = reason_of(original)
        chain = self.chains.get(call.model)
        if reason is None or chain is None or call.pinned is not None or UPLOAD.get(call) is not None:
            raise original
        asked, fallback, group, adapter, variant = call.model, call.fallback_model, call.group, call.adapter, call.variant
        for step in chain:  # bounded: a chain has at most 16 steps, each tried once
            if not self.may_take(call, step) or (step.target is not None and not await self.may_rent(proxy, call)):
                break
            proxy.release(call)  # whatever the failed attempt held
            self.metrics.fallbacks.labels(asked, step.label, reason).inc()
            call.fallback_model, call.group, call.adapter, call.variant = step.model, "", None, None
            SHADOW.take(call)
            call.response_headers[SERVED_MODEL], call.response_headers[FALLBACK_FROM] = step.model, asked
            try:
                if step.target is None:
                    response = await proxy.forward_model(call, rent=False)
                else:
                    response = await proxy.rent(call, time.perf_counter(), step.target)
                if response.status >= 500 or response.status == 429:
                    await proxy.read_whole(call, response)  # raises the error it is
            except (NotRentable, OverBudget):
                break  # the key may not rent (any more), or its rented budget is spent: the chain stops here
            except GatewayError as exc:
                next_reason = reason_of(exc)
                if next_reason is None:
                    break
                reason = next_reason
                continue
            return response
        proxy.release(call)
        call.fallback_model, call.group, call.adapter, call.variant = fallback, group, adapter, variant
        call.response_headers.pop(SERVED_MODEL, None)
        call.response_headers.pop(FALLBACK_FROM, None)
        raise original

    @staticmethod
    def may_take(call: Call, step: Step) -> bool:
        """Is the call's key (and its team) allowed the step's model, as Authorize asks of the first?"""
        key, team = call.key, call.team
        if key is None:
            return False
        if key.models is not None and step.model not in key.models:
            return False
        return team is None or team.models is None or step.model in team.models

    @staticmethod
    async def may_rent(proxy: Proxy, call: Call) -> bool:
        """May the call reach a rented provider: its key's data policy (and its team's) allows it, the route is
        one a rented API has, and a rented budget, if the key or team has one, can be reserved for it (the budget
        step offers that only for a model with an overflow, once per call). The store's current record is asked by
        `rent`."""
        key, team = call.key, call.team
        if key is None or key.data_policy != "allow_rented" or not call.rent_allowed or not ROUTE.of(call).rentable:
            return False
        if team is not None and team.data_policy == "private_only":
            return False
        budgeted = any(b is not None and b.max_rented_spend is not None
                       for b in (key.budget, team.budget if team is not None else None))
        if not budgeted:
            return True
        # reserved once per call: not when the budget step offers none, nor again after the model's own overflow
        # rented (and failed)
        return BEFORE_RENT.get(call) is not None and not (call.replica is not None and call.replica.rented)
