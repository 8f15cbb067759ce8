"""The routing profiles built in: every policy has them."""

from __future__ import annotations

from typing import Any

from policies.config.routing_profile import PluginRef, RoutingProfile


def _ref(name: str, weight: float = 1.0, **params: Any) -> PluginRef:
    return PluginRef(name=name, weight=weight, params=params)


# Profiles every policy has (a policy's own `routing.profiles` may add more or replace these by name).
BUILTIN_PROFILES: dict[str, RoutingProfile] = {
    # the prompt's cached prefix first, unless that replica is loaded past the guard; then vLLM's own queue
    "default": RoutingProfile(scorers=[_ref("lora-affinity", 8), _ref("prefix-affinity", 4), _ref("vllm-queue", 2),
                                       _ref("least-in-flight")]),
    "least-in-flight": RoutingProfile(scorers=[_ref("least-in-flight")]),
    "vllm-queue": RoutingProfile(scorers=[_ref("vllm-queue", 2), _ref("least-in-flight")]),
    "prefix-affinity": RoutingProfile(scorers=[_ref("prefix-affinity", 4), _ref("vllm-queue", 2),
                                               _ref("least-in-flight")]),
    "session-affinity": RoutingProfile(scorers=[_ref("session-affinity", 4), _ref("vllm-queue", 2),
                                                _ref("least-in-flight")]),
    "random": RoutingProfile(picker="random"),
}
