"""The policy file: one YAML document that says which models exist and where they are served.

Validated by pydantic with unknown keys rejected, so a typo is an error at load time rather than a setting
that silently does nothing. `load_policy` turns every problem into one `PolicyError` whose lines name the
offending field (`models[0].backends[1].url: ...`).

The schema lives in one module per concern (server, routing, store, access, providers, backend, admission,
scaling, discovery, variants, reliability, fallbacks, model, observability, policy); secrets from the environment
or files in env_secrets, the built-in routing profiles in profiles, the YAML loader in loader. Every name is
importable from here, as before the split.
"""

from policies.config.access import (
    PRIVATE_CIDRS,
    Admin,
    Auth,
    FailureMode,
    LimitValues,
    Network,
    OnStoreFailure,
    RateLimits,
)
from policies.config.admission import Caps, Priorities, PriorityClass, Queue
from policies.config.backend import ZMQ_TCP, Adaptive, Backend, KVEvents, OwnedCost
from policies.config.base import NAME, EnvName, HostPort, PolicyError, Seconds, Strict, http_url
from policies.config.discovery import DNS_NAME, Discovery, KubernetesAccess
from policies.config.env_secrets import secret
from policies.config.fallbacks import Fallback, RentedStep
from policies.config.loader import format_errors, load_policy, parse_policy
from policies.config.model import Model, backend_name, groups_of, replica_cap
from policies.config.observability import AccessLogSettings, Ledger, Tracing
from policies.config.policy import Policy, profile_of
from policies.config.profiles import BUILTIN_PROFILES
from policies.config.providers import Overflow, Price, Provider
from policies.config.reliability import Ejection, Retries
from policies.config.routing import Routing, Scrape
from policies.config.routing_profile import PluginRef, RoutingProfile
from policies.config.scaling import Autoscaling
from policies.config.server import Health, Listen, Server, Timeouts, UpstreamLimits
from policies.config.store import RedisClusterNodes, RedisSentinel, Store
from policies.config.variants import VARIANT, Guard, Promotion, Sticky, Variant

__all__ = [
    "AccessLogSettings",
    "Adaptive",
    "Admin",
    "Auth",
    "Autoscaling",
    "BUILTIN_PROFILES",
    "Backend",
    "Caps",
    "DNS_NAME",
    "Discovery",
    "Ejection",
    "EnvName",
    "Fallback",
    "FailureMode",
    "Guard",
    "Health",
    "HostPort",
    "KVEvents",
    "KubernetesAccess",
    "Ledger",
    "LimitValues",
    "Listen",
    "Model",
    "NAME",
    "Network",
    "OnStoreFailure",
    "Overflow",
    "OwnedCost",
    "PRIVATE_CIDRS",
    "PluginRef",
    "Policy",
    "Price",
    "Provider",
    "PolicyError",
    "Priorities",
    "PriorityClass",
    "Promotion",
    "Queue",
    "RateLimits",
    "RedisClusterNodes",
    "RedisSentinel",
    "RentedStep",
    "Retries",
    "Routing",
    "RoutingProfile",
    "Scrape",
    "Seconds",
    "Server",
    "Sticky",
    "Store",
    "Strict",
    "Timeouts",
    "Tracing",
    "UpstreamLimits",
    "VARIANT",
    "Variant",
    "ZMQ_TCP",
    "backend_name",
    "format_errors",
    "groups_of",
    "http_url",
    "load_policy",
    "parse_policy",
    "profile_of",
    "replica_cap",
    "secret",
]
