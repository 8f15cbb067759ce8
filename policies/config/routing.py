"""The policy's `routing` section: the replicas' scraped stats and the profiles models route by."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from policies.config.base import NAME, Strict
from policies.config.profiles import BUILTIN_PROFILES
from policies.config.routing_profile import RoutingProfile


class Scrape(Strict):
    """Polling each owned replica's vLLM /metrics (load, KV cache, prefix cache) for routing."""

    enabled: bool = True
    interval: float = Field(0.25, ge=0.05, le=60)  # seconds between scrapes of every replica
    timeout: float = Field(1.0, gt=0, le=60)  # one scrape; a slow or failed one leaves the stats to go stale
    stale_after: float | None = Field(None, gt=0, le=600)  # older stats are ignored (default: 4 x interval, >= 1 s)
    # one scrape's body; vLLM's exposition is ~50 KB (more with many LoRA adapters): past this it is dropped
    max_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024, le=256 * 1024**2)


class Routing(Strict):
    scrape: Scrape = Scrape()
    default_profile: str = Field("default", pattern=NAME)  # for models that name none
    profiles: dict[Annotated[str, Field(pattern=NAME)], RoutingProfile] = {}

    def profile(self, name: str) -> RoutingProfile:
        return self.profiles.get(name) or BUILTIN_PROFILES[name]

    def known(self) -> set[str]:
        return set(BUILTIN_PROFILES) | set(self.profiles)

    @model_validator(mode="after")
    def default_exists(self) -> Routing:
        if self.default_profile not in self.known():
            raise ValueError(f"default_profile {self.default_profile!r} is not a profile; known: "
                             f"{', '.join(sorted(self.known()))}")
        return self
