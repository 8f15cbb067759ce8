"""A pipeline Call made as the steps would leave it: with the model, key, team and class that the steps write
once through their slots (policies/pipeline.py: MODEL, KEY, TEAM, CLASS), for tests that start past those steps."""

from __future__ import annotations

from typing import Any

from policies.config.admission import PriorityClass
from policies.keys import KeyRecord
from policies.pipeline import CLASS, KEY, MODEL, TEAM, Call, Request
from policies.teams import TeamRecord


def settled(call: Call, *, model: str | None = None, key: KeyRecord | None = None, team: TeamRecord | None = None,
            klass: PriorityClass | None = None) -> Call:
    """`call` with what the given steps settled (each written once, as they write it)."""
    if model is not None:
        MODEL.put(call, model)
    if key is not None:
        KEY.put(call, key)
    if team is not None:
        TEAM.put(call, team)
    if klass is not None:
        CLASS.put(call, klass)
    return call


def call_of(request: Request, *, model: str | None = None, key: KeyRecord | None = None,
            team: TeamRecord | None = None, klass: PriorityClass | None = None, **fields: Any) -> Call:
    """A Call of `request` with the call's own `fields`, and what the steps settle."""
    return settled(Call(request, **fields), model=model, key=key, team=team, klass=klass)
