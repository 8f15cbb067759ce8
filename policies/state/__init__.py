"""Everything a store kind implies, opened in one place: the store, the rate limiter, the backends' caps, the
budgets, the cost ledger, the audit log, the shared variant weights, the admission queues' factory and the
Batch API's state.

Each kind is one module (policies/state/embedded.py: SQLite and this process's memory; policies/state/redis.py:
one Redis for every gateway replica) with an `open_state(policy, variants, background) -> State`; `KINDS` names
the module of each `store.kind`, so a new kind is one module and one line here. Nothing else asks which store
it was given.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policies.admission import QueueFactory
from policies.audit.log import AuditLog
from policies.background import Background
from policies.budget import Budgets
from policies.config import Policy
from policies.ledger.sums import Ledger
from policies.ratelimit.base import Limiter
from policies.store import Store
from policies.store.redis import RedisStore
from policies.variants import Variants

if TYPE_CHECKING:
    from policies.batches.store import BatchStore
    from policies.fleet_caps import FleetSlots
    from policies.variant_share import SharedVariants

KINDS = {"sqlite": "policies.state.embedded", "redis": "policies.state.redis"}


@dataclass(frozen=True, eq=False)
class State:
    store: Store
    limiter: Limiter
    budgets: Budgets
    ledger: Ledger
    queues: QueueFactory  # makes each model's admission queue
    audit: AuditLog  # the admin acts (policies/audit)
    fleet: FleetSlots | None = None  # caps counted across every gateway replica; None: in this process
    shared_variants: SharedVariants | None = None  # variant weights and verdicts other replicas adopt
    shared_store: RedisStore | None = None  # the store every gateway replica shares (None: this process alone)
    batches: BatchStore | None = None  # the Batch API's files, batches and lines (policies/batches/)


def open_state(policy: Policy, variants: Variants, background: Background) -> State:
    """The state of `policy.store.kind`; its store connects lazily (State.store.ping() says if it answers)."""
    module = importlib.import_module(KINDS[policy.store.kind])
    state: State = module.open_state(policy, variants, background)
    return state
