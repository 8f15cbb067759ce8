"""A policy snapshot: everything one version of the policy file implies, built once and swapped in whole.

`compile_snapshot(policy, previous, ...)` builds the pieces a request runs through (routing profiles, the
admission queues, the pipeline's steps, the rented providers, the observers of its finished record) and reuses
what must outlive a reload, by name: a model's admission queue (its waiters and drain rate; its priority
classes are the new policy's at once, see ModelQueue.reprioritize) and its routing profile when its
configuration did not change (learning scorers keep their state). Rate-limit state lives in the limiter, keyed
by scope name, which every snapshot shares. The owned replicas are not part of a snapshot: the one live set
(backends/replicas.py) is brought to what the policy says by `apply_static_replicas`.

A request reads the snapshot once when it starts and runs under it to the end, so a swap never changes the
rules under a request in flight.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backends.rented import RentedProviders
from backends.replicas import ReplicaSet
from policies.accounting import RecordUsage
from policies.admission import Admission, ModelQueue, QueueFactory
from policies.auth import Authenticate, Authorize
from policies.background import Background
from policies.budget import Budget, Budgets
from policies.compile import rented_providers, replica_groups
from policies.config import Policy, groups_of, profile_of
from policies.finished import Observer, Observers
from policies.ledger.record import RecordLedger
from policies.metrics import GatewayMetrics
from policies.models import ResolveModel
from policies.network import ClientNetwork
from policies.ownership import Owners
from policies.pipeline import Pipeline
from policies.priority import Classify
from policies.ratelimit.base import Limiter
from policies.rate_limit import RateLimit
from policies.routing import Profile, Stats, build_profile
from policies.variants import AssignVariant, Variants, VariantSignals

# Parts of the policy that are read once at start (listener, store, timeouts of the shared client, health
# timings, scraping, admin tokens): a reload that changes them is refused, naming them, and the old policy
# keeps serving. Every other setting applies on reload (tests/unit/test_reload_classes.py holds both lists).
NEEDS_RESTART = ("listen", "server", "timeouts", "upstream", "health", "store", "auth", "admin", "tracing",
                 "caps", "ledger", "kubernetes", "routing.scrape", "rate_limits.on_store_failure",
                 "rate_limits.lease_seconds", "batch.enabled", "batch.files_dir")


@dataclass(frozen=True, eq=False)
class Snapshot:
    policy: Policy
    version: str  # sha256 of the policy file's text (the first 16 hex digits)
    loaded_at: float  # unix seconds
    profiles: dict[str, Profile]
    admission: Admission
    rented: RentedProviders
    client_network: ClientNetwork
    pipeline: Pipeline
    observers: Observers  # of every finished call (policies/finished.py)
    rate_limit: RateLimit | None = None  # the pipeline's limits step, also for what the gateway answers itself


@dataclass(frozen=True)
class Shared:
    """What every snapshot of one process uses: state that is not the policy's to replace."""

    replicas: ReplicaSet
    stats: Stats
    metrics: GatewayMetrics
    limiter: Limiter
    authenticate: Authenticate
    owners: Owners
    record_usage: RecordUsage
    background: Background  # gateway.background.Background.run
    queues: QueueFactory = ModelQueue  # the store kind's (policies/state): caps in this process or the fleet's
    budgets: Budgets | None = None  # per-key spend (policies/budget.py)
    record_ledger: RecordLedger | None = None  # the cost ledger's observer
    variants: Variants = field(default_factory=Variants)  # every model's variant weights (policies/variants.py)
    # the HTTP shell's observers for a snapshot (access log, tracing, shadow copies): it knows them, not we
    observers: Callable[[Policy, Admission], Sequence[Observer]] = lambda policy, admission: ()
    # the LoRA adapters a model's replicas say they hold (backends/lora.py LoraAdapters.found), for lora.discover
    lora_found: Callable[[str], Mapping[str, Any]] | None = None


def version_of(text: str | bytes) -> str:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()[:16]


def compile_snapshot(policy: Policy, previous: Snapshot | None, shared: Shared, version: str) -> Snapshot:
    """Build the snapshot of `policy`; the replicas of its models must already be in `shared.replicas`."""
    profiles = {}
    for model in policy.models:
        name, config = profile_of(policy, model)
        if previous is not None and model.name in previous.profiles and _same_profile(previous.policy, policy,
                                                                                     model.name):
            profiles[model.name] = previous.profiles[model.name]
        else:
            profiles[model.name] = build_profile(config, model.name, shared.stats, shared.metrics, name=name)
    admission = Admission(policy, shared.replicas, profiles, shared.metrics, shared.queues)
    if previous is not None:
        for model in policy.models:
            for group, _ in groups_of(model):
                queue = previous.admission.queues.get(group)
                if queue is not None:  # waiters, drain rate and adaptive cuts carry over; the settings are new
                    queue.config, queue.profile = model.queue, profiles[model.name]
                    queue.autoscaling = model.autoscaling
                    queue.reprioritize(policy.priorities)
                    queue.set_batch_class(policy.batch.priority_class)
                    queue.replicas = shared.replicas.by_model[group]
                    admission.queues[group] = queue
    shared.variants.configure(policy)
    client_network = ClientNetwork(policy.network)
    rented = rented_providers(policy)
    budget = [Budget(policy, shared.budgets, rented.cost, shared.background)] if shared.budgets is not None else []
    rate_limit = RateLimit(policy, shared.limiter, shared.background, shared.metrics)
    pipeline = Pipeline([
        client_network,
        shared.authenticate,
        shared.owners,
        ResolveModel(policy, shared.lora_found),
        *([AssignVariant(shared.variants, shared.replicas.load_of)] if shared.variants.models else []),
        Authorize(),
        Classify(policy),
        rate_limit,
        *budget,
    ])
    observers = Observers([
        *budget,  # first: settles what the call reserved, before the key's next request reserves again
        *([VariantSignals(shared.variants)] if shared.variants.models else []),
        shared.record_usage,
        *([shared.record_ledger] if shared.record_ledger is not None and policy.ledger.enabled else []),
        shared.metrics,
        *shared.observers(policy, admission),
    ], shared.metrics.observer_failed)
    return Snapshot(policy, version, time.time(), profiles, admission, rented, client_network, pipeline, observers,
                    rate_limit)


def apply_static_replicas(policy: Policy, replicas: ReplicaSet) -> None:
    """Bring the live set to the policy's `backends:` lists; models the policy no longer has are drained.
    Models found by discovery get their replicas from their source (policies/discovery.py)."""
    wanted = set()
    for model in policy.models:
        static = replica_groups(model)
        for group, variant in groups_of(model):
            wanted.add(group)
            if (variant or model).discovery is None:
                replicas.apply(group, static[group])
            else:  # its source (policies/discovery.py) fills it
                replicas.by_model.setdefault(group, [])
    for name in list(replicas.by_model):
        if name not in wanted:
            replicas.remove_model(name)


def restart_needed(old: Policy, new: Policy) -> list[str]:
    """The read-once settings (dotted paths) that differ between the two policies."""
    return [path for path in NEEDS_RESTART if setting(old, path) != setting(new, path)]


def setting(policy: Policy, path: str) -> object:
    value: object = policy
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _same_profile(old: Policy, new: Policy, model: str) -> bool:
    before = next((m for m in old.models if m.name == model), None)
    after = next(m for m in new.models if m.name == model)
    return before is not None and profile_of(old, before) == profile_of(new, after)
