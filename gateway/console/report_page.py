"""Own or rent: the report's figures per model over a chosen window, and its charts, drawn in the browser
(static/console.js with uPlot) from /console/report.json, the same JSON as GET /admin/report.

A LoRA adapter runs on its base model's replicas: it has no replicas (nor cost) of its own, so its card is priced
as its base, whose verdict it shares, and shows the adapter's own calls and tokens beside; its base's charts
(whose utilisation its calls are part of) stand for it.

A team admin sees its own team's calls only (as GET /admin/report?team= answers it): the requests, tokens and
rented cost of its team's keys, per model and per key; the replicas' utilisation and owned cost stay the fleet's,
as the API's say. The page opens with a summary of the window's headline figures."""

from __future__ import annotations

from typing import Any, Protocol

from litestar import get
from litestar.handlers import HTTPRouteHandler
from litestar.params import Parameter
from litestar.response import Template

from backends.lora import LoraAdapters
from gateway.http.asgi import AnyRequest
from gateway.console.pages import Page
from gateway.console.render import page
from gateway.console.windows import WINDOWS, window_of
from gateway.needs import Configured
from gateway.admin.report import Report, Reports

TEAM = {"team": True}  # a team admin may open it: its own team's calls only


class ReportConsole(Configured, Reports, Protocol):
    """The report page: the report, the policy's models and their LoRA adapters (with those the replicas hold
    now), and the console's refresh."""

    loras: LoraAdapters


def handlers(gateway: ReportConsole) -> list[HTTPRouteHandler]:
    @get("/report", opt=TEAM)
    async def report(request: AnyRequest, window: int | None = Parameter(default=None, ge=1, le=90 * 86400)) -> Template:
        window = window_of(window)
        team = request.state.viewer.team
        figures = Report.model_validate(await gateway.report(window, team=team))
        return page(request, "report.html", "Own or rent", window=window, windows=WINDOWS, report=figures,
                    adapters=adapters_of(gateway, figures), team=team, summary=summary_of(figures),
                    refresh=max(5.0, gateway.policy.console.refresh_seconds * 5))

    @get("/report.json", opt=TEAM)
    async def report_json(request: AnyRequest,
                          window: int | None = Parameter(default=None, ge=1, le=90 * 86400)) -> Report:
        return Report.model_validate(await gateway.report(window_of(window), team=request.state.viewer.team))

    return [report, report_json]


def summary_of(figures: Report) -> dict[str, Any]:
    """The window's headline figures: calls and tokens of the keys counted (a team admin's: its team's keys'),
    their rented cost, and how many models the report advises to own, rent or keep as they are."""
    keys = figures.keys.values()
    verdicts: dict[str, int] = {}
    for m in figures.models.values():
        verdicts[m.recommendation.verdict] = verdicts.get(m.recommendation.verdict, 0) + 1
    return {"requests": sum(k.requests for k in keys), "tokens": sum(k.tokens for k in keys),
            "rented_requests": sum(k.rented_requests for k in keys), "rented_cost": sum(k.rented_cost for k in keys),
            "owned_cost": sum(m.owned_cost or 0.0 for m in figures.models.values()), "models": len(figures.models),
            "verdicts": [(f"Advised: {v}", n) for v, n in sorted(verdicts.items())]}


def adapters_of(gateway: ReportConsole, figures: Report) -> dict[str, str | None]:
    """The report's LoRA adapters, each with its base model (None: an adapter the ledger names that no replica
    holds now, whose base is no longer known)."""
    models = gateway.policy.models
    out: dict[str, str | None] = {}
    for model in models:
        if model.lora is None:
            continue
        out.update((a.name, model.name) for a in model.lora.adapters)
        if model.lora.discover:
            out.update((name, model.name) for name in gateway.loras.found(model.name))
    names = {m.name for m in models}
    return {name: out.get(name) for name in figures.models if name not in names}


PAGE = Page("report", "Own or rent", handlers, team=True)
