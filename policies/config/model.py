"""A served model: its names, limits, queue, routing, replicas (backends, discovery or variants) and scaling."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from backends.replicas import group_name
from policies.config.access import LimitValues
from policies.config.admission import Queue
from policies.config.backend import Backend
from policies.config.base import NAME, Strict
from policies.config.discovery import Discovery
from policies.config.fallbacks import Fallback
from policies.config.providers import Overflow
from policies.config.reliability import Ejection, Retries
from policies.config.scaling import Autoscaling
from policies.config.variants import Guard, Sticky, Variant
from policies.config.lora import Lora


class Model(Strict):
    name: str = Field(pattern=NAME)
    aliases: list[Annotated[str, Field(pattern=NAME)]] = []
    served_name: str | None = Field(None, pattern=NAME)
    limits: LimitValues | None = None  # the model's totals across every key
    queue: Queue = Queue()
    overflow: Overflow | None = None  # None: this model never leaves the cluster
    routing: str | None = Field(None, pattern=NAME)  # a routing profile's name (default: routing.default_profile)
    # the provider whose price the own-vs-rent report compares with (default: the overflow provider)
    rented_price_from: str | None = Field(None, pattern=NAME)
    backends: list[Backend] = []
    discovery: Discovery | None = None  # instead of backends: replicas found in the cluster, watched
    # instead of backends and discovery: named variants, each with its own replicas, split by weight
    variants: list[Variant] = []
    sticky: Sticky | None = None  # variants: keep a conversation on one (default: every request drawn anew)
    guard: Guard | None = None  # variants: compare candidates with the baseline and pull back a worse one
    autoscaling: Autoscaling | None = None  # the replica-count signal's settings and scale from zero
    lora: Lora | None = None  # LoRA adapters served on this model's replicas, each a model (policies/config/lora.py)
    retries: Retries = Retries()  # another replica when one fails before the first byte, within a budget
    ejection: Ejection = Ejection()  # replicas that keep failing or answer far slower than their peers sit out
    # where its calls go when no replica of its own can serve them: other owned models, then rented providers
    # (policies/config/fallbacks.py), tried in order
    fallbacks: list[Fallback] = Field([], max_length=16)

    @model_validator(mode="after")
    def backends_or_discovery(self) -> Model:
        if self.variants:
            if self.lora is not None:
                raise ValueError("`lora` adapters are served on a model's own replicas: not on a model with variants")
            if self.backends or self.discovery is not None:
                raise ValueError("a model with `variants` gives its replicas there, not in `backends`/`discovery`")
            names = [v.name for v in self.variants]
            if len(set(names)) != len(names):
                raise ValueError("variant names must be unique")
            if sum(v.weight for v in self.variants if not v.shadow) <= 0:
                raise ValueError("variants: at least one variant that is not a shadow needs a weight above 0")
            if any(v.shadow and v.weight > 100 for v in self.variants):
                raise ValueError("a shadow variant's weight is the percent of requests copied to it: at most 100")
            if self.guard and self.guard.baseline and self.guard.baseline not in names:
                raise ValueError(f"guard.baseline {self.guard.baseline!r} is not a variant of this model")
            # every owned backend of the model, in one list: the egress check, caps, cost and ledger read it
            flat = [b if b.name else b.model_copy(update={"name": f"{self.name}-{v.name}-{j}"})
                    for v in self.variants for j, b in enumerate(v.backends)]
            object.__setattr__(self, "backends", flat)  # frozen: set once, here, while validating
            return self
        if self.sticky is not None or self.guard is not None:
            raise ValueError("sticky and guard apply to variants; this model has none")
        if bool(self.backends) == (self.discovery is not None):
            raise ValueError("a model needs either a non-empty `backends` list or `discovery`, not both")
        return self

    @model_validator(mode="after")
    def scaling_needs_a_cap(self) -> Model:
        if self.autoscaling is not None:
            for group, variant in groups_of(self):
                if replica_cap(self, variant) is None:
                    raise ValueError(f"autoscaling of {group} needs the cap of one replica: set"
                                     " autoscaling.replica_cap, discovery.cap or every backend's cap")
        return self

    def compared_provider(self) -> str | None:
        return self.rented_price_from or (self.overflow.provider if self.overflow else None)


def groups_of(model: Model) -> list[tuple[str, Variant | None]]:
    """A model's replica sets (backends/replicas.py group_name): one per variant, or the model's own."""
    return [(group_name(model.name, v.name), v) for v in model.variants] or [(model.name, None)]


def replica_cap(model: Model, variant: Variant | None) -> int | None:
    """The cap of one replica of a model's replica set (its variant's, if given), for the scaling signal:
    autoscaling.replica_cap, else discovery.cap, else the mean of its backends' caps (None if one has none)."""
    if model.autoscaling is not None and model.autoscaling.replica_cap is not None:
        return model.autoscaling.replica_cap
    owner = variant or model
    if owner.discovery is not None:
        return owner.discovery.cap
    caps = [b.cap for b in owner.backends if b.cap is not None]
    if not caps or len(caps) < len(owner.backends):
        return None
    return max(1, round(sum(caps) / len(caps)))


def backend_name(model: Model, index: int) -> str:
    return model.backends[index].name or f"{model.name}-{index}"
