"""GET /admin/report: the own-vs-rent report for a window (viewer role), and GET /admin/keys/{id}/budget.

The answer's shape is declared here so the OpenAPI document describes it; the figures are computed in
policies/ledger/report.py, whose docstring says what each one means.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from litestar import get
from litestar.handlers import HTTPRouteHandler
from litestar.params import Parameter
from pydantic import BaseModel, ConfigDict, Field

from gateway.admin.scope import check_team, own_team
from gateway.http.asgi import AnyConnection, AnyRequest
from gateway.needs import Stored
from gateway.openapi import errors
from policies.budget import Budgets, period_bounds
from policies.errors import BadRequest, NotFound, PermissionDenied
from policies.keys import TEAM_NAME, KeyBudget, KeyRecord


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BackendFigures(Closed):
    name: str
    cost_per_hour: float | None
    cap: int | None
    utilisation: float
    average_in_flight: float
    in_flight_vs_cap: float | None


class OwnedFigures(Closed):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    queue_seconds: float


class RentedFigures(Closed):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost: float
    estimated_requests: int = Field(description="rented calls whose provider sent no usage, charged the gateway's"
                                    " estimate of their tokens (never zero); their cost is part of `cost`")
    provider: str | None


class Recommendation(Closed):
    verdict: str
    reason: str


class Point(Closed):
    t: int
    seconds: float
    requests: int
    utilisation: float
    owned_cost: float
    rented_cost: float
    rent_all_cost: float | None


class ModelFigures(Closed):
    utilisation: float
    batch_fill: float | None
    backends: list[BackendFigures]
    owned: OwnedFigures
    batch: OwnedFigures = Field(description="the part of `owned` that Batch API lines used (their own class)")
    rented: RentedFigures
    owned_cost: float | None
    owned_cost_per_million_tokens: float | None
    owned_tokens_at_rented_price: float | None
    rented_price_per_million_tokens: float | None
    rent_all_cost: float | None
    actual_cost: float | None
    own_all_cost: float | None
    break_even_utilisation: float | None
    burstiness: float | None
    peak_requests_per_minute: float
    recommendation: Recommendation
    series: list[Point]


class KeyFigures(Closed):
    requests: int
    tokens: int
    rented_requests: int
    rented_cost: float
    batch_requests: int = Field(description="the part of `requests` that were Batch API lines")


class Report(Closed):
    since: float
    until: float
    window_seconds: float
    bucket_seconds: int
    models: dict[str, ModelFigures]
    keys: dict[str, KeyFigures]
    teams: dict[str, KeyFigures] = Field(description="each team's calls, its keys' summed")


class BudgetStatus(Closed):
    id: str
    period: str
    period_start: int
    resets_at: int
    rented_spend: float
    max_rented_spend: float | None
    tokens: int | None = Field(description="tokens counted against max_tokens_per_period this period; null when"
                               " the key has no token budget (then its calls' tokens are not counted here)")
    max_tokens_per_period: int | None
    when_spent: str


class Budgeted(Protocol):
    """What keys and teams have spent of their budgets (policies/budget.py)."""

    budgets: Budgets


class Reports(Protocol):
    """The own-vs-rent report (policies/ledger/report.py): its figures for a window, as `Report` declares them."""

    async def report(self, window: float, until: float | None = None, team: str | None = None,
                     teams: bool = False) -> dict[str, Any]: ...


class Reporting(Reports, Budgeted, Protocol):
    """GET /admin/report and /admin/keys/{id}/budget: the report, and what keys have spent of their budgets."""


class KeyBudgets(Stored, Budgeted, Protocol):
    """A key's budget (its record in the store) and what it has spent of it."""


async def budget_status(gateway: Budgeted, owner: str, shown: str, budget: KeyBudget | None) -> BudgetStatus:
    """What `owner` (a key id, or a team's `team:<name>`) has spent of `budget` (a KeyBudget or None) this period."""
    period = budget.period if budget else "month"
    start, end = period_bounds(period, time.time())
    spent, used = await gateway.budgets.status(owner, start, end)
    return BudgetStatus(
        id=shown, period=period, period_start=start, resets_at=end, rented_spend=round(spent, 9),
        max_rented_spend=budget.max_rented_spend if budget else None,
        tokens=int(used) if budget and budget.max_tokens_per_period else None,
        max_tokens_per_period=budget.max_tokens_per_period if budget else None,
        when_spent=budget.when_spent if budget else "owned_only",
    )


def report_handlers(gateway: Reporting, key_id_param: Any,
                    load: Callable[[str, AnyConnection], Awaitable[KeyRecord]]) -> list[HTTPRouteHandler]:
    """`key_id_param`: the admin API's key id parameter; `load`: a key the admin on a connection may manage."""
    @get("/report", summary="Own or rent: utilisation, owned vs rented cost and a recommendation per model",
         description="With `team`, the calls counted are that team's keys' (a team admin may ask for its own"
         " team's); the backends' utilisation stays the whole fleet's.",
         opt={"team": True}, responses=errors(400, 401, 403, 503))
    async def report(
        request: AnyRequest,
        window: int = Parameter(default=3600, ge=1, le=90 * 86400, description="seconds before `until`"),
        until: int | None = Parameter(default=None, ge=1, le=10**11, description="unix seconds (default: now)"),
        team: str | None = Parameter(default=None, pattern=TEAM_NAME, description="only this team's calls"),
    ) -> Report:
        unknown = sorted(set(request.query_params) - {"window", "until", "team"})
        if unknown:
            raise BadRequest(f"unknown query parameter {unknown[0]!r:.40}: expected window, until and team",
                             param=unknown[0][:40])
        if own_team(request) is not None:
            if team is None:
                raise PermissionDenied("a team admin token reads its own team's report only: add ?team=",
                                       code="team_admin_scope")
            check_team(request, team)
        return Report.model_validate(await gateway.report(window, until, team, teams=True))

    @get("/keys/{key_id:str}/budget", summary="What a key has spent of its budget this period",
         opt={"team": True}, responses=errors(400, 401, 403, 404, 503))
    async def key_budget(request: AnyRequest, key_id: str = key_id_param) -> BudgetStatus:
        record = await load(key_id, request)  # `load` (admin_routes): 404, or 403 outside a team admin's team
        return await budget_status(gateway, key_id, key_id, record.budget)

    return [report, key_budget]



async def key_budget_status(gateway: KeyBudgets, key_id: str) -> BudgetStatus:
    """What a key has spent of its budget this period (the console's answer, as GET /admin/keys/{id}/budget's)."""
    record = await gateway.store.get_key(key_id)
    if record is None:
        raise NotFound(f"no API key with id {key_id}", code="key_not_found")
    return await budget_status(gateway, key_id, key_id, record.budget)
