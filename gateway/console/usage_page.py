"""Usage per key and per model over a window, from the own-or-rent report's figures (gateway.report, as
GET /admin/report); a key's usage per model since it was issued is on its own page (keys_page). A team admin
sees its team's keys' calls only, and its team's budget this period (as GET /admin/teams/{name}/usage and
/budget). The page opens with a summary: the window's totals over every key counted."""

from __future__ import annotations

from typing import Any, Protocol

from litestar import get
from litestar.handlers import HTTPRouteHandler
from litestar.params import Parameter
from litestar.response import Template

from gateway.http.asgi import AnyRequest
from gateway.console.pages import Page
from gateway.console.render import page
from gateway.console.windows import WINDOWS, window_of
from gateway.admin.report import KeyBudgets, Reports, budget_status

TOP = 100  # keys shown, by tokens


class UsageConsole(Reports, KeyBudgets, Protocol):
    """The usage page: the report's figures per key, the keys' names, and a team's budget."""


def handlers(gateway: UsageConsole) -> list[HTTPRouteHandler]:
    @get("/usage", opt={"team": True})
    async def usage(request: AnyRequest, window: int | None = Parameter(default=None, ge=1, le=90 * 86400)) -> Template:
        window = window_of(window)
        team = request.state.viewer.team
        report = await gateway.report(window, team=team)
        budget = None
        if team is not None:
            found = await gateway.store.get_team(team)
            budget = await budget_status(gateway, found.id, team, found.budget) if found is not None else None
        ranked = sorted(report["keys"].items(), key=lambda kv: (-kv[1]["tokens"], kv[0]))[:TOP]
        names = {}
        for key_id, _ in ranked:
            record = await gateway.store.get_key(key_id)
            names[key_id] = record.name if record is not None else None
        return page(request, "usage.html", "Usage", window=window, windows=WINDOWS, keys=ranked, names=names,
                    models=report["models"], more=max(0, len(report["keys"]) - TOP), team=team, budget=budget,
                    summary=summary_of(report["keys"]))

    return [usage]


def summary_of(keys: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The window's totals over the keys counted: calls, tokens, rented calls and cost, keys that called."""
    return {"keys": len(keys), "requests": sum(k["requests"] for k in keys.values()),
            "tokens": sum(k["tokens"] for k in keys.values()),
            "rented_requests": sum(k["rented_requests"] for k in keys.values()),
            "rented_cost": sum(k["rented_cost"] for k in keys.values())}


PAGE = Page("usage", "Usage", handlers, team=True)
