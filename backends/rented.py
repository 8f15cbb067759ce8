"""Rented providers: OpenAI-compatible APIs the gateway may spill bursts to, the only declared public egress.

Each provider's API key comes from the environment variable the policy file names, never from the file, and
is sent only to that provider. A provider whose key is missing is disabled (logged by name, not by value).
For routing, every (provider, model) pair is a pseudo-replica: no cap, no health checks, never retried.
"""

from __future__ import annotations

import logging
import os


from backends.replicas import UP, Replica
from backends.http1 import Client
from backends.upstream import Upstream
from gateway.config import Policy, Price

log = logging.getLogger("gateway.rented")


class RentedProviders:
    def __init__(self, policy: Policy) -> None:
        self.prices: dict[str, Price] = {p.name: p.price_per_million_tokens for p in policy.providers}
        self.timeouts = {p.name: p.timeout for p in policy.providers}
        self.keys: dict[str, str] = {}
        for provider in policy.providers:
            key = os.environ.get(provider.api_key_env, "")
            if key:
                self.keys[provider.name] = key
            else:
                log.error("rented provider %s is disabled: environment variable %s is not set",
                          provider.name, provider.api_key_env)
        self.targets: dict[str, Replica] = {}  # public model -> its overflow target
        for model in policy.models:
            if model.overflow is None:
                continue
            provider = next(p for p in policy.providers if p.name == model.overflow.provider)
            if provider.name in self.keys:
                self.targets[model.name] = Replica(
                    name=f"rented:{provider.name}", model=model.name, url=provider.base_url,
                    served_name=provider.models[model.name], rented=provider.name, state=UP,
                )

    def upstreams(self, client: Client) -> dict[Replica, Upstream]:
        return {
            target: Upstream(client, target.url, headers={"authorization": f"Bearer {self.keys[target.rented]}"},
                             timeout=self.timeouts[target.rented])
            for target in self.targets.values()
        }

    def cost(self, provider: str, prompt_tokens: int, completion_tokens: int) -> float:
        price = self.prices[provider]
        return (prompt_tokens * price.input + completion_tokens * price.output) / 1_000_000
