"""Own or rent: the report's figures per model over a chosen window, and its charts, drawn in the browser
(static/console.js with uPlot) from /console/report.json, the same JSON as GET /admin/report."""

from __future__ import annotations

from litestar import Request, get
from litestar.params import Parameter
from litestar.response import Template

from gateway.console.pages import Page
from gateway.console.render import page
from gateway.console.windows import WINDOWS, window_of
from gateway.report_routes import Report


def handlers(gateway) -> list:
    @get("/report")
    async def report(request: Request, window: int | None = Parameter(default=None, ge=1, le=90 * 86400)) -> Template:
        window = window_of(window)
        figures = Report.model_validate(await gateway.report(window))
        return page(request, "report.html", "Own or rent", window=window, windows=WINDOWS, report=figures,
                    refresh=max(5.0, gateway.policy.console.refresh_seconds * 5))

    @get("/report.json")
    async def report_json(window: int | None = Parameter(default=None, ge=1, le=90 * 86400)) -> Report:
        return Report.model_validate(await gateway.report(window_of(window)))

    return [report, report_json]


PAGE = Page("report", "Own or rent", handlers)
