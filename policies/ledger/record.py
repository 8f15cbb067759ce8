"""The ledger's observer: a pipeline step whose `leave` adds each finished call to in-memory sums.

Nothing waits on the ledger's store: `leave` updates a few counters, and every `flush_seconds` the background
runner writes what was summed (one transaction in SQLite, one MULTI per bucket in Redis). A batch the store
refused goes back into the sums and is tried with the next flush, up to MAX_ROWS rows; past that it is
dropped and counted (llm_gateway_background_write_errors). Shutdown flushes what is left, so a restart keeps
everything but a crash's last flush interval.
"""

from __future__ import annotations

import time

from policies.accounting import FlushTimer, usage_tokens
from policies.ledger.sums import Sums
from policies.pipeline import Call

MAX_ROWS = 100_000


class RecordLedger:
    name = "record-ledger"

    def __init__(self, ledger, config, rented_cost, background, on_lost=None) -> None:
        self.ledger = ledger
        self.config = config  # policies.config.Ledger
        self.rented_cost = rented_cost  # (provider, prompt, completion) -> currency units
        self.background = background
        self.on_lost = on_lost
        self.sums = Sums(config.bucket_seconds)
        self.wall = time.time() - time.perf_counter()  # perf_counter -> unix seconds
        self.timer = FlushTimer(config.flush_seconds, background, self.flush)

    async def enter(self, call: Call) -> None:
        pass

    async def leave(self, call: Call) -> None:
        replica = call.replica
        if replica is None or not call.model or call.sent_at == 0.0:
            return  # refused before reaching a backend: nothing was used
        now = time.perf_counter() + self.wall
        prompt, completion = usage_tokens(call.usage, "prompt_tokens"), usage_tokens(call.usage, "completion_tokens")
        rented = replica.rented
        cost = self.rented_cost(rented, prompt, completion) if rented else 0.0
        key_id = call.key.id if call.key is not None else ""
        estimated = isinstance(call.usage, dict) and call.usage.get("estimated") is True
        self.sums.call(now, call.model, replica.name, key_id, rented is not None, prompt, completion,
                       call.queue_wait, cost, estimated)
        if rented is None:
            self.sums.in_flight(call.model, replica.name, call.sent_at + self.wall, now)
        self.timer.arm()

    async def flush(self) -> None:
        """Write what was summed; a refused batch goes back for the next flush (bounded)."""
        self.timer.cancel()
        batch = self.sums.take()
        if not batch.rows:
            return
        try:
            await self.ledger.add(batch, self.config.retention_days * 86400, time.time())
        except BaseException:
            if not self.sums.put_back(batch, MAX_ROWS) and self.on_lost is not None:
                self.on_lost("dropped")
            self.timer.arm(4)
            raise
