"""Admin acts into the audit log (policies/audit), and GET /admin/audit to read them back.

A route that changes anything records it with one line, after the change is made:

    await gateway.audit.act(request, "key.revoke", key_id, {"revoked": True})

The actor is the admin token the guard of /admin verified (its claims are left in the request's scope), the
address the client's as the ingress rules read it (X-Forwarded-For only from trusted proxies). Acts with no
token behind them (a policy reload from the file or SIGHUP) are recorded with `system`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from litestar import get
from litestar.handlers import HTTPRouteHandler
from litestar.params import Parameter

from gateway.http.asgi import AnyConnection
from gateway.openapi import errors
from policies.audit import Actor, Audit, AuditPage, AuditQuery
from policies.network import ClientNetwork

ADMIN_CLAIMS = "llm_gateway.admin_claims"  # the scope key where the /admin guard leaves the verified claims
SYSTEM = Actor(subject="gateway", issuer="llm-gateway", role="system")
MAX_PAGE = 500
CURSOR = r"^[0-9]{17}-[0-9a-f]{8}$"


class AdminAudit:
    def __init__(self, audit: Audit, network: Callable[[], ClientNetwork]) -> None:
        self.audit = audit
        self.network = network  # the live policy's, read at each act

    async def act(self, connection: AnyConnection, action: str, target: str,
                  changes: dict[str, Any] | None = None) -> None:
        """Record an act of the admin whose token the guard verified on this connection."""
        await self.audit.record(self.actor(connection), action, target, changes)

    async def system(self, action: str, target: str, changes: dict[str, Any] | None = None) -> None:
        await self.audit.record(SYSTEM, action, target, changes)

    def actor(self, connection: AnyConnection) -> Actor:
        claims: dict[str, Any] = connection.scope.get(ADMIN_CLAIMS) or {}  # type: ignore[assignment]
        client = connection.scope.get("client")
        address = self.network().client_address(client[0] if client else "",
                                                connection.headers.get("x-forwarded-for"))
        return Actor(subject=str(claims.get("sub") or "-"), issuer=str(claims.get("iss") or "-"),
                     role=str(claims.get("role") or "-"), team=claims.get("team"), address=address or None)


class Audited(Protocol):
    """The audit log of admin acts: what a route that changes anything records with, and GET /audit reads."""

    audit: AdminAudit


def audit_handlers(gateway: Audited) -> list[HTTPRouteHandler]:
    @get("/audit", summary="The audit log: admin acts, newest first, with who, when, from where and what changed",
         description="Filters combine (all must match). Pages hold at most `limit` events; `next` is the `before`"
                     " of the following, older page.", responses=errors(400, 401, 503))
    async def audit_log(
        actor: str | None = Parameter(default=None, max_length=500, description="the token's subject (sub)"),
        action: str | None = Parameter(default=None, max_length=100, description="e.g. key.create"),
        target: str | None = Parameter(default=None, max_length=500, description="a key id, a model, ..."),
        since: float | None = Parameter(default=None, description="unix seconds, inclusive"),
        until: float | None = Parameter(default=None, description="unix seconds, exclusive"),
        before: str | None = Parameter(default=None, pattern=CURSOR, description="the `next` of the page before"),
        limit: int = Parameter(default=100, ge=1, le=MAX_PAGE, description=f"events per page (at most {MAX_PAGE})"),
    ) -> AuditPage:
        return await gateway.audit.audit.query(AuditQuery(actor=actor, action=action, target=target, since=since,
                                                          until=until, before=before, limit=limit))

    return [audit_log]
