"""Rented providers: OpenAI-compatible APIs the gateway may spill bursts to, the only declared public egress.

Each provider's API key comes from the environment variable the policy file names, never from the file, and
is sent only to that provider. A provider whose key is missing is disabled (logged by name, not by value).
For routing, every (provider, model) pair is a pseudo-replica: no cap, no health checks, never retried.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from backends.http1 import Client
from backends.replicas import UP, Replica
from backends.upstream import Upstream

log = logging.getLogger("gateway.rented")


@dataclass(frozen=True, slots=True)
class Price:
    input: float = 0.0  # currency units per million prompt tokens
    output: float = 0.0  # per million completion tokens


@dataclass(frozen=True)
class ProviderSettings:
    name: str
    base_url: str  # including the /v1
    api_key_env: str  # the environment variable that holds its API key
    models: dict[str, str] = field(default_factory=dict)  # our public model -> the provider's model
    price: Price = Price()
    timeout: float = 120.0
    send_trace_context: bool = False  # the trace context headers go to it only when the policy says so


class RentedProviders:
    """`overflow` maps each public model that may spill to the name of its provider."""

    def __init__(self, providers: list[ProviderSettings], overflow: dict[str, str]) -> None:
        self.prices: dict[str, Price] = {p.name: p.price for p in providers}
        self.timeouts = {p.name: p.timeout for p in providers}
        self.keys: dict[str, str] = {}
        self.trace_context = {p.name for p in providers if p.send_trace_context}  # providers told of traces
        for provider in providers:
            key = os.environ.get(provider.api_key_env, "")
            if key:
                self.keys[provider.name] = key
            else:
                log.error("rented provider %s is disabled: environment variable %s is not set",
                          provider.name, provider.api_key_env)
        self.targets: dict[str, Replica] = {}  # public model -> its overflow target
        by_name = {p.name: p for p in providers}
        for model, provider_name in overflow.items():
            provider = by_name[provider_name]
            if provider.name in self.keys:
                self.targets[model] = Replica(
                    name=f"rented:{provider.name}", model=model, url=provider.base_url,
                    served_name=provider.models[model], rented=provider.name, state=UP,
                )

    def connect(self, client: Client) -> None:
        """Each target's upstream through `client`, carrying its provider's key (made once per client)."""
        for target in self.targets.values():
            if target.upstream is None or target.upstream.client is not client:
                target.upstream = Upstream(client, target.url, timeout=self.timeouts[target.rented],
                                           headers={"authorization": f"Bearer {self.keys[target.rented]}"})

    def cost(self, provider: str, prompt_tokens: int, completion_tokens: int) -> float:
        price = self.prices[provider]
        return (prompt_tokens * price.input + completion_tokens * price.output) / 1_000_000
