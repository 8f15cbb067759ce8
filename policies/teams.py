"""Teams: a group of API keys that shares one ceiling, and the rules that keep every key of a team under it.

A team holds what its keys may use at most: models, rate limits (requests and tokens per minute, requests in
flight), a budget per period and a data policy. Its limits and budget are counted over every key of the team
together, on every gateway replica (the rate-limit step adds the team's scope beside the key's, the budget
step its budget beside the key's); its models and data policy bound each key's own.

A key belongs to at most one team (`KeyRecord.team`) and may only narrow what its team allows: a key's models
inside the team's, each limit at most the team's, `allow_rented` only in a team that allows it, each budget
amount at most the team's, a priority class no more urgent than the team's `max_priority_class` (in the order
the policy lists its classes). `key_problems` names every way a key breaks that; the admin API refuses such a key
(409) and a change to a team that would put an existing key above it (409, naming the keys), so nothing is
half-applied. The request path still checks the team's models and data policy itself, so two admins acting
at once cannot open a gap between them.

The priority ceiling also holds at request time (the Classify step, policies/priority.py): whatever class a
key names or its client picks by header, a call of the team is served no more urgently than the ceiling, even
after the policy's classes change; a ceiling the policy no longer names counts as its least urgent class.

Who administers a team is decided by the admin token: role `team_admin` with a `team` claim naming it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from policies.keys import CLASS_NAME, TEAM_NAME, DataPolicy, KeyBudget, KeyLimits, KeyRecord

LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
AMOUNTS = ("max_rented_spend", "max_tokens_per_period")
OWNER_PREFIX = "team:"  # a team's scope in rate limits and budgets, and its entry in the auth cache


class TeamRecord(BaseModel):
    """What the store keeps for one team."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=TEAM_NAME)
    description: str | None = Field(None, max_length=500)
    models: list[str] | None = None  # None: every model
    data_policy: DataPolicy = "private_only"  # the most its keys may allow
    limits: KeyLimits = KeyLimits()  # over every key of the team together
    budget: KeyBudget | None = None  # over every key of the team together
    max_priority_class: str | None = Field(None, pattern=CLASS_NAME)  # the most urgent class its calls get
    created_at: float = Field(default_factory=time.time)

    @property
    def id(self) -> str:
        """Its name in rate-limit scopes, budgets and the auth cache (never a key id: those are hex)."""
        return f"{OWNER_PREFIX}{self.name}"


@dataclass(frozen=True)
class ClassOrder:
    """The policy's priority class names, most urgent first, and the default a key naming none (or a name the
    policy lacks) is served (policies/priority.py builds it from the policy)."""

    names: tuple[str, ...]
    default: str

    def served(self, name: str | None) -> int:
        """The rank a key's class is served at (0: the most urgent)."""
        return self.names.index(name) if name in self.names else self.names.index(self.default)

    def ceiling(self, team: TeamRecord | None) -> int | None:
        """The most urgent rank a call of `team` may get (None: no ceiling). A name the policy no longer has is
        its least urgent class: a renamed class must not lift the team's calls."""
        if team is None or team.max_priority_class is None:
            return None
        top = team.max_priority_class
        return self.names.index(top) if top in self.names else len(self.names) - 1


def key_problems(key: KeyRecord, team: TeamRecord, order: ClassOrder) -> list[tuple[str, str]]:
    """Every way `key` allows more than `team` does: (the key's field, a readable phrase); empty when it fits.

    A limit, a budget amount or a model list the key leaves unset is the team's, so only a value of the key's
    own can exceed the team's; a priority class is ranked as it is served (a name the policy lacks: its
    default, policies/priority.py)."""
    problems = []
    top = order.ceiling(team)
    if key.priority_class is not None and top is not None:
        if order.served(key.priority_class) < top:
            problems.append(("priority_class", f"priority_class {key.priority_class} is above team {team.name}'s"
                             f" max_priority_class {team.max_priority_class}"))
    if team.models is not None and key.models is not None:
        outside = [m for m in key.models if m not in team.models]
        if outside:
            problems.append(("models", f"models {', '.join(outside)} are not among team {team.name}'s models"))
    for field in LIMITS:
        mine, theirs = getattr(key.limits, field), getattr(team.limits, field)
        if mine is not None and theirs is not None and mine > theirs:
            problems.append((f"limits.{field}", f"limits.{field} {mine} is above team {team.name}'s {theirs}"))
    if key.data_policy == "allow_rented" and team.data_policy == "private_only":
        problems.append(("data_policy", f"data_policy allow_rented is more than team {team.name}'s private_only"))
    if key.budget is not None and team.budget is not None:
        for field in AMOUNTS:
            mine, theirs = getattr(key.budget, field), getattr(team.budget, field)
            if mine is not None and theirs is not None and mine > theirs:
                text = f"budget.{field} {mine:g} is above team {team.name}'s {theirs:g}"
                problems.append((f"budget.{field}", text))
    return problems


def keys_over(team: TeamRecord, keys: list[KeyRecord], order: ClassOrder) -> dict[str, list[str]]:
    """key id -> problems, for the team's active keys that would allow more than `team` (a team change)."""
    out = {}
    for key in keys:
        if key.team == team.name and not key.revoked:
            problems = key_problems(key, team, order)
            if problems:
                out[key.id] = [text for _field, text in problems]
    return out


def effective_models(key: KeyRecord, team: TeamRecord | None) -> list[str] | None:
    """The models a key of `team` may use: its own list inside the team's (None: every model)."""
    if team is None or team.models is None:
        return key.models
    if key.models is None:
        return list(team.models)
    return [m for m in key.models if m in team.models]
