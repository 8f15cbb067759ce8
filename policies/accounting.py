"""Observer of finished calls (policies/finished.py): record each request's usage (requests and tokens by key
and model) in the store.

A call served by a variant of its model (policies/variants.py) is recorded under its replica set's name,
`model#variant` (backends/replicas.py group_name), so the usage ledger says which variant each key's tokens
went to; the admin view (`by_model`) sums a model's variants into the model and lists them beside it.

Finished calls are summed in memory per (key, model, rented) and written every `FLUSH_EVERY` seconds, one
store write per pair, by the gateway's background runner: the client never waits on the store, and a busy
gateway makes a handful of writes a second instead of one per request. A batch the store refused is kept and
tried again with the next one (it is a few counters per pair, so nothing grows without bound). The admin API
flushes before it reads usage, and shutdown flushes what is left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from backends.replicas import split_group
from policies.background import Background
from policies.finished import Finished
from policies.store import Store

FLUSH_EVERY = 0.25  # seconds


class FlushTimer:
    """Runs `flush()` on the background runner `every` seconds after something first waits for it (`arm`),
    once per arming; a flush that failed re-arms with a longer delay. Shared by the usage and cost ledgers."""

    def __init__(self, every: float, background: Background, flush: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.every = every
        self.background = background
        self.flush = flush
        self.handle: asyncio.TimerHandle | None = None

    def arm(self, factor: float = 1.0) -> None:
        if self.handle is None:
            self.handle = asyncio.get_running_loop().call_later(factor * self.every, self._fire)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _fire(self) -> None:
        self.handle = None
        self.background(self.flush())


class RecordUsage:
    name = "record-usage"

    def __init__(self, store: Store, background: Background) -> None:
        self.store = store
        self.background = background
        self.pending: dict[tuple[str, str, bool], list[int]] = {}  # -> [requests, prompt, completion]
        self.timer = FlushTimer(FLUSH_EVERY, background, self.flush)

    def observe(self, record: Finished) -> None:
        if record.key_id is None or not record.model or record.replica is None:
            return  # refused before reaching a backend: nothing was used
        self.add((record.key_id, record.group, record.rented is not None), 1, record.prompt_tokens,
                 record.completion_tokens)
        self.timer.arm()

    def add(self, pair: tuple[str, str, bool], requests: int, prompt: int, completion: int) -> None:
        totals = self.pending.get(pair)
        if totals is None:
            self.pending[pair] = [requests, prompt, completion]
        else:
            totals[0] += requests
            totals[1] += prompt
            totals[2] += completion

    async def flush(self) -> None:
        """Write everything summed so far; what the store refuses goes back for the next flush."""
        self.timer.cancel()
        batch, self.pending = self.pending, {}
        items = list(batch.items())
        for i, ((key_id, model, rented), (requests, prompt, completion)) in enumerate(items):
            try:
                await self.store.add_usage(key_id, model, requests=requests, prompt_tokens=prompt,
                                           completion_tokens=completion, rented=rented)
            except BaseException:
                for pair, totals in items[i:]:
                    self.add(pair, *totals)
                self.timer.arm(4)
                raise


def merged(usages: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Several keys' usage rows summed into one (a team's), by model (or model#variant)."""
    out: dict[str, dict[str, int]] = {}
    for rows in usages:
        for name, counts in rows.items():
            total = out.setdefault(name, dict.fromkeys(counts, 0))
            for field, value in counts.items():
                total[field] = total.get(field, 0) + value
    return dict(sorted(out.items()))


def totals(models: dict[str, dict[str, int]]) -> dict[str, int]:
    """Every model's counters summed."""
    out: dict[str, int] = {}
    for counts in models.values():
        for name, value in counts.items():
            out[name] = out.get(name, 0) + value
    return out


def by_model(rows: dict[str, dict[str, int]]) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, dict[str, int]]]]:
    """A key's usage rows ({model or model#variant: counters}) as (per model, summing its variants; per model
    with variants, per variant)."""
    models: dict[str, dict[str, int]] = {}
    variants: dict[str, dict[str, dict[str, int]]] = {}
    for name, counts in rows.items():
        model, variant = split_group(name)
        total = models.setdefault(model, dict.fromkeys(counts, 0))
        for field, value in counts.items():
            total[field] = total.get(field, 0) + value
        if variant:
            variants.setdefault(model, {})[variant] = dict(counts)
    return models, variants
