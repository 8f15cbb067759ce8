"""Fallback chains: where a model's calls go when none of its own replicas can serve them (every one down,
failing past its retries, or full past the queue bound). Other owned models first, then rented providers, in the
order written; each step is checked as the first was (gateway/fallbacks.py).

Checked at load: an owned step names a model of the policy (not an alias, not a model with variants), never the
model itself, and never one whose own chain leads back (a cycle would move an outage's load back and forth); a
rented step names a declared provider that maps the model it serves. Owned steps come before rented ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Annotated, Protocol

from pydantic import Field

from policies.config.base import NAME, Strict


class RentedStep(Strict):
    """A rented provider as a step of a chain: the provider's mapping of `model` serves the call (default: the
    chain's own model), and the answer names that public model. Only keys whose data policy allows renting reach
    it."""

    provider: str = Field(pattern=NAME)  # a declared provider's name
    model: str | None = Field(None, pattern=NAME)  # the public model it maps that serves; null: the chain's own


Fallback = Annotated[str, Field(pattern=NAME)] | RentedStep  # an owned model's name, or a rented step


class FallbackOwner(Protocol):
    """What check_fallbacks reads of a model (policies/config/model.py Model, which imports this module)."""

    @property
    def name(self) -> str: ...

    @property
    def aliases(self) -> Sequence[str]: ...

    @property
    def variants(self) -> Sequence[object]: ...

    @property
    def fallbacks(self) -> Sequence[str | RentedStep]: ...


class FallbackProvider(Protocol):
    """What check_fallbacks reads of a provider (policies/config/providers.py Provider)."""

    @property
    def name(self) -> str: ...

    @property
    def models(self) -> Iterable[str]: ...


def check_fallbacks(models: Sequence[FallbackOwner], providers: Sequence[FallbackProvider]) -> None:
    """Raise ValueError naming the first fallback that does not resolve, or a cycle of owned fallbacks."""
    by_name = {m.name: m for m in models}
    aliases = {alias: m.name for m in models for alias in m.aliases}
    mapped = {p.name: set(p.models) for p in providers}
    for model in models:
        seen_rented = False
        names: list[str] = []
        for step in model.fallbacks:
            if isinstance(step, RentedStep):
                seen_rented = True
                serves = step.model or model.name
                if step.provider not in mapped:
                    raise ValueError(f"model {model.name}: fallback provider {step.provider!r} is not declared")
                if serves not in mapped[step.provider]:
                    raise ValueError(f"model {model.name}: fallback provider {step.provider} has no mapping for"
                                     f" model {serves}")
                continue
            if seen_rented:
                raise ValueError(f"model {model.name}: fallback {step!r} is an owned model after a rented step;"
                                 " owned models come first")
            if step == model.name:
                raise ValueError(f"model {model.name}: a model cannot be its own fallback")
            target = by_name.get(step)
            if target is None:
                hint = f" (an alias of {aliases[step]}: name the model)" if step in aliases else ""
                raise ValueError(f"model {model.name}: fallback {step!r} is not a model of this policy{hint}")
            if target.variants:
                raise ValueError(f"model {model.name}: fallback {step!r} has variants; a fallback is a model served"
                                 " by its own replicas")
            if step in names:
                raise ValueError(f"model {model.name}: fallback {step!r} is named twice")
            names.append(step)
    cycle = owned_cycle({m.name: [s for s in m.fallbacks if isinstance(s, str)] for m in models})
    if cycle:
        raise ValueError(f"fallbacks form a cycle: {' -> '.join(cycle)}")


def owned_cycle(edges: dict[str, list[str]]) -> list[str] | None:
    """A cycle of owned fallbacks (its models in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for nxt in edges.get(name, ()):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[name] = 2
        return None

    for start in edges:  # bounded: each model is visited once (a policy has a bounded number of models)
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None
