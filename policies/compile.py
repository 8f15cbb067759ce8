"""What a policy implies: the settings objects backends/ takes (routing profiles are built per snapshot).

backends/ knows nothing of the policy file's schema; each piece it runs (the replicas and their health
timings, the rented providers) is handed plain settings built here.
"""

from __future__ import annotations

from collections.abc import Callable

from backends.kv_events import KVEventSource
from backends.rented import Price, ProviderSettings, RentedProviders
from backends.replicas import AdaptiveLimit, HealthTimings, Replica, ReplicaSet
from policies.config import Adaptive, Health, KVEvents, Model, Policy, Variant, backend_name, groups_of


def health_timings(health: Health) -> HealthTimings:
    return HealthTimings(interval=health.interval, failure_threshold=health.failure_threshold,
                         backoff_initial=health.backoff_initial, backoff_max=health.backoff_max)


def adaptive_limit(adaptive: Adaptive | None) -> AdaptiveLimit | None:
    return AdaptiveLimit(adaptive.floor, adaptive.target_ttft) if adaptive is not None else None


def replicas_of(model: Model) -> list[Replica]:
    """The replicas of a model's `backends` list (its variants' lists, flattened in order, when it has any)."""
    variants: list[Variant | None] = [v for v in model.variants for _ in v.backends] or [None] * len(model.backends)
    return [
        Replica(
            name=backend_name(model, i),
            model=model.name,
            url=backend.url,
            served_name=backend.served_name or (variant and variant.served_name) or model.served_name or model.name,
            cap=backend.cap,
            health_path=backend.health_path,
            adaptive=adaptive_limit(backend.adaptive),
            priority_scheduling=backend.scheduling_policy == "priority",
            variant=variant.name if variant else None,
            kv_events=kv_event_source(backend.kv_events),
        )
        for i, (backend, variant) in enumerate(zip(model.backends, variants, strict=True))
    ]


def kv_event_source(config: KVEvents | None) -> KVEventSource | None:
    if config is None:
        return None
    address = config.bind or config.connect
    assert address is not None  # the schema wants exactly one of them
    return KVEventSource(address, config.bind is not None, config.topic,
                         config.max_message_bytes, config.max_blocks, config.replay)


def replica_groups(model: Model) -> dict[str, list[Replica]]:
    """A model's static replicas by set (policies/config/model.py groups_of); a discovered set starts empty."""
    replicas = replicas_of(model)
    return {group: [r for r in replicas if r.group == group] for group, _ in groups_of(model)}


def replica_set(policy: Policy, on_change: Callable[[Replica], None] | None = None) -> ReplicaSet:
    return ReplicaSet({g: rs for m in policy.models for g, rs in replica_groups(m).items()},
                      health_timings(policy.health), on_change)


def rented_providers(policy: Policy) -> RentedProviders:
    providers = [
        ProviderSettings(
            name=p.name, base_url=p.base_url, api_key_env=p.api_key_env, models=dict(p.models),
            price=Price(p.price_per_million_tokens.input, p.price_per_million_tokens.output), timeout=p.timeout,
            send_trace_context=p.send_trace_context,
        )
        for p in policy.providers
    ]
    return RentedProviders(providers, {m.name: m.overflow.provider for m in policy.models if m.overflow})
