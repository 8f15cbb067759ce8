"""The admin console: HTML pages under /console, served by the gateway process itself (README, "The console").

Server-rendered Jinja templates with htmx for the parts that change (search, paging, forms, the live fleet) and
uPlot for the charts, both vendored under static/ (no CDN: it works air-gapped). Each page is a module with a
`PAGE` (its path, title and handlers) and one line in PAGES below; a new page is one more module.
The pages call the functions the admin API calls (gateway/admin/keys.py, report.py, variants.py,
live.py), so the console and the API cannot disagree. gateway/console/session.py says who may do what.
"""

from __future__ import annotations

from typing import Any, Protocol

from litestar import Router, get
from litestar.datastructures import CacheControlHeader
from litestar.exceptions import HTTPException
from litestar.response import Redirect
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig
from litestar.types import ExceptionHandlersMap, Message, Scope
from pydantic import ValidationError

from gateway.console import (
    audit_page,
    batches_page,
    fleet_page,
    keys_page,
    report_page,
    signin,
    sso,
    teams_page,
    usage_page,
    variants_page,
)
from gateway.console.audit_page import AuditLog
from gateway.console.batches_page import BatchConsole
from gateway.console.fleet_page import Fleet
from gateway.console.pages import Page
from gateway.console.render import NAV, STATIC, TEMPLATES, NavItem, on_error
from gateway.console.report_page import ReportConsole
from gateway.console.session import PREFIX, SECURITY_HEADERS, Guarded, Sessions, console_guard
from gateway.console.usage_page import UsageConsole
from gateway.admin.teams import Accounts
from gateway.admin.variants import Weighing
from policies.errors import GatewayError
from policies.store import StoreUnavailable

# Every failure of a page as HTML: each class the app maps to the API's JSON errors is named here, as Litestar
# picks the handler of the nearest class in the exception's MRO over the nearest layer.
ERRORS: ExceptionHandlersMap = {cls: on_error for cls in (GatewayError, StoreUnavailable, ValidationError, HTTPException, Exception)}


class Console(Guarded, Fleet, Accounts, UsageConsole, ReportConsole, Weighing, BatchConsole, AuditLog, Protocol):
    """What the console asks of the gateway: its sign-in's, and each page's (in the order of PAGES)."""


# The pages in the order of the navigation; the first is where signing in lands.
PAGES: tuple[Page[Console], ...] = (fleet_page.PAGE, keys_page.PAGE, teams_page.PAGE, usage_page.PAGE, report_page.PAGE, variants_page.PAGE, batches_page.PAGE,
         audit_page.PAGE)


def console_routes(gateway: Console) -> list[Router]:
    """The console's router and its static files; each answers 404 unless the policy's console is enabled."""
    NAV[:] = [NavItem(f"{PREFIX}/{p.path}", p.title, p.team) for p in PAGES]
    sessions = Sessions()  # this process's console sessions (gateway/console/session.py)
    guard = console_guard(gateway, sessions)

    @get("/", opt={"public": True}, sync_to_thread=False, include_in_schema=False)
    def home() -> Redirect:
        return Redirect(f"{PREFIX}/{PAGES[0].path}", status_code=303)

    team_landing = next(f"{PREFIX}/{p.path}" for p in PAGES if p.team)  # where a team admin lands
    landing = f"{PREFIX}/{PAGES[0].path}"
    handlers = [home, *signin.handlers(gateway, sessions, landing, team_landing),
                *sso.handlers(gateway, sessions, landing, team_landing)]
    for p in PAGES:
        handlers.extend(p.handlers(gateway))
    pages = Router(path=PREFIX, route_handlers=handlers, guards=[guard], include_in_schema=False,
                   exception_handlers=ERRORS)
    static = create_static_files_router(
        path=f"{PREFIX}/static", directories=[STATIC], guards=[guard], opt={"public": True},
        include_in_schema=False, cache_control=CacheControlHeader(max_age=365 * 86400, public=True),
    )
    return [pages, static]


def templates() -> TemplateConfig[Any]:
    from litestar.plugins.jinja import JinjaTemplateEngine

    return TemplateConfig(directory=TEMPLATES, engine=JinjaTemplateEngine)


def security_headers(message: Message, scope: Scope) -> None:
    """The app's before_send hook: every /console answer, errors included, carries the CSP and its peers."""
    if message["type"] == "http.response.start" and scope["path"].startswith(PREFIX):
        message["headers"] = [*message.get("headers", ()), *SECURITY_HEADERS]
