"""The whole policy: every section, and the checks that span sections (names, providers, profiles)."""

from __future__ import annotations

from pydantic import Field, model_validator

from policies.config.batches import BatchSettings
from policies.config.console import Console
from policies.config.access import Admin, Auth, Network, RateLimits
from policies.config.admission import Caps, Priorities
from policies.config.discovery import KubernetesAccess
from policies.config.fallbacks import check_fallbacks
from policies.config.base import Strict
from policies.config.model import Model, backend_name
from policies.config.observability import AccessLogSettings, Ledger, Tracing
from policies.config.providers import Provider
from policies.config.routing import Routing
from policies.config.routing_profile import RoutingProfile
from policies.config.server import Health, Listen, Server, Timeouts, UpstreamLimits
from policies.config.store import Store
from policies.config.lora import public_adapter_names


class Policy(Strict):
    listen: Listen = Listen()
    server: Server = Server()
    timeouts: Timeouts = Timeouts()
    upstream: UpstreamLimits = UpstreamLimits()
    health: Health = Health()
    routing: Routing = Routing()
    store: Store = Store()
    auth: Auth = Auth()
    admin: Admin = Admin()
    rate_limits: RateLimits = RateLimits()
    priorities: Priorities = Priorities()
    caps: Caps = Caps()
    network: Network = Network()
    kubernetes: KubernetesAccess = KubernetesAccess()
    ledger: Ledger = Ledger()
    providers: list[Provider] = []
    tracing: Tracing = Tracing()
    access_log: AccessLogSettings = AccessLogSettings()
    batch: BatchSettings = BatchSettings()
    console: Console = Console()
    models: list[Model] = Field(min_length=1)

    @model_validator(mode="after")
    def traced_content_models_exist(self) -> Policy:
        unknown = set(self.tracing.content_models) - {m.name for m in self.models}
        if unknown:
            raise ValueError(f"tracing.content_models names models that are not defined: {', '.join(sorted(unknown))}")
        return self

    @model_validator(mode="after")
    def fallbacks_resolve(self) -> Policy:
        check_fallbacks(self.models, self.providers)
        return self

    @model_validator(mode="after")
    def unique_names(self) -> Policy:
        seen: dict[str, str] = {}
        for model in self.models:
            for public in (model.name, *model.aliases, *public_adapter_names(model.lora)):
                if public in seen:
                    raise ValueError(f"model name or alias {public!r} is used twice ({seen[public]} and {model.name})")
                seen[public] = model.name
        backend_names: set[str] = set()
        for model in self.models:
            for i in range(len(model.backends)):
                name = backend_name(model, i)
                if name in backend_names:
                    raise ValueError(f"backend name {name!r} is used twice")
                backend_names.add(name)
        for model in self.models:
            if model.routing is not None and model.routing not in self.routing.known():
                raise ValueError(f"model {model.name}: routing profile {model.routing!r} is not defined; known: "
                                 f"{', '.join(sorted(self.routing.known()))}")
        providers = {p.name: p for p in self.providers}
        if len(providers) != len(self.providers):
            raise ValueError("provider names must be unique")
        for model in self.models:
            if model.overflow is None:
                continue
            provider = providers.get(model.overflow.provider)
            if provider is None:
                raise ValueError(f"model {model.name}: overflow provider {model.overflow.provider!r} is not declared")
            if model.name not in provider.models:
                raise ValueError(f"model {model.name}: provider {provider.name} has no mapping for it")
        for i, model in enumerate(self.models):
            if model.rented_price_from is not None and model.rented_price_from not in providers:
                raise ValueError(f"models[{i}](name={model.name}).rented_price_from: provider "
                                 f"{model.rented_price_from!r} is not declared")
            for j, backend in enumerate(model.backends):
                if backend.cost and backend.cost.power_kw and self.ledger.power_price_per_kwh is None:
                    raise ValueError(f"models[{i}](name={model.name}).backends[{j}].cost.power_kw: needs "
                                     "ledger.power_price_per_kwh to price the power")
        return self


def profile_of(policy: Policy, model: Model) -> tuple[str, RoutingProfile]:
    name = model.routing or policy.routing.default_profile
    return name, policy.routing.profile(name)
