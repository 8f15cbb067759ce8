"""Variants of one model: their replicas and shares, promotion steps, the guard, and stickiness."""

from __future__ import annotations

from typing import Annotated

from pydantic import AliasChoices, Field, field_validator, model_validator

from policies.config.backend import Backend
from policies.config.base import NAME, Seconds, Strict
from policies.config.discovery import Discovery
from policies.config.lora import VariantAdapter

VARIANT = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class Variant(Strict):
    """One way of serving a model (a vLLM flag, a quantisation, a draft model): its own replicas, from a
    `backends` list or `discovery`, with their caps, and its share of the model's traffic."""

    name: str = Field(pattern=VARIANT)
    weight: float = Field(0.0, ge=0, le=1_000_000)  # relative to the other live ones; a shadow's: percent copied
    shadow: bool = False  # gets copies of sampled requests, never live traffic (its answers are never returned)
    served_name: str | None = Field(None, pattern=NAME)
    backends: list[Backend] = []
    discovery: Discovery | None = None
    adapter: VariantAdapter | None = None  # served by this LoRA adapter on its replicas (policies/config/lora.py)

    @model_validator(mode="after")
    def backends_or_discovery(self) -> Variant:
        if bool(self.backends) == (self.discovery is not None):
            raise ValueError("a variant needs either a non-empty `backends` list or `discovery`, not both")
        if self.adapter is not None and self.shadow:
            raise ValueError("a shadow variant cannot be served by an adapter (its copies name the base model)")
        return self


class Promotion(Strict):
    """Steps a candidate takes while its guard holds: its share of the model's traffic, in percent."""

    steps: list[Annotated[float, Field(gt=0, le=100)]] = Field(min_length=1)  # e.g. [5, 25, 50, 100]
    after_requests: int = Field(200, ge=1, le=10_000_000)  # the candidate's calls at a step before the next

    @field_validator("steps")
    @classmethod
    def rising(cls, steps: list[float]) -> list[float]:
        if steps != sorted(set(steps)):
            raise ValueError("steps must rise, e.g. [5, 25, 50, 100]")
        return steps


class MatchLoad(Strict):
    """When the candidate and the baseline never meet one load (a light canary on a busy model under steady
    traffic), the guard matches their load for a while (load matching): the model's requests drawn for either of the two go to whichever
    has fewer in flight per replica, until the candidate has been judged at a load both met, or for at most
    `calls` of the candidate's calls; then the weights rule again. At most once per `window_seconds`."""

    calls: int = Field(150, ge=1, le=1_000_000)  # the candidate's calls one load matching lasts at most


class Guard(Strict):
    """Each candidate variant against the baseline, over a sliding window (policies/variant_guard.py): a
    breach sets the candidate's weight to 0 at once. A limit that is null is not checked."""

    baseline: str | None = Field(None, pattern=VARIANT)  # default: the first variant that is not a shadow
    window_seconds: Seconds = 300.0
    min_samples: int = Field(50, ge=1, le=1_000_000)  # per side and signal before it is judged
    max_validity_drop: float | None = Field(0.02, ge=0, le=1)  # structured-output validity, in points
    max_error_increase: float | None = Field(0.01, ge=0, le=1)  # the variant's own faults, in points
    max_itl_ratio: float | None = Field(1.2, gt=1, le=100)  # inter-token latency p50 at comparable load
    max_ttft_ratio: float | None = Field(1.5, gt=1, le=100)  # time to first token p50 at comparable load
    min_agreement: float | None = Field(0.9, ge=0, le=1)  # shadow answers equal to the live one (temperature 0)
    promotion: Promotion | None = None
    # null: never match the load, stay undecided; `even_load`, its former name, is still accepted
    match_load: MatchLoad | None = Field(default_factory=MatchLoad,
                                         validation_alias=AliasChoices("match_load", "even_load"))


class Sticky(Strict):
    """What keeps one conversation on one variant (and its prefix cache): the value of a request header when
    the request has it, else the API key when `key` is true; a request with neither is assigned at random."""

    header: str | None = Field(None, pattern=r"^[a-z0-9-]{1,64}$")
    key: bool = False
