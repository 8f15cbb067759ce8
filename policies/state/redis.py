"""Several gateway replicas on one Redis: keys, usage, the cost ledger, the audit log, rate-limit buckets,
budgets and the backends' cap slots live there, so N replicas enforce one limit and one cap; variant weights and guard
verdicts are shared through it."""

from __future__ import annotations

from functools import partial

from policies.audit.redis import RedisAudit
from policies.batches.redis import RedisBatches
from policies.budget import RedisBudgets
from policies.config import Policy
from policies.fleet_caps import FleetModelQueue, FleetSlots
from policies.ledger.redis import RedisLedger
from policies.ratelimit.redis import RedisLimiter
from policies.background import Background
from policies.state import State
from policies.store.redis import RedisStore
from policies.store.redis_client import TLSFiles
from policies.variant_share import SharedVariants
from policies.variants import Variants


def open_state(policy: Policy, variants: Variants, background: Background) -> State:
    config = policy.store
    store = RedisStore(  # secrets are read from env or files now, never kept in the policy
        config.redis_url(), prefix=config.prefix, password=config.password(),
        sentinel_password=config.sentinel.password() if config.sentinel else None,
        tls_files=TLSFiles(config.tls_ca_file, config.tls_cert_file, config.tls_key_file))
    fleet = FleetSlots(store, policy.caps)
    queues = partial(FleetModelQueue, fleet=fleet, on_store_failure=policy.rate_limits.on_store_failure.concurrency)
    return State(store, RedisLimiter(store), RedisBudgets(store), RedisLedger(store, policy.ledger.bucket_seconds),
                 queues, RedisAudit(store), fleet, SharedVariants(store, variants, background), shared_store=store,
                 batches=RedisBatches(store))
