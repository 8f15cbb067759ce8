"""What a policy implies: the settings objects backends/ takes (routing profiles are built per snapshot).

backends/ knows nothing of the policy file's schema; each piece it runs (the replicas and their health
timings, the rented providers) is handed plain settings built here.
"""

from __future__ import annotations

from backends.rented import Price, ProviderSettings, RentedProviders
from backends.replicas import HealthTimings, Replica, ReplicaSet
from policies.config import Health, Model, Policy, backend_name


def health_timings(health: Health) -> HealthTimings:
    return HealthTimings(interval=health.interval, failure_threshold=health.failure_threshold,
                         backoff_initial=health.backoff_initial, backoff_max=health.backoff_max)


def replicas_of(model: Model) -> list[Replica]:
    return [
        Replica(
            name=backend_name(model, i),
            model=model.name,
            url=backend.url,
            served_name=backend.served_name or model.served_name or model.name,
            cap=backend.cap,
            health_path=backend.health_path,
            adaptive=backend.adaptive,
            priority_scheduling=backend.scheduling_policy == "priority",
        )
        for i, backend in enumerate(model.backends)
    ]


def replica_set(policy: Policy, on_change=None) -> ReplicaSet:
    return ReplicaSet({m.name: replicas_of(m) for m in policy.models}, health_timings(policy.health), on_change)


def rented_providers(policy: Policy) -> RentedProviders:
    providers = [
        ProviderSettings(
            name=p.name, base_url=p.base_url, api_key_env=p.api_key_env, models=dict(p.models),
            price=Price(p.price_per_million_tokens.input, p.price_per_million_tokens.output), timeout=p.timeout,
        )
        for p in policy.providers
    ]
    return RentedProviders(providers, {m.name: m.overflow.provider for m in policy.models if m.overflow})
