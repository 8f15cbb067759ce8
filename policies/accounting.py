"""Pipeline step: record each finished request's usage (requests and tokens by key and model) in the store.

Finished calls are summed in memory per (key, model, rented) and written every `FLUSH_EVERY` seconds, one
store write per pair, by the gateway's background runner: the client never waits on the store, and a busy
gateway makes a handful of writes a second instead of one per request. A batch the store refused is kept and
tried again with the next one (it is a few counters per pair, so nothing grows without bound). The admin API
flushes before it reads usage, and shutdown flushes what is left.
"""

from __future__ import annotations

import asyncio

from policies.pipeline import Call
from policies.store import Store

FLUSH_EVERY = 0.25  # seconds


def _tokens(usage: object, field: str) -> int:
    value = usage.get(field) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and value > 0 else 0


class RecordUsage:
    name = "record-usage"

    def __init__(self, store: Store, background) -> None:
        self.store = store
        self.background = background
        self.pending: dict[tuple[str, str, bool], list[int]] = {}  # -> [requests, prompt, completion]
        self.flush_handle: asyncio.TimerHandle | None = None

    async def enter(self, call: Call) -> None:
        pass

    async def leave(self, call: Call) -> None:
        if call.key is None or not call.model or call.replica is None:
            return  # refused before reaching a backend: nothing was used
        self.add((call.key.id, call.model, call.replica.rented is not None), 1,
                 _tokens(call.usage, "prompt_tokens"), _tokens(call.usage, "completion_tokens"))
        if self.flush_handle is None:
            self.flush_handle = asyncio.get_running_loop().call_later(FLUSH_EVERY, self._flush_later)

    def add(self, pair: tuple[str, str, bool], requests: int, prompt: int, completion: int) -> None:
        totals = self.pending.get(pair)
        if totals is None:
            self.pending[pair] = [requests, prompt, completion]
        else:
            totals[0] += requests
            totals[1] += prompt
            totals[2] += completion

    def _flush_later(self) -> None:
        self.flush_handle = None
        self.background(self.flush())

    async def flush(self) -> None:
        """Write everything summed so far; what the store refuses goes back for the next flush."""
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        batch, self.pending = self.pending, {}
        items = list(batch.items())
        for i, ((key_id, model, rented), (requests, prompt, completion)) in enumerate(items):
            try:
                await self.store.add_usage(key_id, model, requests=requests, prompt_tokens=prompt,
                                           completion_tokens=completion, rented=rented)
            except BaseException:
                for pair, totals in items[i:]:
                    self.add(pair, *totals)
                if self.flush_handle is None:
                    self.flush_handle = asyncio.get_running_loop().call_later(4 * FLUSH_EVERY, self._flush_later)
                raise
