"""The audit log, read-only: admin acts newest first (who, when, from where, what changed), searched by actor,
action and time range and paged from newest to oldest, through the same query as GET /admin/audit
(gateway/admin/audit.py). Times are typed and shown in UTC."""

from __future__ import annotations

import calendar
import time
from typing import Any, Protocol

from litestar import get
from litestar.handlers import HTTPRouteHandler
from litestar.params import Parameter
from litestar.response import Template

from gateway.admin.audit import CURSOR, Audited
from gateway.http.asgi import AnyRequest
from gateway.console.pages import Page
from gateway.console.render import page as render
from gateway.needs import Configured
from policies.audit import AuditQuery
from policies.errors import BadRequest

MINUTE = r"^$|^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2})?$"  # what a datetime-local field sends


class AuditLog(Configured, Audited, Protocol):
    """The audit page: the audit log, and the console's page size."""


def handlers(gateway: AuditLog) -> list[HTTPRouteHandler]:
    @get("/audit")
    async def audit(request: AnyRequest, actor: str = Parameter(default="", max_length=500),
                    action: str = Parameter(default="", max_length=100),
                    since: str = Parameter(default="", pattern=MINUTE),
                    until: str = Parameter(default="", pattern=MINUTE),
                    before: str | None = Parameter(default=None, pattern=CURSOR)) -> Template:
        query = AuditQuery(actor=actor.strip() or None, action=action.strip() or None,
                           since=unix(since, "since"), until=unix(until, "until"), before=before,
                           limit=gateway.policy.console.page_size)
        found = await gateway.audit.audit.query(query)
        rows = [{"event": e, "at": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.at)),
                 "changes": changes_text(e.changes)} for e in found.events]
        template = "audit_table.html" if request.headers.get("hx-target") == "audit-table" else "audit.html"
        return render(request, template, "Audit log", rows=rows, next=found.next, actor=actor, action=action,
                      since=since, until=until, first=before is None)

    return [audit]


def unix(value: str, name: str) -> float | None:
    """A datetime-local field's value, read as UTC; blank: no bound."""
    if not value:
        return None
    try:
        fmt = "%Y-%m-%dT%H:%M:%S" if value.count(":") == 2 else "%Y-%m-%dT%H:%M"
        return float(calendar.timegm(time.strptime(value, fmt)))
    except ValueError:
        raise BadRequest(f"{name}: a date and time such as 2026-01-31T09:30", param=name) from None


def changes_text(changes: dict[str, Any]) -> str:
    """An event's changes on one line each: `field: from → to` or `field: value`."""
    lines = []
    for name, value in changes.items():
        if isinstance(value, dict) and set(value) == {"from", "to"}:
            lines.append(f"{name}: {value['from']} → {value['to']}")
        else:
            lines.append(f"{name}: {value}")
    return "\n".join(lines)


PAGE = Page("audit", "Audit log", handlers)
