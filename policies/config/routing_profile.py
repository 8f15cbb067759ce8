"""A routing profile: filters, weighted scorers and a picker, each a registered plugin with typed params."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from policies.config.base import Strict


class PluginRef(Strict):
    """One routing plugin in a profile: its registered name, its weight (scorers) and its typed params."""

    name: str
    weight: float = Field(1.0, gt=0, le=1000)
    params: dict[str, Any] = {}


class RoutingProfile(Strict):
    """filters -> weighted scorers -> picker (policies/routing/ documents each plugin and its params)."""

    filters: list[PluginRef] = []
    scorers: list[PluginRef] = []
    picker: str = "max-score"

    @model_validator(mode="after")
    def known_plugins(self) -> RoutingProfile:
        from policies.routing.registry import FILTERS, PICKERS, SCORERS

        for kind, refs, registry in (("filter", self.filters, FILTERS), ("scorer", self.scorers, SCORERS)):
            for ref in refs:
                plugin = registry.get(ref.name)
                if plugin is None:
                    raise ValueError(f"unknown {kind} {ref.name!r}; known: {', '.join(sorted(registry))}")
                try:
                    plugin.Params.model_validate(ref.params)
                except ValidationError as exc:
                    problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                         for e in exc.errors(include_url=False))
                    raise ValueError(f"{kind} {ref.name}: params: {problems}") from None
        if self.picker not in PICKERS:
            raise ValueError(f"unknown picker {self.picker!r}; known: {', '.join(sorted(PICKERS))}")
        return self
