"""The teams page: every team with its active keys, budget, limits and spend this period; an admin creates a
team and changes one (description, models, data policy, limits, budget, priority ceiling).

Each act is the admin API's own team route (gateway/admin/teams.py) called with the console's request, so the
console and POST/PATCH /admin/teams cannot disagree: the same checks (a change that would leave a key above its
team: 409 naming the keys), the same audit record. A team admin sees its own team only, read-only (the admin
API lets it read its team, not change it), and another team's page answers it 403 as GET /admin/teams/{name}
does.
"""

from __future__ import annotations

from typing import Any

from litestar import get, post
from litestar.handlers import HTTPRouteHandler
from litestar.params import Parameter
from litestar.response import Template

from gateway.http.asgi import AnyRequest
from gateway.console.keys_page import blank, limits_and_budget, listed
from gateway.console.pages import Page
from gateway.console.render import page as render
from gateway.console.session import form_of
from gateway.admin.teams import Accounts, NewTeam, TeamChanges, team_handlers
from policies.keys import TEAM_NAME, KeyRecord
from policies.teams import TeamRecord

NAME = Parameter(pattern=TEAM_NAME)
TEAM = {"team": True}  # a team admin may open it (its own team only)
MEMBERS_SHOWN = 200  # keys listed on a team's page


def handlers(gateway: Accounts) -> list[HTTPRouteHandler]:
    api = {h.fn.__name__: h.fn for h in team_handlers(gateway)}  # the admin API's own team operations

    async def rows(request: AnyRequest) -> list[dict[str, Any]]:
        """Each team the viewer may see (a team admin: its own), with its active keys and this period's spend."""
        keys = await gateway.store.list_keys()
        out = []
        for team in await api["list_teams"](request):
            out.append({"team": team, "keys": sum(1 for k in keys if k.team == team.name and not k.revoked),
                        "spend": await api["team_budget"](request, team.name)})
        return out

    def summary(listing: list[dict[str, Any]]) -> dict[str, Any]:
        return {"teams": len(listing), "keys": sum(r["keys"] for r in listing),
                "spend": sum(r["spend"].rented_spend for r in listing),
                "budgeted": sum(1 for r in listing if r["team"].budget is not None)}

    @get("/teams", opt=TEAM)
    async def listing(request: AnyRequest) -> Template:
        found = await rows(request)
        return render(request, "teams.html", "Teams", teams=found, summary=summary(found),
                      classes=[c.name for c in gateway.policy.priorities.classes])

    @post("/teams", opt={"role": "admin"}, status_code=201)
    async def create(request: AnyRequest) -> Template:
        fields = await form_of(request)
        team = await api["create_team"](request, NewTeam.model_validate(
            {"name": fields.get("name", "").strip(), **settings_of(fields)}))
        found = await rows(request)
        return render(request, "team_created.html", "New team", status=201, created=team, teams=found,
                      summary=summary(found))

    @get("/teams/{name:str}", opt=TEAM)
    async def show(request: AnyRequest, name: str = NAME) -> Template:
        team = await api["show_team"](request, name)  # 403 for another team's admin, 404 for no such team
        return render(request, "team.html", f"Team {team.name}", **await details(request, team, None),
                      classes=[c.name for c in gateway.policy.priorities.classes])

    @post("/teams/{name:str}", opt={"role": "admin"}, status_code=200)
    async def update(request: AnyRequest, name: str = NAME) -> Template:
        changes = TeamChanges.model_validate(settings_of(await form_of(request)))
        team = await api["update_team"](request, changes, name)
        return render(request, "team_panel.html", f"Team {team.name}", **await details(request, team, "Saved."))

    async def details(request: AnyRequest, team: TeamRecord, message: str | None) -> dict[str, Any]:
        members: list[KeyRecord] = [k for k in await gateway.store.list_keys() if k.team == team.name]
        active = [k for k in members if not k.revoked]
        return {"team": team, "members": members[:MEMBERS_SHOWN], "more": max(0, len(members) - MEMBERS_SHOWN),
                "active": len(active), "revoked": len(members) - len(active),
                "spend": await api["team_budget"](request, team.name), "message": message}

    return [listing, create, show, update]


def settings_of(fields: dict[str, str]) -> dict[str, Any]:
    """A team's settings form as the admin API's body: every field is sent, an empty one is the default (null:
    no limit, no budget, every model, no priority ceiling)."""
    limits, budget = limits_and_budget(fields)
    return {"description": blank(fields.get("description")), "models": listed(fields.get("models")),
            "data_policy": fields.get("data_policy") or None, "limits": limits, "budget": budget,
            "max_priority_class": blank(fields.get("max_priority_class"))}


PAGE = Page("teams", "Teams", handlers, team=True)
