"""The ledger's observer of finished calls (policies/finished.py): adds each one to in-memory sums.

Nothing waits on the ledger's store: `observe` updates a few counters, and every `flush_seconds` the background
runner writes what was summed (one transaction in SQLite, one MULTI per bucket in Redis). A batch the store
refused goes back into the sums and is tried with the next flush, up to MAX_ROWS rows; past that it is
dropped and counted (llm_gateway_background_write_errors). Shutdown flushes what is left, so a restart keeps
everything but a crash's last flush interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from policies.accounting import FlushTimer
from policies.background import Background
from policies.config import Ledger as LedgerConfig
from policies.finished import Finished
from policies.ledger.sums import Ledger, Sums

MAX_ROWS = 100_000


class RecordLedger:
    name = "record-ledger"

    def __init__(self, ledger: Ledger, config: LedgerConfig, background: Background,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.ledger = ledger
        self.config = config
        self.background = background
        self.on_lost = on_lost
        self.sums = Sums(config.bucket_seconds)
        self.wall = time.time() - time.perf_counter()  # perf_counter -> unix seconds
        self.timer = FlushTimer(config.flush_seconds, background, self.flush)

    def observe(self, record: Finished) -> None:
        replica = record.replica
        if replica is None or not record.model or record.sent_at == 0.0:
            return  # refused before reaching a backend: nothing was used
        now = record.ended_at + self.wall
        rented = replica.rented
        batch = record.call is not None and record.call.batch is not None  # a Batch API line: a class of its own
        self.sums.call(now, record.model, replica.name, record.key_id or "", rented is not None, record.prompt_tokens,
                       record.completion_tokens, record.queue_wait, record.cost, record.estimated, batch)
        if rented is None:  # the replica's busy time is its own model's (a LoRA adapter's calls keep its base busy)
            self.sums.in_flight(replica.model, replica.name, record.sent_at + self.wall, now)
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
