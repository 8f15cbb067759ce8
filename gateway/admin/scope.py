"""Who is calling the admin API, and the one rule for team admins: only their own team's keys.

The admin guard (gateway/admin/routes.py) verifies the token and leaves its claims in the request's scope;
the routes read them here. A `team_admin` token may reach only the routes marked `opt={"team": True}`, and on
those only keys (and the team) its `team` claim names; every other role sees everything its role allows.
"""

from __future__ import annotations

from typing import Any

from policies.errors import PermissionDenied
from policies.keys import KeyRecord

from gateway.admin.audit import ADMIN_CLAIMS as CLAIMS  # noqa: E402  # the scope entry the guard fills
from gateway.http.asgi import AnyConnection  # noqa: E402


def remember(connection: AnyConnection, claims: dict[str, Any]) -> None:
    connection.scope[CLAIMS] = claims  # type: ignore[literal-required]


def claims_of(connection: AnyConnection) -> dict[str, Any]:
    return connection.scope.get(CLAIMS) or {}  # type: ignore[return-value]


def own_team(connection: AnyConnection) -> str | None:
    """The team a team_admin token is bound to; None for every other role (not bound to one)."""
    claims = claims_of(connection)
    return claims.get("team") if claims.get("role") == "team_admin" else None


def check_route(connection: AnyConnection, team_route: bool) -> None:
    """403 for a team_admin token on a route that is not about its team's keys (keys of no team, other teams,
    the team's own settings, the fleet-wide views)."""
    team = own_team(connection)
    if team is not None and not team_route:
        raise PermissionDenied(f"a team admin token (team {team}) may only manage its team's keys",
                               code="team_admin_scope")


def check_key(connection: AnyConnection, record: KeyRecord) -> None:
    """403 when a team_admin token asks for a key outside its team."""
    team = own_team(connection)
    if team is not None and record.team != team:
        raise PermissionDenied(f"this key is not in team {team}, the only team this admin token manages",
                               code="other_team")


def check_team(connection: AnyConnection, name: str) -> None:
    """403 when a team_admin token names a team other than its own."""
    team = own_team(connection)
    if team is not None and name != team:
        raise PermissionDenied(f"this admin token manages team {team} only", code="other_team")
