"""The admin API's teams: create, list, show, change and delete a team; its usage and budget.

Admins manage teams; viewers and operators read them; a team admin reads its own team only (and manages its
keys through /admin/keys). A change that would leave one of the team's keys allowing more than the team is
refused with 409 naming those keys, and a team that still has active keys cannot be deleted (409): the keys
are narrowed, moved or revoked first, so nothing is half-applied and a key never silently loses its team.
Each act is one function, so what records admin acts can be added with one line in each.
"""

from __future__ import annotations

from typing import Annotated, Protocol

from litestar import delete, get, patch, post
from litestar.handlers import HTTPRouteHandler
from litestar.params import JSONBody, KwargDefinition, Parameter
from pydantic import BaseModel, ConfigDict, Field

from gateway.admin.audit import Audited
from gateway.admin.scope import check_team, own_team
from gateway.http.asgi import AnyRequest
from gateway.needs import Configured, Stored
from gateway.openapi import errors
from gateway.admin.report import Budgeted, BudgetStatus, budget_status
from policies.accounting import RecordUsage, by_model, merged, totals
from policies.audit import diff
from policies.errors import Conflict, NotFound
from policies.keys import CLASS_NAME, TEAM_NAME, DataPolicy, KeyBudget, KeyLimits
from policies.priority import class_order
from policies.store import TeamExists, TeamNotFound
from policies.teams import TeamRecord, keys_over

TeamName = Annotated[str, KwargDefinition(pattern=TEAM_NAME, description="a team's name, e.g. search-ads")]
# The records check the form (a 400 naming the field); the pattern here is for the document.
ClassName = Annotated[str, KwargDefinition(pattern=CLASS_NAME, description="a priority class, e.g. batch")]
NameParam = Parameter(pattern=TEAM_NAME, description="the team's name")
SHOWN_KEYS = 20  # key ids named in one 409; the count says how many more


class TeamChanges(BaseModel):
    """A PATCH: only the fields sent change. null means the default: every model, private_only, no limits,
    no budget."""

    model_config = ConfigDict(extra="forbid")
    description: str | None = Field(None, max_length=500)
    models: list[str] | None = Field(None, description="models the team's keys may use; omit or null for all")
    data_policy: DataPolicy | None = Field(None, description="the most its keys may allow: private_only (the"
                                           " default) keeps every key of the team off rented providers")
    limits: KeyLimits | None = Field(None, description="requests and tokens per minute and requests in flight,"
                                     " over all of the team's keys together and every gateway replica")
    budget: KeyBudget | None = Field(None, description="rented spend and tokens per period over all of the"
                                     " team's keys together; null for none")
    max_priority_class: ClassName | None = Field(None, description="the most urgent priority class (of the"
                                                 " policy's priorities.classes) its keys may name and its calls"
                                                 " get, whatever a client picks by header; null for no ceiling")


class NewTeam(TeamChanges):
    name: TeamName


class TeamUsage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    models: dict[str, dict[str, int]]
    variants: dict[str, dict[str, dict[str, int]]] = Field(default_factory=dict)
    total: dict[str, int]
    keys: dict[str, dict[str, int]] = Field(description="each of the team's keys' totals")


class ManagesKeys(Configured, Stored, Audited, Protocol):
    """What changes keys and teams (these routes, gateway/admin/keys.py): the store, the policy's priority classes,
    the audit log, the usage counters to write before a read, and every replica's cached copies to drop."""

    record_usage: RecordUsage

    async def forget_key(self, key_id: str) -> None: ...


class Accounts(ManagesKeys, Budgeted, Protocol):
    """Keys and teams as the team routes and the console's keys and teams pages see them: what changes them, and
    what they have spent of their budgets."""


def team_handlers(gateway: Accounts) -> list[HTTPRouteHandler]:
    store = gateway.store

    async def load(name: str, request: AnyRequest) -> TeamRecord:
        check_team(request, name)
        team = await store.get_team(name)
        if team is None:
            raise NotFound(f"no team named {name}", code="team_not_found")
        return team

    def known_ceiling(team: TeamRecord) -> None:
        """404 naming the team's priority ceiling when the policy declares no such class (a typo would cap
        nothing); 404, as for a key's unknown team, since the name is well formed and refers to nothing."""
        classes = gateway.policy.priorities
        if team.max_priority_class is not None and classes.named(team.max_priority_class) is None:
            raise NotFound(f"max_priority_class {team.max_priority_class} is not a priority class of the policy;"
                           f" known: {', '.join(c.name for c in classes.classes)}", param="max_priority_class",
                           code="priority_class_not_found")

    async def save(team: TeamRecord) -> TeamRecord:
        try:
            await store.put_team(team)
        except TeamNotFound:
            raise NotFound(f"no team named {team.name}", code="team_not_found") from None
        await gateway.forget_key(team.id)  # every replica drops its cached copy (policies/auth.py)
        return team

    @post("/teams", status_code=201, summary="Create a team", responses=errors(400, 401, 403, 404, 409, 413, 503))
    async def create_team(request: AnyRequest, data: JSONBody[NewTeam]) -> TeamRecord:
        team = TeamRecord(**data.model_dump(exclude_none=True))
        known_ceiling(team)
        try:
            await store.create_team(team)
        except TeamExists:
            raise Conflict(f"a team named {team.name} already exists", param="name", code="team_exists") from None
        await gateway.audit.act(request, "team.create", team.name, team.model_dump())
        return team

    @get("/teams", summary="List teams (a team admin: its own)", opt={"team": True}, responses=errors(401, 503))
    async def list_teams(request: AnyRequest) -> list[TeamRecord]:
        own = own_team(request)
        return [t for t in await store.list_teams() if own is None or t.name == own]

    @get("/teams/{name:str}", summary="Show a team", opt={"team": True}, responses=errors(400, 401, 403, 404, 503))
    async def show_team(request: AnyRequest, name: str = NameParam) -> TeamRecord:
        return await load(name, request)

    @patch("/teams/{name:str}", summary="Change a team's models, data policy, limits, budget or priority ceiling",
           description="Refused (409, naming them) when one of the team's active keys would then allow more than"
           " the team: narrow those keys first.", responses=errors(400, 401, 403, 404, 409, 413, 503))
    async def update_team(request: AnyRequest, data: JSONBody[TeamChanges], name: str = NameParam) -> TeamRecord:
        team = await load(name, request)
        changes = data.model_dump(exclude_unset=True)
        for field in ("data_policy", "limits"):  # null: back to the default
            if field in changes and changes[field] is None:
                changes[field] = TeamRecord.model_fields[field].get_default()
        if isinstance(changes.get("limits"), dict):  # only the limits sent change
            changes["limits"] = {**team.limits.model_dump(), **changes["limits"]}
        changed = TeamRecord.model_validate({**team.model_dump(), **changes})
        known_ceiling(changed)
        over = keys_over(changed, await store.list_keys(), class_order(gateway.policy.priorities))
        if over:
            shown = "; ".join(f"key {key_id}: {', '.join(problems)}" for key_id, problems in
                              list(over.items())[:SHOWN_KEYS])
            more = f" (and {len(over) - SHOWN_KEYS} more keys)" if len(over) > SHOWN_KEYS else ""
            raise Conflict(f"{len(over)} of team {name}'s keys would allow more than the team; narrow them first:"
                           f" {shown}{more}", code="team_below_keys")
        saved = await save(changed)
        await gateway.audit.act(request, "team.update", name, diff(team.model_dump(), saved.model_dump()))
        return saved

    @delete("/teams/{name:str}", status_code=200, summary="Delete a team that has no active keys",
            description="Refused (409, naming them) while an unrevoked key belongs to the team: revoke the keys or"
            " move them out first. Revoked keys keep the team's name, for their usage.",
            responses=errors(400, 401, 403, 404, 409, 503))
    async def delete_team(request: AnyRequest, name: str = NameParam) -> TeamRecord:
        team = await load(name, request)
        active = [k.id for k in await store.list_keys() if k.team == name and not k.revoked]
        if active:
            more = f" (and {len(active) - SHOWN_KEYS} more)" if len(active) > SHOWN_KEYS else ""
            raise Conflict(f"team {name} still has {len(active)} active keys: {', '.join(active[:SHOWN_KEYS])}{more};"
                           " revoke them or move them to another team first", code="team_has_keys")
        try:
            await store.delete_team(name)
        except TeamNotFound:
            raise NotFound(f"no team named {name}", code="team_not_found") from None
        await gateway.forget_key(team.id)
        await gateway.audit.act(request, "team.delete", name)
        return team

    @get("/teams/{name:str}/usage", summary="Requests and tokens used by a team's keys, per model and per key",
         opt={"team": True}, responses=errors(400, 401, 403, 404, 503))
    async def team_usage(request: AnyRequest, name: str = NameParam) -> TeamUsage:
        await load(name, request)
        await gateway.record_usage.flush()  # this replica's last quarter second, so a read follows its writes
        ids = [k.id for k in await store.list_keys() if k.team == name]
        per_key = {key_id: await store.usage(key_id) for key_id in ids}
        models, variants = by_model(merged(list(per_key.values())))
        return TeamUsage(name=name, models=models, variants=variants, total=totals(models),
                         keys={key_id: totals(by_model(rows)[0]) for key_id, rows in per_key.items()})

    @get("/teams/{name:str}/budget", summary="What a team's keys have spent of its budget this period",
         opt={"team": True}, responses=errors(400, 401, 403, 404, 503))
    async def team_budget(request: AnyRequest, name: str = NameParam) -> BudgetStatus:
        team = await load(name, request)
        return await budget_status(gateway, team.id, name, team.budget)

    return [create_team, list_teams, show_team, update_team, delete_team, team_usage, team_budget]
