"""The shapes routing plugins share: what they are given (a `RoutingRequest`, request.py, never the whole
call) and what they return."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from types import EllipsisType
from typing import Generic, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from backends.replicas import Replica
from backends.vllm_stats import VLLMStats
from policies.routing.request import RoutingRequest

Candidate = Replica
P = TypeVar("P", covariant=True)


class Params(BaseModel):
    """A plugin's parameters from the policy file; unknown fields are errors, as everywhere in it."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Stats:
    """The per-replica view scorers read: the replica's latest fresh vLLM scrape (None when unknown or stale)
    and this gateway's own in-flight count, combined into one load figure."""

    __slots__ = ("vllm",)

    def __init__(self, vllm: Callable[[Replica], VLLMStats | None] | None = None) -> None:
        self.vllm = vllm or (lambda replica: None)

    def load(self, replica: Replica, seen: VLLMStats | None | EllipsisType = ...) -> float:
        """Requests the replica holds: vLLM's running + waiting when fresh (load from every client), less this
        gateway's requests to it that have ended since the scrape began, and never less than what this gateway has
        in flight to it right now: the scrape lags by up to its interval, and a replica that just finished this
        gateway's request must not look busy with it until the next one (a request that ended while the scrape
        was under way may be taken off twice; the floor and the next scrape bound that). `seen`: its scrape as
        `vllm` gave it earlier in this pick, so a scorer that read it already does not look it up again."""
        stats = self.vllm(replica) if seen is ... else seen
        own = float(replica.in_flight)
        if stats is None or stats.load is None:
            return own
        return max(own, stats.load - max(0, replica.ended - stats.ended_before))


class Note:
    """One scorer's scratch for one pick, made by the profile and handed to `score` and then `picked`: what the
    scorer saw, for the metrics (`outcome`, e.g. "hit"; None: agreed/overruled by the pick), and what it keeps
    between the two calls: a prefix scorer's prompt blocks (`blocks`), hashed once per pick. A scorer keeps
    nothing of one call on itself. A prefix scorer's `picked` also says how many of the prompt's tokens the
    chosen replica likely has to prefill (`uncached`: what it did not find cached there)."""

    __slots__ = ("outcome", "blocks", "uncached")

    def __init__(self) -> None:
        self.outcome: str | None = None
        self.blocks: list[int] | None = None
        self.uncached: float | None = None


class RoutingMetrics(Protocol):
    """What routing tells the metrics (policies/metrics.py GatewayMetrics is one): each scorer's outcome per pick,
    each plugin's time per step, and how much of a prompt matched a cached prefix."""

    def decision(self, model: str, scorer: str, outcome: str) -> None: ...

    def plugin_timer(self, model: str, plugin: str, step: str) -> Callable[[float], None]: ...

    def prefix_match(self, model: str, chars: int, ratio: float) -> None: ...


class Filter(Protocol):
    name: str

    def keep(self, request: RoutingRequest, candidates: Sequence[Candidate], stats: Stats) -> list[Candidate]:
        """The candidates that may serve this request (a filter that would drop them all keeps them all)."""


class Scorer(Protocol):
    name: str
    learns: bool  # the profile calls `picked` only when True

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate], stats: Stats, note: Note) -> list[float]:
        """One score in [0, 1] per candidate; higher is better. Values outside are clamped."""

    def picked(self, request: RoutingRequest, replica: Candidate, note: Note) -> None:
        """The replica the profile chose, with this pick's note (learning scorers remember the pick)."""


class Picker(Protocol):
    name: str

    def pick(self, candidates: Sequence[Candidate], totals: list[float]) -> Candidate:
        """One of the candidates, given their weighted total scores."""


Q = TypeVar("Q", bound=BaseModel)
R = TypeVar("R")


class PluginClass(Protocol[Q, P]):
    """A filter's or scorer's class: its name, the model of its params and its constructor, which takes them."""

    name: str
    Params: type[Q]

    def __call__(self, params: Q | None = None, metrics: RoutingMetrics | None = None) -> P: ...


class Plugin(Generic[R]):
    """A plugin as the registry holds it (policies/routing/registry.py): built from the policy file's raw
    params, which its own Params model checks, so each constructor gets exactly the params type it declares."""

    def __init__(self, cls: PluginClass[Q, R]) -> None:
        self.name = cls.name
        self.Params: type[BaseModel] = cls.Params
        self.build: Callable[[Mapping[str, object], RoutingMetrics | None], R] = \
            lambda raw, metrics: cls(cls.Params.model_validate(raw), metrics)

    def __call__(self, params: Mapping[str, object] | None = None, metrics: RoutingMetrics | None = None) -> R:
        """The plugin with these params (its defaults when none)."""
        return self.build(params or {}, metrics)


class PluginChoice(Protocol):
    """One plugin as a profile names it (policies/config/routing_profile.py's PluginRef is one)."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float: ...

    @property
    def params(self) -> Mapping[str, object]: ...


class ProfileChoice(Protocol):
    """A profile as the policy file writes it (policies/config/routing_profile.py's RoutingProfile is one)."""

    @property
    def filters(self) -> Sequence[PluginChoice]: ...

    @property
    def scorers(self) -> Sequence[PluginChoice]: ...

    @property
    def picker(self) -> str: ...


class PickerClass(Protocol):
    def __call__(self, rng: random.Random | None = None) -> Picker: ...


class Stateless:
    """For scorers that learn nothing from a pick (the profile does not call their `picked`) and, unless they
    say otherwise, take no params."""

    Params = Params
    learns = False

    def __init__(self, params: BaseModel | None = None, metrics: RoutingMetrics | None = None) -> None:
        pass

    def picked(self, request: RoutingRequest, replica: Candidate, note: Note) -> None:
        return None


def relative_load(loads: list[float]) -> list[float]:
    """1 for the least loaded, 0 for the most, linear between; all 1 when nothing is in flight."""
    most = max(loads)
    if most <= 0:
        return [1.0] * len(loads)
    return [1.0 - load / most for load in loads]
