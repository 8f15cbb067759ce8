"""One gateway process: keys, usage, the cost ledger and the audit log in one SQLite file (WAL); rate limits,
caps and budgets counted in this process's memory; variant weights are this process's own."""

from __future__ import annotations

from policies.admission import ModelQueue
from policies.audit.sqlite import SQLiteAudit
from policies.batches.sqlite import SQLiteBatches
from policies.budget import MemoryBudgets
from policies.config import Policy
from policies.ledger.sqlite import SQLiteLedger
from policies.ratelimit.memory import MemoryLimiter
from policies.background import Background
from policies.state import State
from policies.store.sqlite import SQLiteStore
from policies.variants import Variants


def open_state(policy: Policy, variants: Variants, background: Background) -> State:
    store = SQLiteStore(policy.store.path)
    ledger = SQLiteLedger(store.path)

    async def members(team: str) -> list[str]:  # a team's keys, whose ledger rows its budget starts from
        return [k.id for k in await store.list_keys() if k.team == team]

    return State(store, MemoryLimiter(), MemoryBudgets(ledger, members), ledger, ModelQueue, SQLiteAudit(store.path),
                 batches=SQLiteBatches(store.path))
